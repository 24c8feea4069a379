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
#: ``cupy.ElementwiseKernel`` takes them.  T is the gradient dtype (float16,
#: float32 or float64), W the wire's storage dtype.
#:
#: One launch packs (or unpacks) every gradient of a dtype.  The launch's
#: index space gives each array a whole number of CHUNK-element chunks;
#: ``chunk_entry[e / CHUNK]`` is the table entry k that virtual element e
#: belongs to, and e lives at ``ptrs[k][j]`` in its gradient and at
#: ``wire[wire_starts[k] + j]`` in the buffer, j = e - vstarts[k] (padding
#: past an array's end is skipped).  Each thread does four elements of one
#: chunk, 256 apart (coalesced), loading all four before storing any.
#: Measured on an H100 (docs/gpu.md), ResNet-50's 162 float32 gradients
#: packed to float32: a binary search over the arrays per element reached
#: 0.31 of the copy bandwidth, this table with one element per thread 0.41,
#: four per thread 0.86.
#: ``first`` (one of the gradients) only tells CuPy what T is.
#:
#: The arithmetic is grad_buffer.HostCodec's, so GPU and host results are
#: bit-identical: divide in the wider of (gradient, float32) and round once;
#: bfloat16 rounds to nearest-even from float32 and keeps NaN a NaN.  On the
#: 16-bit wires the kernels also count, per array, the values that are not
#: finite (gradients going in, means coming out; mnopt/overflow.py):
#: ``counts[slots[k]]`` is incremented atomically, only for such values, so
#: counting costs no pass of its own.
#:
#: tests/test_cuda_kernels.py compiles each for every dtype in KERNEL_TYPES,
#: without a GPU.
CHUNK_BITS = 10      # elements per chunk: 1024
LANE_BITS = 8        # threads per chunk: 256, each doing 4 elements
_TABLE = ('raw uint64 ptrs, raw int32 chunk_entry, raw int64 vstarts, '
          'raw int64 sizes, raw int64 wire_starts, raw int32 slots, '
          'raw T first')
# Thread i does elements j0, j0 + 256, j0 + 512, j0 + 768 of its chunk
# (coalesced), loading all four before storing any: four loads in flight
# per thread, where one would leave the bandwidth to latency.
_FIND = '''const long long c = (long long)i >> %d;
const int k = chunk_entry[c];
const long long n = sizes[k];
const long long j0 = (c << %d) - vstarts[k] + ((long long)i & %d);
const int slot = slots[k];
''' % (LANE_BITS, CHUNK_BITS, (1 << LANE_BITS) - 1)
_LOOP = '''#pragma unroll
for (int r = 0; r < 4; r++) {
    const long long j = j0 + ((long long)r << %d);
''' % LANE_BITS
_PACK = _FIND + '''const T* src = (const T*)ptrs[k];
W_STORAGE* dst = &wire[wire_starts[k]];
T xs[4];
''' + _LOOP + '''    if (j < n) xs[r] = src[j];
}
''' + _LOOP + '''    if (j >= n) break;
    const T x = xs[r];
    W_STORAGE &y = dst[j];
'''
_UNPACK = _FIND + '''const W_STORAGE* src = &wire[wire_starts[k]];
T* dst = (T*)ptrs[k];
W_STORAGE xs[4];
''' + _LOOP + '''    if (j < n) xs[r] = src[j];
}
''' + _LOOP + '''    if (j >= n) break;
    const W_STORAGE x = xs[r];
    T &y = dst[j];
'''
_COUNT_BAD_X = ('if (sizeof(T) > 4 ? !isfinite((double)x) '
                ': !isfinite((float)x)) atomicAdd(&counts[slot], 1);')
# A mean counts where the gradient's dtype cannot hold it (float16
# gradients from a bfloat16 wire), as the host codec counts.
_COUNT_BAD_Y = _COUNT_BAD_X.replace('x)', 'y)')
# Divide in the wider of (gradient, float32), round once.
_SCALED = '((sizeof(T) > 4 ? (double)x : (double)(float)x) / divisor)'


def _kernel_spec(params, wire_param, storage, body):
    # The counts are an output: CuPy passes inputs as const arrays.
    return (params, 'raw int32 counts, ' + wire_param,
            body.replace('W_STORAGE', storage) + '\n}')   # closes _LOOP


KERNELS = {
    # Scale in float32, round to nearest-even bfloat16, keep NaN.
    'mnopt_pack_bf16': _kernel_spec(
        _TABLE + ', float64 divisor', 'raw uint16 wire', 'unsigned short',
        _PACK + '''float f = (float)x / (float)divisor;
unsigned int u = __float_as_uint(f);
y = isnan(f) ? (unsigned short)0x7FC0 : (unsigned short)(
    (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
''' + _COUNT_BAD_X),
    'mnopt_pack_f16': _kernel_spec(
        _TABLE + ', float64 divisor', 'raw float16 wire', 'float16',
        _PACK + 'y = (float16)' + _SCALED + ';\n' + _COUNT_BAD_X),
    'mnopt_pack': _kernel_spec(
        _TABLE + ', float64 divisor', 'raw W wire', 'W',
        _PACK + 'y = (W)' + _SCALED + ';'),
    'mnopt_unpack_bf16': _kernel_spec(
        _TABLE, 'raw uint16 wire', 'unsigned short',
        _UNPACK + '''float f = __uint_as_float(((unsigned int)x) << 16);
y = (T)f;
''' + _COUNT_BAD_Y),
    'mnopt_unpack_f16': _kernel_spec(
        _TABLE, 'raw float16 wire', 'float16',
        _UNPACK + 'y = (T)x;\n' + _COUNT_BAD_Y),
    'mnopt_unpack': _kernel_spec(
        _TABLE, 'raw W wire', 'W', _UNPACK + 'y = (T)x;'),
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
        _kernels[name] = cupy().ElementwiseKernel(inputs, outputs, body, name)
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
                             + (self.counts, wire)), size=tables[-1] >> 2)

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
