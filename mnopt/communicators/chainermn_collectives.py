"""ChainerMN's array and object collectives (``send``, ``bcast``,
``allreduce``, ``send_obj``, ...), mixed into every communicator.

Arrays travel as host copies (GPU arrays come back as CuPy arrays on the
receiver's current device); objects are pickled in chunks by ``transport.objects``.
Every call is stall-watched like the gradient averaging: a rank that never
joins is reported, not waited on forever.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy
from mpi4py import MPI

from mnopt.transport import allreduce
from mnopt.transport import objects
from mnopt.codecs import grad_buffer
from mnopt.common.arrays import as_array_like, to_host
from mnopt.stall.monitor import watched


def host_message(data):
    """(is_tuple, on_gpu, host arrays): an array or a tuple/list of them,
    ready to pickle."""
    if isinstance(data, (tuple, list)):
        return (True, any(not isinstance(a, numpy.ndarray) for a in data),
                [to_host(a) for a in data])
    return False, not isinstance(data, numpy.ndarray), [to_host(data)]


def device_message(msg):
    """The arrays of a ``host_message``, back on the GPU if they came from
    one (and CuPy is here)."""
    is_tuple, on_gpu, arrays = msg
    if on_gpu:
        try:
            import cupy
            arrays = [cupy.asarray(a) for a in arrays]
        except ImportError:
            pass
    return tuple(arrays) if is_tuple else arrays[0]


class ChainerMNCollectives(object):
    """Needs ``self.mpi_comm``, ``self.rank``, ``self.size`` and the stall
    monitor that ``watched`` uses (MpiCommunicatorBase has them)."""

    @watched('send', collective=False)
    def send(self, data: Any, dest: int, tag: int) -> None:
        objects.send_obj(self.mpi_comm, host_message(data), dest, tag)

    @watched('recv', collective=False)
    def recv(self, source: int, tag: int) -> Any:
        return device_message(objects.recv_obj(self.mpi_comm, source, tag))

    @watched('bcast')
    def bcast(self, x: Any, root: int = 0) -> Any:
        msg = objects.bcast_obj(self.mpi_comm, host_message(x)
                             if self.rank == root else None, root)
        return x if self.rank == root else device_message(msg)

    @watched('gather')
    def gather(self, x: Any, root: int = 0) -> tuple[Any, ...] | None:
        msgs = objects.gather_obj(self.mpi_comm, host_message(x), root)
        return None if msgs is None else tuple(map(device_message, msgs))

    @watched('allgather')
    def allgather(self, x: Any) -> tuple[Any, ...]:
        return tuple(map(device_message,
                         objects.allgather_obj(self.mpi_comm, host_message(x))))

    @watched('scatter')
    def scatter(self, xs: Sequence[Any] | None, root: int = 0) -> Any:
        msgs = [host_message(x) for x in xs] if self.rank == root else None
        return device_message(objects.scatter_obj(self.mpi_comm, msgs, root))

    @watched('alltoall')
    def alltoall(self, xs: Sequence[Any]) -> tuple[Any, ...]:
        if len(xs) != self.size:
            raise ValueError('alltoall needs one array per rank (%d), got %d'
                             % (self.size, len(xs)))
        out = []
        for root in range(self.size):
            out.append(self.scatter(xs if self.rank == root else None, root))
        return tuple(out)

    @watched('allreduce')
    def allreduce(self, x: Any) -> Any:
        """Element-wise sum of ``x`` over all ranks (a new array)."""
        host = numpy.array(to_host(x), copy=True)
        headers = objects.allgather_obj(self.mpi_comm, (host.shape, host.dtype.name))
        if any(h != headers[0] for h in headers):
            raise ValueError('allreduce: ranks hold different arrays: %s'
                             % ', '.join('rank %d %s %s' % ((r,) + h)
                                         for r, h in enumerate(headers)))
        if host.dtype.name in grad_buffer.WIRE_DTYPES:
            allreduce.allreduce_sum(self.mpi_comm, host.reshape(-1), host.dtype.name)
        else:
            self.mpi_comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        return as_array_like(host, x)

    @watched('send_obj', collective=False)
    def send_obj(self, obj: Any, dest: int, tag: int = 0) -> None:
        objects.send_obj(self.mpi_comm, obj, dest, tag)

    @watched('recv_obj', collective=False)
    def recv_obj(self, source: int, status: MPI.Status | None = None,
                 tag: int = MPI.ANY_TAG) -> Any:
        return objects.recv_obj(self.mpi_comm, source, tag, status)

    @watched('bcast_obj')
    def bcast_obj(self, obj: Any, max_buf_len: int | None = None,
                  root: int = 0) -> Any:
        return objects.bcast_obj(self.mpi_comm, obj, root)

    @watched('gather_obj')
    def gather_obj(self, obj: Any, root: int = 0) -> list[Any] | None:
        return objects.gather_obj(self.mpi_comm, obj, root)

    @watched('allgather_obj')
    def allgather_obj(self, obj: Any) -> list[Any]:
        return objects.allgather_obj(self.mpi_comm, obj)

    @watched('allreduce_obj')
    def allreduce_obj(self, obj: Any) -> Any:
        """Sum of ``obj`` over ranks with ``+``, in rank order (the same
        result on every rank)."""
        objs = objects.allgather_obj(self.mpi_comm, obj)
        total = objs[0]
        for o in objs[1:]:
            total = total + o
        return total

    @watched('scatter_obj')
    def scatter_obj(self, objs: Sequence[Any] | None, root: int = 0
                    ) -> Any:
        return objects.scatter_obj(self.mpi_comm, objs, root)
