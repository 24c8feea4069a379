"""Work on a communicator's background thread: its set-up, and what GPU
arrays need there (shared by the background averaging and the sharded
reduce-scatter)."""

import numpy

from mnopt.common import _sched
from mnopt.transport import ring


def thread_setup():
    """The background thread's initializer.  It is latency-bound
    (mnopt/common/_sched.py): a short scheduler slice, and with it the ring's
    Python waits (MNOPT_WAIT=python) yield the core instead of napping
    (mnopt/transport/ring.py)."""
    ring.yield_while_waiting(_sched.prefer_low_latency())


def caller_ready(named, xp):
    """(GPU, event) for background work on the GPU arrays of ``named``:
    the work waits for what the caller's stream on that GPU has queued so
    far (the backward that produced them); (None, None) for numpy arrays."""
    if xp is numpy:
        return None, None
    from mnopt.gpu.device import device_id
    device = device_id([a for _, a in named])
    with xp.cuda.Device(device):
        return device, xp.cuda.get_current_stream().record()


def on_side_stream(group, xp, device, ready, work, *args):
    """``work(*args)`` on the background thread; for GPU arrays on the
    group's side stream of ``device`` once ``ready`` has passed, and done
    when this returns (it blocks the background thread only)."""
    if xp is numpy:
        return work(*args)
    # CuPy's current device is per thread (GPU 0 in a new one): enter the
    # arrays' GPU, and work on a side stream of that GPU.
    with xp.cuda.Device(device):
        stream = group.side_streams.get(device)
        if stream is None:
            stream = group.side_streams[device] = xp.cuda.Stream(
                non_blocking=True)
        stream.wait_event(ready)
        with stream:
            result = work(*args)
        stream.synchronize()
    return result
