"""The ring's receive scratch, kept per thread from one ring to the next
(mnopt/transport/ring.py): the segments a rank sums arrive in up to
``WINDOW`` scratch buffers first.  Made afresh for every ring, that is
for every bucket of an overlapped step, their 2 MiB went back to malloc
after each ring, and the pages malloc had returned to the kernel were
faulted in again at the next.

A ring takes its thread's scratch and gives it back only when it ends
normally: one that ends on an exception may leave receives posted into
it (MPI could still write there), so its scratch stays with those
requests and the thread's next ring makes new scratch.  What a scratch
holds between rings is never read: each receive overwrites it before
its sum, so the sums' bits do not depend on it."""

import threading

import numpy

#: Scratch larger than this (bytes) is made for its ring only, not kept
#: (rings with the tuner's largest segments: 8 x 4 MiB).
KEEP_MAX_BYTES = 8 << 20

_local = threading.local()


def take(count, elems, dtype):
    """(memory, arrays): ``count`` arrays of ``elems`` elements of
    ``dtype`` that do not overlap, views of ``memory``: the calling
    thread's kept scratch where it is large enough (the thread holds it no
    more until ``give_back``), else new memory.  (None, []) for none."""
    if count == 0:
        return None, []
    size = elems * numpy.dtype(dtype).itemsize
    memory = getattr(_local, 'memory', None)
    if memory is None or memory.size < count * size:
        memory = numpy.empty(count * size, numpy.uint8)
    else:
        _local.memory = None
    return memory, [memory[k * size:(k + 1) * size].view(dtype)
                    for k in range(count)]


def give_back(memory):
    """Keep ``memory`` (``take``'s, its ring done) for the calling thread's
    next ring, if it is not too large and larger than what it keeps."""
    if memory is None or memory.size > KEEP_MAX_BYTES:
        return
    kept = getattr(_local, 'memory', None)
    if kept is None or kept.size < memory.size:
        _local.memory = memory
