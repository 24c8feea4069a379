"""Your own communication hook (PyTorch DDP's ``register_comm_hook``): the
public types a hook sees, and two ready-made hooks.

A hook is ``hook(state, bucket, comm) -> averaged``: ``state`` is what you
registered with it (``comm.register_comm_hook(state, hook)``), ``bucket``
a ``GradBucket`` (the packed gradients of a few parameters), ``comm`` the
bucket's ``HookCollectives`` (sum, mean, all-gather, broadcast over the
ranks).  It returns the averaged bucket (an array shaped as
``bucket.buffer()``), or a future of it (anything with ``wait()`` or
``result()``: a ``HookFuture`` from ``comm.sum_async``, or a
``concurrent.futures.Future``).  docs/hooks.md shows how to write one.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy
from mpi4py import MPI

from mnopt.common.arrays import array_module, to_host
from mnopt.transport import allreduce
from mnopt.transport import buffers
from mnopt.transport import reduce
from mnopt.transport import waiting

__all__ = ['GradBucket', 'HookCollectives', 'HookFuture', 'allreduce_hook',
           'float16_compress_hook']

#: The dtypes summed as mnopt's wire sums them (the ring or MPI's
#: Allreduce, 16-bit floats by mnopt's loops): the same bits as the wire.
WIRE_SUMMED = ('float16', 'float32', 'float64')


class GradBucket(object):
    """One bucket of a gradient set, as a hook receives it (DDP's
    GradBucket): ``buffer()`` is the packed gradients, not yet divided by
    the number of ranks; the hook may change it in place."""

    def __init__(self, buffer, index, n_buckets, step, pieces):
        self._buffer = buffer
        self._index, self._n_buckets = index, n_buckets
        #: The update's number: 0 for the first gradient set the hook
        #: averages, one more per update (every bucket of one update the
        #: same, under double buffering and overlap too), continued by a
        #: resume from a snapshot.
        self.step = step
        self._pieces = pieces

    def buffer(self) -> Any:
        """The packed gradients: a 1-D numpy (or CuPy) array."""
        return self._buffer

    def index(self) -> int:
        """This bucket's place among the gradient set's buckets (0 first)."""
        return self._index

    def is_last(self) -> bool:
        """Whether this is the gradient set's last bucket."""
        return self._index == self._n_buckets - 1

    def names(self) -> list[str]:
        """The parameters with values in this bucket, in order."""
        return [name for name, _, _ in self._pieces]

    def key(self) -> str:
        """A name for this bucket, the same at every step while the
        gradient set is ('name:start+size': its first parameter, where in
        that gradient it starts, its size): key per-bucket state by it."""
        name, _, inside = self._pieces[0]
        return '%s:%d+%d' % (name, inside.start, self._buffer.size)

    def slices(self) -> list[tuple[str, slice, slice]]:
        """(name, where in ``buffer()``, where in the flattened gradient)
        for each parameter with values in this bucket (a large gradient
        may straddle buckets)."""
        return list(self._pieces)


class HookFuture(object):
    """A collective in progress (DDP's Future): ``wait()`` (or
    ``result()``, ``value()``) returns its array; ``then(fn)`` is a future
    of ``fn(this future)``."""

    def __init__(self, finish: Callable[[], Any]) -> None:
        self._finish, self._done, self._value = finish, False, None

    def wait(self) -> Any:
        if not self._done:
            self._value, self._done = self._finish(), True
        return self._value

    result = value = wait

    def then(self, fn: Callable[[HookFuture], Any]) -> HookFuture:
        return HookFuture(lambda: fn(self))


class HookCollectives(object):
    """The collectives a hook may call, over the communicator's ranks (its
    private MPI communicator for this averaging: the caller's, or the
    background thread's under double buffering and overlap).  Every rank
    must call the same ones, with the same sizes and dtypes, in the same
    order.  numpy or CuPy arrays (CuPy goes through host memory)."""

    def __init__(self, mpi_comm, algorithm=None):
        self._comm = mpi_comm
        self._algorithm = algorithm
        #: This rank, and the number of ranks.
        self.rank, self.size = mpi_comm.rank, mpi_comm.size

    def sum(self, array: Any) -> Any:
        """The element-wise sum over the ranks, in place; returns
        ``array``.  float16/32/64 are summed as mnopt's wires are."""
        host = to_host(array)
        kind = host.dtype.name
        if kind in WIRE_SUMMED:
            allreduce.allreduce_sum(self._comm, host.reshape(-1), kind,
                                    self._algorithm)
        elif host.size:
            self._comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        return _back(array, host)

    def mean(self, array: Any) -> Any:
        """The element-wise mean over the ranks, in place; returns it."""
        summed = self.sum(array)
        summed /= self.size
        return summed

    def sum_async(self, array: Any) -> HookFuture:
        """``sum`` started now, finished by the future's ``wait()``:
        a hook that returns it lets the next bucket start meanwhile.
        (16-bit floats are summed at the call, by mnopt's loops.)"""
        host = to_host(array)
        if host.dtype.name in ('float16',) or not host.size:
            done = self.sum(array)
            return HookFuture(lambda: done)
        mpi_type, op = (reduce.wire_sum(host.dtype.name)
                        if host.dtype.name in WIRE_SUMMED
                        else (MPI._typedict[host.dtype.char], MPI.SUM))
        request = self._comm.Iallreduce(MPI.IN_PLACE, [host, mpi_type], op)

        def finish():
            waiting.wait_all([request])
            return _back(array, host)
        return HookFuture(finish)

    def allgather(self, array: Any) -> Any:
        """Every rank's ``array``, stacked: shaped (size,) + array.shape,
        of any dtype (int8 too: nothing is summed)."""
        host = to_host(array)
        out = numpy.empty((self.size,) + host.shape, host.dtype)
        if host.size:
            self._comm.Allgather([host.view(numpy.uint8).reshape(-1),
                                  MPI.BYTE],
                                 [out.view(numpy.uint8).reshape(-1),
                                  MPI.BYTE])
        xp = array_module([array])
        return out if xp is numpy else xp.asarray(out)

    def broadcast(self, array: Any, root: int = 0) -> Any:
        """``root``'s ``array`` on every rank, in place; returns it."""
        host = to_host(array)
        buffers.bcast_bytes(self._comm, host.reshape(-1), root)
        return _back(array, host)


def _back(array, host):
    """``array`` holding ``host``'s values (itself where it is ``host``)."""
    if host is not array:
        if isinstance(array, numpy.ndarray):
            array[...] = host
        else:
            array.set(host)
    return array


def allreduce_hook(state: Any, bucket: GradBucket,
                   comm: HookCollectives) -> Any:
    """The plain mean (DDP's ``allreduce_hook``): what mnopt does without
    a hook, written as one."""
    return comm.mean(bucket.buffer())


def float16_compress_hook(state: Any, bucket: GradBucket,
                          comm: HookCollectives) -> Any:
    """float16 on the wire (DDP's ``fp16_compress_hook``): each gradient
    divided by the number of ranks, rounded to float16, summed, widened
    back; on the flat communicator the same bits as
    ``allreduce_grad_dtype='float16'``."""
    buffer = bucket.buffer()
    half = (buffer / numpy.float32(comm.size)).astype(numpy.float16)
    return comm.sum(half).astype(buffer.dtype)
