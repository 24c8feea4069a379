"""numpy/CuPy array helpers shared by the core and the Chainer layer.

Needs neither MPI nor Chainer (importing it initialises nothing), so the
Chainer-layer modules can use it without ``import mnopt`` starting MPI.
"""

import numpy


def array_module(arrays):
    """numpy or cupy, whichever holds every one of ``arrays`` (numpy for
    none); a mix is a TypeError."""
    kinds = {type(a).__module__.split('.')[0] for a in arrays}
    if not kinds or kinds == {'numpy'}:
        return numpy
    if kinds == {'cupy'}:
        import cupy
        return cupy
    raise TypeError('gradients must be all numpy or all cupy arrays, got %s'
                    % sorted(kinds))


def to_host(x):
    """``x`` as a C-contiguous numpy array (a copy from the GPU for CuPy)."""
    if isinstance(x, numpy.ndarray):
        return numpy.ascontiguousarray(x)
    if type(x).__module__.split('.')[0] == 'cupy':
        return x.get()
    return numpy.ascontiguousarray(numpy.asarray(x))


def as_array_like(host, original):
    """``host`` (numpy) on the device ``original`` lives on: itself for a
    numpy original, a CuPy copy on the current device for a GPU one."""
    if isinstance(original, numpy.ndarray) or not hasattr(original, 'device'):
        return host
    import cupy
    return cupy.asarray(host)


def named_grads(model, zero_fill):
    """A Chainer link's ``[(name, gradient), ...]`` to average, sorted by
    parameter name (the order of ``namedparams`` can differ between
    processes).  Parameters without data are skipped; so are those without
    a gradient unless ``zero_fill``, which gives them zeros."""
    out = []
    for name, param in sorted(model.namedparams()):
        if param.array is None:
            continue
        if param.grad is None:
            if not zero_fill:
                continue
            param.grad = array_module([param.array]).zeros_like(param.array)
        out.append((name, param.grad))
    return out
