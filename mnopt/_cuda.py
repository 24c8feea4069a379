"""CuPy and NCCL: kernels for the pack/unpack codec, staging, NCCL calls.

Imported only when GPU arrays or a GPU communicator are in use.
"""

_HINT = ("use 'flat' (or 'hierarchical', 'naive'), which run on CPU and "
         "stage GPU gradients through host memory")


def cupy():
    import cupy as _cupy
    return _cupy


def _gpu_problem():
    """None when CuPy, NCCL and a GPU are usable, else what is missing."""
    try:
        import cupy as _cupy
    except ImportError:
        return "CuPy is not installed (pip install 'mnopt[gpu]')"
    try:
        n = _cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError: no driver, no device
        return 'no usable GPU (%s)' % e
    if n == 0:
        return 'no GPU is visible'
    try:
        from cupy.cuda import nccl
        nccl.get_version()
    except Exception as e:
        return 'CuPy was built without NCCL (%s)' % e
    return None


def gpu_available():
    return _gpu_problem() is None


def require_gpu(name):
    problem = _gpu_problem()
    if problem is not None:
        raise RuntimeError('the %r communicator needs CuPy with NCCL and a '
                           'GPU, but %s; %s.' % (name, problem, _HINT))


def pinned_empty(n, dtype):
    import cupyx
    return cupyx.empty_pinned(n, dtype=dtype)


def new_stream():
    return cupy().cuda.Stream(non_blocking=True)


_kernels = {}


def _kernel(name):
    """Elementwise kernels, compiled once on first use."""
    if name not in _kernels:
        cp = cupy()
        if name == 'encode_bf16':
            # Scale in float32, round to nearest-even bfloat16, keep NaN.
            k = cp.ElementwiseKernel(
                'T x, float32 divisor', 'uint16 y',
                '''float f = (float)x / divisor;
                   unsigned int u = __float_as_uint(f);
                   y = isnan(f) ? (unsigned short)0x7FC0 : (unsigned short)(
                       (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);''',
                'mnopt_encode_bf16')
        elif name == 'decode_bf16':
            k = cp.ElementwiseKernel(
                'uint16 x', 'T y',
                'y = (T)__uint_as_float(((unsigned int)x) << 16);',
                'mnopt_decode_bf16')
        elif name == 'encode':
            # Divide in the wider of (gradient, float32), round once.
            k = cp.ElementwiseKernel(
                'T x, float64 divisor', 'W y',
                'y = (W)((sizeof(T) > 4 ? (double)x : (double)(float)x) '
                '/ divisor);',
                'mnopt_encode')
        _kernels[name] = k
    return _kernels[name]


class Codec(object):
    """GPU twin of grad_buffer.HostCodec."""

    def __init__(self, wire):
        self.wire = wire

    def encode(self, src, dst, divisor):
        if self.wire == 'bfloat16':
            _kernel('encode_bf16')(src, float(divisor), dst)
        else:
            _kernel('encode')(src, float(divisor), dst)

    def decode(self, src, dst):
        if self.wire == 'bfloat16':
            _kernel('decode_bf16')(src, dst)
        else:
            dst[...] = src


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
