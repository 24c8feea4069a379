"""The codec's CUDA kernels: their source for every dtype, compiled on use."""

from mnopt.gpu.device import cupy


#: The codec's kernels: name -> (inputs, outputs, body), as
#: ``cupy.ElementwiseKernel`` takes them (with ``preamble=PREAMBLE``).  T is
#: the gradient dtype (float16, float32 or float64), W the wire's storage
#: dtype.
#:
#: One launch packs (or unpacks) every gradient of a dtype.  The launch's
#: index space gives each array a whole number of CHUNK-element chunks;
#: ``chunk_entry[c]`` is the table entry k that chunk c belongs to; element
#: j of entry k lives at ``ptrs[k][j]`` in its gradient and at
#: ``wire[wire_starts[k] + j]`` in the buffer, and chunk c holds elements
#: ``(c << CHUNK_BITS) - vstarts[k]`` onward (padding past an array's end is
#: skipped).  Each of a chunk's LANES threads moves VEC elements:
#:
#: - where both of the array's ends (gradient and wire) start on 16 bytes,
#:   VEC consecutive ones, read and written as 16-byte vectors (one
#:   ld/st.global.v4 per 16 bytes: a 16-bit wire's 8 elements in one);
#: - otherwise VEC elements LANES apart (coalesced), read before any is
#:   written, as before.
#:
#: Measured on an H100 (docs/gpu.md), ResNet-50's 162 float32 gradients
#: packed to float32: a binary search over the arrays per element reached
#: 0.31 of the copy bandwidth, this table with one element per thread 0.41,
#: four strided elements per thread 0.86; 16-bit wires moved 2 bytes per
#: load or store there (float16 pack 0.68, 16-bit unpacks 0.56-0.62), which
#: the vectors are for (not yet measured: docs/gpu.md).
#: ``first`` (one of the gradients) only tells CuPy what T is.
#:
#: The arithmetic is grad_buffer.HostCodec's, so GPU and host results are
#: bit-identical: divide in float32 unless the gradient or the wire is
#: float64 (then in float64), and round once into the wire; bfloat16
#: divides in float32, rounds to nearest-even and keeps NaN a NaN.  CuPy
#: compiles every kernel with -ftz=true, which would flush float32
#: subnormals to zero where the host keeps them: PREAMBLE's conversions and
#: division are PTX without .ftz (tests/test_cuda_kernels.py checks that
#: no kernel's PTX flushes).  On the 16-bit wires the kernels also count,
#: per array, the values that are not finite (gradients going in, means
#: coming out; mnopt/codecs/overflow.py): ``counts[slots[k]]`` is incremented
#: atomically, only for such values, so counting costs no pass of its own.
#:
#: tests/test_cuda_kernels.py compiles each for every dtype in KERNEL_TYPES,
#: without a GPU.
CHUNK_BITS = 10      # elements per chunk: 1024
VEC = 8              # elements per thread
LANE_BITS = 7        # threads per chunk: 128 = 1024 / VEC
assert (1 << LANE_BITS) * VEC == 1 << CHUNK_BITS

#: Helpers the kernel bodies call (after CuPy's typedefs of T and W).  The
#: bodies move raw storage (float16 as its bits in unsigned short), so that
#: 16-byte vectors are built and split in registers.
PREAMBLE = r'''
// CuPy 14 keeps float16 in a header of its own, which it includes only for
// kernels with a float16 parameter (CuPy 13 defines it in carray.cuh).
#if __has_include(<cupy/float16.cuh>)
#include <cupy/float16.cuh>
#endif

// How a dtype is held in memory: float16 as its bits.
template <typename E> struct mnopt_mem { typedef E type; };
template <> struct mnopt_mem<float16> { typedef unsigned short type; };

// float32 <-> float64 and float32 division, exactly as IEEE (and the host)
// do them: no .ftz, whatever CuPy's -ftz=true makes of plain C++.
__device__ __forceinline__ double mnopt_f64(float v) {
    double d; asm("cvt.f64.f32 %0, %1;" : "=d"(d) : "f"(v)); return d; }
__device__ __forceinline__ float mnopt_f32(double v) {
    float f; asm("cvt.rn.f32.f64 %0, %1;" : "=f"(f) : "d"(v)); return f; }
__device__ __forceinline__ float mnopt_div(float a, float b) {
    float q; asm("div.rn.f32 %0, %1, %2;" : "=f"(q) : "f"(a), "f"(b));
    return q; }
// float16 bits <-> float32 / float64, rounding once to nearest-even (a
// float32 subnormal becomes a float16 zero of its sign either way).
__device__ __forceinline__ float mnopt_h2f(unsigned short h) {
    return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ unsigned short mnopt_f2h(float v) {
    return __half_as_ushort(__float2half_rn(v)); }
__device__ __forceinline__ unsigned short mnopt_d2h(double v) {
    return __half_as_ushort(__double2half(v)); }

// A stored value as float32 / float64 (unsigned short: float16 bits, which
// widen exactly).
__device__ __forceinline__ float mnopt_to_f32(unsigned short v) {
    return mnopt_h2f(v); }
__device__ __forceinline__ float mnopt_to_f32(float v) { return v; }
__device__ __forceinline__ float mnopt_to_f32(double v) {
    return mnopt_f32(v); }
__device__ __forceinline__ double mnopt_to_f64(unsigned short v) {
    return mnopt_f64(mnopt_h2f(v)); }
__device__ __forceinline__ double mnopt_to_f64(float v) {
    return mnopt_f64(v); }
__device__ __forceinline__ double mnopt_to_f64(double v) { return v; }

// y = v rounded once to y's type (unsigned short: float16 bits).
__device__ __forceinline__ void mnopt_set(unsigned short &y,
                                          unsigned short v) { y = v; }
__device__ __forceinline__ void mnopt_set(unsigned short &y, float v) {
    y = mnopt_f2h(v); }
__device__ __forceinline__ void mnopt_set(unsigned short &y, double v) {
    y = mnopt_d2h(v); }
__device__ __forceinline__ void mnopt_set(float &y, unsigned short v) {
    y = mnopt_h2f(v); }
__device__ __forceinline__ void mnopt_set(float &y, float v) { y = v; }
__device__ __forceinline__ void mnopt_set(float &y, double v) {
    y = mnopt_f32(v); }
__device__ __forceinline__ void mnopt_set(double &y, unsigned short v) {
    y = mnopt_to_f64(v); }
__device__ __forceinline__ void mnopt_set(double &y, float v) {
    y = mnopt_f64(v); }
__device__ __forceinline__ void mnopt_set(double &y, double v) { y = v; }

// x / divisor in the host codec's precision: float64 if the gradient or
// the wire is float64, else float32.
template <bool wide> struct mnopt_quotient;
template <> struct mnopt_quotient<false> {
    template <typename X> __device__ __forceinline__ static float of(
            X x, double divisor) {
        return mnopt_div(mnopt_to_f32(x), mnopt_f32(divisor)); }
};
template <> struct mnopt_quotient<true> {
    template <typename X> __device__ __forceinline__ static double of(
            X x, double divisor) {
        return mnopt_to_f64(x) / divisor; }
};

// Not finite: every exponent bit set (bit tests: no flushing compare).
__device__ __forceinline__ bool mnopt_bad(unsigned short h) {
    return (h & 0x7C00u) == 0x7C00u; }
__device__ __forceinline__ bool mnopt_bad(float v) {
    return (__float_as_uint(v) & 0x7F800000u) == 0x7F800000u; }
__device__ __forceinline__ bool mnopt_bad(double v) {
    return (__double_as_longlong(v) & 0x7FF0000000000000ll)
        == 0x7FF0000000000000ll; }

// 16 bytes of global memory at a 16-byte aligned address, as one vector
// load / store (PTX: plain C++ gets split into narrower stores here).
__device__ __forceinline__ uint4 mnopt_load16(const void* p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ void mnopt_store16(void* p, uint4 v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// 8 consecutive values from / to 16-byte aligned global memory.
__device__ __forceinline__ void mnopt_load8(unsigned short (&x)[8],
                                            const unsigned short* p) {
    const uint4 v = mnopt_load16(p);
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; q++) {
        x[2 * q] = (unsigned short)(w[q] & 0xFFFFu);
        x[2 * q + 1] = (unsigned short)(w[q] >> 16);
    }
}
__device__ __forceinline__ void mnopt_store8(unsigned short* p,
                                             const unsigned short (&y)[8]) {
    mnopt_store16(p, make_uint4(
        y[0] | ((unsigned int)y[1] << 16), y[2] | ((unsigned int)y[3] << 16),
        y[4] | ((unsigned int)y[5] << 16), y[6] | ((unsigned int)y[7] << 16)));
}
__device__ __forceinline__ void mnopt_load8(float (&x)[8], const float* p) {
#pragma unroll
    for (int q = 0; q < 2; q++) {
        const uint4 v = mnopt_load16(p + 4 * q);
        x[4 * q] = __uint_as_float(v.x);
        x[4 * q + 1] = __uint_as_float(v.y);
        x[4 * q + 2] = __uint_as_float(v.z);
        x[4 * q + 3] = __uint_as_float(v.w);
    }
}
__device__ __forceinline__ void mnopt_store8(float* p, const float (&y)[8]) {
#pragma unroll
    for (int q = 0; q < 2; q++)
        mnopt_store16(p + 4 * q, make_uint4(
            __float_as_uint(y[4 * q]), __float_as_uint(y[4 * q + 1]),
            __float_as_uint(y[4 * q + 2]), __float_as_uint(y[4 * q + 3])));
}
__device__ __forceinline__ void mnopt_load8(double (&x)[8], const double* p) {
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const uint4 v = mnopt_load16(p + 2 * q);
        x[2 * q] = __hiloint2double((int)v.y, (int)v.x);
        x[2 * q + 1] = __hiloint2double((int)v.w, (int)v.z);
    }
}
__device__ __forceinline__ void mnopt_store8(double* p,
                                             const double (&y)[8]) {
#pragma unroll
    for (int q = 0; q < 4; q++)
        mnopt_store16(p + 2 * q, make_uint4(
            (unsigned int)__double2loint(y[2 * q]),
            (unsigned int)__double2hiint(y[2 * q]),
            (unsigned int)__double2loint(y[2 * q + 1]),
            (unsigned int)__double2hiint(y[2 * q + 1])));
}
'''

_TABLE = ('raw uint64 ptrs, raw int32 chunk_entry, raw int64 vstarts, '
          'raw int64 sizes, raw int64 wire_starts, raw int32 slots, '
          'raw T first')


def _body(src_type, dst_type, src, dst, op):
    """The kernel body around ``op``, which sets ``y`` (a dst_type&) from
    ``x`` (a src_type) and may use ``slot``."""
    return '''const long long c = (long long)i >> %(lane_bits)d;
const int k = chunk_entry[c];
const long long n = sizes[k];
const long long base = (c << %(chunk_bits)d) - vstarts[k];
const int lane = (int)((long long)i & %(lane_mask)d);
const int slot = slots[k];
const SRC* src = %(src)s;
DST* dst = %(dst)s;
if ((((unsigned long long)src | (unsigned long long)dst) & 15) == 0) {
    const long long j0 = base + (long long)lane * %(vec)d;
    if (j0 + %(vec)d <= n) {
        SRC xs[%(vec)d];
        DST ys[%(vec)d];
        mnopt_load8(xs, src + j0);
#pragma unroll
        for (int r = 0; r < %(vec)d; r++) {
            const SRC x = xs[r];
            DST &y = ys[r];
            OP
        }
        mnopt_store8(dst + j0, ys);
    } else {
        for (int r = 0; r < %(vec)d && j0 + r < n; r++) {
            const SRC x = src[j0 + r];
            DST &y = dst[j0 + r];
            OP
        }
    }
} else {
    // Coalesced: lane, lane + LANES, ...; every load before any store.
    const long long j0 = base + lane;
    SRC xs[%(vec)d];
#pragma unroll
    for (int r = 0; r < %(vec)d; r++) {
        const long long j = j0 + ((long long)r << %(lane_bits)d);
        if (j < n) xs[r] = src[j];
    }
#pragma unroll
    for (int r = 0; r < %(vec)d; r++) {
        const long long j = j0 + ((long long)r << %(lane_bits)d);
        if (j >= n) break;
        const SRC x = xs[r];
        DST &y = dst[j];
        OP
    }
}''' .replace('SRC', src_type).replace('DST', dst_type).replace(
        'OP', op.replace('\n', '\n            ')) % {
        'lane_bits': LANE_BITS, 'chunk_bits': CHUNK_BITS,
        'lane_mask': (1 << LANE_BITS) - 1, 'vec': VEC, 'src': src,
        'dst': dst}


_MT = 'mnopt_mem<T>::type'


def _pack(storage, op):
    return _body(_MT, storage, '(const %s*)ptrs[k]' % _MT,
                 '(%s*)&wire[wire_starts[k]]' % storage, op)


def _unpack(storage, op):
    return _body(storage, _MT, '(const %s*)&wire[wire_starts[k]]' % storage,
                 '(%s*)ptrs[k]' % _MT, op)


_COUNT_BAD_X = 'if (mnopt_bad(x)) atomicAdd(&counts[slot], 1);'
# A mean counts where the gradient's dtype cannot hold it (float16
# gradients from a bfloat16 wire), as the host codec counts.
_COUNT_BAD_Y = 'if (mnopt_bad(y)) atomicAdd(&counts[slot], 1);'
# Divide in float64 if the gradient or the wire is float64, else in
# float32 (grad_buffer.HostCodec), and round once into the wire.
_SCALED = ('mnopt_set(y, mnopt_quotient<(sizeof(T) > 4 || sizeof(%s) > 4)>'
           '::of(x, divisor));')


def _kernel_spec(params, wire_param, body):
    # The counts are an output: CuPy passes inputs as const arrays.
    return (params, 'raw int32 counts, ' + wire_param, body)


KERNELS = {
    # Scale in float32, round to nearest-even bfloat16, keep NaN.
    'mnopt_pack_bf16': _kernel_spec(
        _TABLE + ', float64 divisor', 'raw uint16 wire',
        _pack('unsigned short', '''const float f = mnopt_quotient<false>::of(x, divisor);
const unsigned int u = __float_as_uint(f);
y = (u & 0x7FFFFFFFu) > 0x7F800000u ? (unsigned short)0x7FC0 :
    (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
''' + _COUNT_BAD_X)),
    'mnopt_pack_f16': _kernel_spec(
        _TABLE + ', float64 divisor', 'raw float16 wire',
        _pack('unsigned short', _SCALED % 'float16' + '\n' + _COUNT_BAD_X)),
    'mnopt_pack': _kernel_spec(
        _TABLE + ', float64 divisor', 'raw W wire',
        _pack('mnopt_mem<W>::type', _SCALED % 'W')),
    'mnopt_unpack_bf16': _kernel_spec(
        _TABLE, 'raw uint16 wire',
        _unpack('unsigned short', '''mnopt_set(y, __uint_as_float(((unsigned int)x) << 16));
''' + _COUNT_BAD_Y)),
    'mnopt_unpack_f16': _kernel_spec(
        _TABLE, 'raw float16 wire',
        _unpack('unsigned short', 'mnopt_set(y, x);\n' + _COUNT_BAD_Y)),
    'mnopt_unpack': _kernel_spec(
        _TABLE, 'raw W wire', _unpack('mnopt_mem<W>::type', 'mnopt_set(y, x);')),
}

#: The dtypes each kernel is used with: T over the gradient dtypes, W over
#: the wire dtypes the generic kernels handle (the 16-bit wires have their
#: own).
GRAD_DTYPES = ('float16', 'float32', 'float64')
KERNEL_TYPES = {name: [{'T': t} for t in GRAD_DTYPES]
                for name in KERNELS}
for _name in ('mnopt_pack', 'mnopt_unpack'):
    KERNEL_TYPES[_name] = [{'T': t, 'W': w} for t in GRAD_DTYPES
                           for w in ('float32', 'float64')]
#: Parameters passed as scalars (the others are raw arrays).
KERNEL_SCALARS = ('divisor',)

_kernels = {}


def kernel(name):
    """Elementwise kernels, compiled once on first use."""
    if name not in _kernels:
        inputs, outputs, body = KERNELS[name]
        _kernels[name] = cupy().ElementwiseKernel(
            inputs, outputs, body, name, preamble=PREAMBLE)
    return _kernels[name]


def kernel_name(direction, wire):
    return 'mnopt_%s%s' % (direction, {'bfloat16': '_bf16',
                                       'float16': '_f16'}.get(wire, ''))

