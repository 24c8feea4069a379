"""CuPy device helpers: the module, the arrays' GPU, streams, pinned memory."""


def cupy():
    import cupy as _cupy
    return _cupy


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

