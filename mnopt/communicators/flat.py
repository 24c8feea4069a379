from mnopt import _mpi
from mnopt.communicators.base import CommunicatorBase


class FlatCommunicator(CommunicatorBase):
    """All gradients packed into one buffer, summed by MPI Allreduce one
    bucket at a time.  GPU buffers are staged through pinned host memory."""

    name = 'flat'

    def _sum(self, buffer, group):
        host = buffer.host()
        for bucket in buffer.buckets:
            _mpi.allreduce_sum(group.comm, host[bucket], buffer.layout.wire)
        buffer.from_host()
