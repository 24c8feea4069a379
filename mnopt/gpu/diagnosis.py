"""Whether CuPy, NCCL and a GPU are usable here, and if not, what to do."""

_HINT = ("use 'flat' (or 'hierarchical', 'naive'), which run on CPU and "
         "stage GPU gradients through host memory")


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

