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
    return cupy().cuda.Stream(non_blocking=True)


#: The elementwise kernels: name -> (inputs, outputs, body), as
#: ``cupy.ElementwiseKernel`` takes them.  T is the gradient dtype (float16,
#: float32 or float64), W the wire's storage dtype.
#: tests/test_cuda_kernels.py compiles each for every dtype in
#: KERNEL_TYPES, without a GPU.
KERNELS = {
    # Scale in float32, round to nearest-even bfloat16, keep NaN.
    'mnopt_encode_bf16': (
        'T x, float32 divisor', 'uint16 y',
        '''float f = (float)x / divisor;
           unsigned int u = __float_as_uint(f);
           y = isnan(f) ? (unsigned short)0x7FC0 : (unsigned short)(
               (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);'''),
    'mnopt_decode_bf16': (
        'uint16 x', 'T y',
        'y = (T)__uint_as_float(((unsigned int)x) << 16);'),
    # Divide in the wider of (gradient, float32), round once.
    'mnopt_encode': (
        'T x, float64 divisor', 'W y',
        'y = (W)((sizeof(T) > 4 ? (double)x : (double)(float)x) / divisor);'),
}

#: The dtypes each kernel is used with: T over the gradient dtypes, W over
#: the wire dtypes the generic kernel handles (bfloat16 has its own).
GRAD_DTYPES = ('float16', 'float32', 'float64')
KERNEL_TYPES = {
    'mnopt_encode_bf16': [{'T': t} for t in GRAD_DTYPES],
    'mnopt_decode_bf16': [{'T': t} for t in GRAD_DTYPES],
    'mnopt_encode': [{'T': t, 'W': w} for t in GRAD_DTYPES
                     for w in ('float16', 'float32', 'float64')],
}

_kernels = {}


def _kernel(name):
    """Elementwise kernels, compiled once on first use."""
    if name not in _kernels:
        inputs, outputs, body = KERNELS[name]
        _kernels[name] = cupy().ElementwiseKernel(inputs, outputs, body, name)
    return _kernels[name]


class Codec(object):
    """GPU twin of grad_buffer.HostCodec."""

    def __init__(self, wire):
        self.wire = wire

    def encode(self, src, dst, divisor):
        if self.wire == 'bfloat16':
            _kernel('mnopt_encode_bf16')(src, float(divisor), dst)
        else:
            _kernel('mnopt_encode')(src, float(divisor), dst)

    def decode(self, src, dst):
        if self.wire == 'bfloat16':
            _kernel('mnopt_decode_bf16')(src, dst)
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
