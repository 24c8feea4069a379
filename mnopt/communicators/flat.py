from mnopt import _mpi
from mnopt.communicators.base import CommunicatorBase


class FlatCommunicator(CommunicatorBase):
    """Gradients packed into one buffer (large ones that need no cast are
    reduced where they are), summed by MPI Allreduce one bucket at a time.
    GPU buffers are staged through pinned host memory."""

    name = 'flat'

    def _sum(self, buffer, group):
        for part in buffer.host_parts():
            _mpi.allreduce_sum(group.comm, part, buffer.layout.wire)
        buffer.from_host()
