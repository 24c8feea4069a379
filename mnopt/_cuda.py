"""CuPy and NCCL: kernels for the pack/unpack codec, staging, NCCL calls.

Imported only when GPU arrays or a GPU communicator are in use.
"""

_HINT = ("use 'flat' (or 'hierarchical', 'naive'), which run on CPU and "
         "stage GPU gradients through host memory")


def cupy():
    import cupy as _cupy
    return _cupy


#: The GPU extras (setup.py) and what each installs.
INSTALL_HINT = ("pip install 'mnopt[gpu-cuda13]' (CUDA 13 driver: CuPy 14, "
                "NumPy 2) or 'mnopt[gpu]' (CUDA 12: CuPy 13)")


def cupy_distributions():
    """{distribution name: version} of the CuPy wheels installed."""
    from importlib import metadata
    found = {}
    for dist in metadata.distributions():
        name = (dist.metadata['Name'] or '').lower()
        if name == 'cupy' or name.startswith('cupy-cuda'):
            found[name] = dist.version
    return found


def stack_conflict(cupys, numpy_version):
    """Why this set of CuPy wheels cannot work with this NumPy, or None."""
    if len(cupys) > 1:
        return ('several CuPy packages are installed (%s); they overwrite '
                'each other: pip uninstall all but one of them'
                % ', '.join('%s %s' % kv for kv in sorted(cupys.items())))
    numpy_major = int(numpy_version.split('.')[0])
    for name, version in cupys.items():
        if int(version.split('.')[0]) >= 14 and numpy_major < 2:
            return ("CuPy %s needs NumPy 2 but NumPy %s is installed: pip "
                    "install 'numpy>=2,<2.6', or for NumPy 1 use CuPy 13: "
                    "pip install 'mnopt[gpu]'" % (version, numpy_version))
    return None


def _nccl_wheel(cupys):
    for name in cupys:
        if 'cuda12' in name:
            return 'nvidia-nccl-cu12'
    return 'nvidia-nccl-cu13'


def gpu_problem():
    """None when CuPy, NCCL and a GPU are usable, else what is missing and
    the command that fixes it."""
    import numpy
    cupys = cupy_distributions()
    conflict = stack_conflict(cupys, numpy.__version__)
    if conflict:
        return conflict
    try:
        import cupy as _cupy
    except ImportError as e:
        if not cupys:
            return 'CuPy is not installed (%s)' % INSTALL_HINT
        return 'CuPy is installed but cannot be imported (%s); %s' % (
            e, INSTALL_HINT)
    try:
        from cupy.cuda import nccl
        if not getattr(nccl, 'available', True):
            raise ImportError('the NCCL library could not be loaded')
        nccl.get_version()
    except Exception as e:
        return ('CuPy %s has no NCCL (%s): pip install %s'
                % (_cupy.__version__, e, _nccl_wheel(cupys)))
    try:
        n = _cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError: no driver, no device
        return 'no usable GPU (%s)' % e
    if n == 0:
        return 'no GPU is visible'
    return None


def gpu_available():
    return gpu_problem() is None


def require_gpu(name):
    problem = gpu_problem()
    if problem is not None:
        raise RuntimeError('the %r communicator needs CuPy with NCCL and a '
                           'GPU, but %s; %s.' % (name, problem, _HINT))


def pinned_empty(n, dtype):
    import cupyx
    return cupyx.empty_pinned(n, dtype=dtype)


def new_stream():
    """A non-blocking stream on the current device."""
    return cupy().cuda.Stream(non_blocking=True)


def device_id(arrays):
    """The id of the GPU holding CuPy ``arrays`` (all on one device)."""
    ids = {a.device.id for a in arrays}
    if len(ids) > 1:
        raise ValueError('gradients must all live on one GPU, but they are '
                         'on GPUs %s' % sorted(ids))
    return ids.pop() if ids else cupy().cuda.Device().id


#: For tests and benchmarks: ``mnopt_spin(ns)`` keeps its stream busy for
#: ``ns`` nanoseconds (one thread watching the GPU's global timer), so that
#: what is queued behind it waits, or is timed without the host's launch
#: gaps.
SPIN_SOURCE = r'''
extern "C" __global__ void mnopt_spin(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < (unsigned long long)ns);
}
'''


def spin_kernel():
    """SPIN_SOURCE's kernel: ``k((1,), (1,), (numpy.int64(ns),))``."""
    return cupy().RawKernel(SPIN_SOURCE, 'mnopt_spin')


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
#: coming out; mnopt/overflow.py): ``counts[slots[k]]`` is incremented
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


def _kernel(name):
    """Elementwise kernels, compiled once on first use."""
    if name not in _kernels:
        inputs, outputs, body = KERNELS[name]
        _kernels[name] = cupy().ElementwiseKernel(
            inputs, outputs, body, name, preamble=PREAMBLE)
    return _kernels[name]


def _kernel_name(direction, wire):
    return 'mnopt_%s%s' % (direction, {'bfloat16': '_bf16',
                                       'float16': '_f16'}.get(wire, ''))


class Codec(object):
    """GPU twin of grad_buffer.HostCodec: packs a whole gradient set into a
    wire buffer (``offsets[k]``: where array k starts in it) and unpacks
    it, one kernel launch per gradient dtype.

    On 16-bit wires it counts non-finite values per array in device memory
    (slots 0..n-1 for the gradients going in, n..2n-1 for the means coming
    out); ``take_counts`` brings them to the host.  Other wires count
    nothing."""

    def __init__(self, wire, sizes, offsets):
        cp = cupy()
        self.wire = wire
        self.n = len(sizes)
        self.sizes = list(sizes)
        self.offsets = list(offsets)
        self.counted = wire in ('float16', 'bfloat16')
        self.counts = cp.zeros(2 * self.n if self.counted else 0,
                               dtype='int32')
        self._tables = {}   # (dtype, slot base) -> device index tables
        self._ptrs = {}     # dtype -> (pointers, their device copy)

    def reset(self):
        self.counts.fill(0)

    def _launch(self, direction, arrays, wire, extra=()):
        """Run the pack or unpack kernel over ``arrays`` (contiguous, all
        non-empty ones) grouped by dtype."""
        import numpy
        cp = cupy()
        groups = {}
        for k, a in enumerate(arrays):
            if self.sizes[k]:
                groups.setdefault(a.dtype, []).append(k)
        base = 0 if direction == 'pack' else self.n
        for dtype, ks in groups.items():
            key = (dtype, base, tuple(ks))
            tables = self._tables.get(key)
            if tables is None:
                tables = self._tables[key] = self._make_tables(ks, base)
            ptrs = tuple(arrays[k].data.ptr for k in ks)
            cached = self._ptrs.get((dtype, base))
            if cached is None or cached[0] != ptrs:
                # Pageable to device: staged at once, no synchronisation.
                cached = self._ptrs[(dtype, base)] = (
                    ptrs, cp.asarray(numpy.array(ptrs, numpy.uint64)))
            _kernel(_kernel_name(direction, self.wire))(
                cached[1], *(tables[:-1] + (arrays[ks[0]],) + tuple(extra)
                             + (self.counts, wire)), size=tables[-1] // VEC)

    def _make_tables(self, ks, base):
        """The device tables of the arrays ``ks`` (see KERNELS), and the
        launch's size."""
        import numpy
        cp = cupy()
        sizes = numpy.array([self.sizes[k] for k in ks], numpy.int64)
        chunks = (sizes + (1 << CHUNK_BITS) - 1) >> CHUNK_BITS
        vstarts = numpy.concatenate([[0], numpy.cumsum(chunks)[:-1]]) \
            << CHUNK_BITS
        chunk_entry = numpy.repeat(numpy.arange(len(ks), dtype=numpy.int32),
                                   chunks)
        return (cp.asarray(chunk_entry), cp.asarray(vstarts),
                cp.asarray(sizes),
                cp.asarray(numpy.array([self.offsets[k] for k in ks],
                                       numpy.int64)),
                cp.asarray(numpy.array([base + k for k in ks], numpy.int32)),
                int(chunks.sum()) << CHUNK_BITS)

    def pack(self, arrays, wire, divisor):
        """wire[offsets[k]:] = cast(arrays[k] / divisor), for every k."""
        cp = cupy()
        arrays = [cp.ascontiguousarray(a) for a in arrays]
        self._launch('pack', arrays, wire, (float(divisor),))

    def unpack(self, wire, arrays):
        """arrays[k][...] = cast back from the wire, for every k."""
        cp = cupy()
        flat = [a if a.flags.c_contiguous else cp.empty(a.shape, a.dtype)
                for a in arrays]
        self._launch('unpack', flat, wire)
        for a, f in zip(arrays, flat):
            if f is not a:
                a[...] = f

    def take_counts(self):
        """(non-finite gradient values in, non-finite means out) per array
        as host lists, None where not counted.  Waits for the kernels."""
        if not self.counted:
            return [None] * self.n, [None] * self.n
        counts = [c if size else None   # as the host codec: empty arrays
                  for c, size in zip(self.counts.get().tolist(),
                                     self.sizes * 2)]   # are not counted
        return counts[:self.n], counts[self.n:]


def nccl_communicator(mpi_comm):
    from cupy.cuda import nccl
    uid = mpi_comm.bcast(nccl.get_unique_id() if mpi_comm.rank == 0 else None)
    return nccl.NcclCommunicator(mpi_comm.size, uid, mpi_comm.rank)


def _nccl_type(wire):
    from cupy.cuda import nccl
    return {'float16': nccl.NCCL_FLOAT16, 'float32': nccl.NCCL_FLOAT32,
            'float64': nccl.NCCL_FLOAT64,
            'bfloat16': getattr(nccl, 'NCCL_BFLOAT16', 9)}[wire]


def nccl_allreduce_sum(comm, array, wire, stream):
    """Sum ``array`` in place on ``stream``, ordered after the work already
    queued on the current stream and before the work queued after it."""
    from cupy.cuda import nccl
    cp = cupy()
    current = cp.cuda.get_current_stream()
    stream.wait_event(current.record())
    if array.size:
        comm.allReduce(array.data.ptr, array.data.ptr, array.size,
                       _nccl_type(wire), nccl.NCCL_SUM, stream.ptr)
    current.wait_event(stream.record())


def nccl_reduce_scatter_sum(comm, send, recv, count, wire, stream):
    """Sum ``send`` (``count`` elements per rank, rank r's share at
    ``r * count``) over the ranks into ``recv`` (this rank's share), on
    ``stream``, ordered after the work already queued on the current
    stream and before the work queued after it."""
    from cupy.cuda import nccl
    cp = cupy()
    current = cp.cuda.get_current_stream()
    stream.wait_event(current.record())
    if count:
        comm.reduceScatter(send.data.ptr, recv.data.ptr, count,
                           _nccl_type(wire), nccl.NCCL_SUM, stream.ptr)
    current.wait_event(stream.record())


def nccl_allgather_bytes(comm, buffer, nbytes, rank, stream):
    """In place: every rank's ``nbytes`` at ``r * nbytes`` of ``buffer``
    (a uint8 CuPy array) to every rank, on ``stream`` (ordered as
    ``nccl_reduce_scatter_sum``)."""
    from cupy.cuda import nccl
    cp = cupy()
    current = cp.cuda.get_current_stream()
    stream.wait_event(current.record())
    if nbytes:
        # NCCL's in-place all-gather: the send buffer is this rank's slot
        # of the receive buffer.
        comm.allGather(buffer.data.ptr + rank * nbytes, buffer.data.ptr,
                       nbytes, nccl.NCCL_UINT8, stream.ptr)
    current.wait_event(stream.record())
