from mnopt import _mpi
from mnopt.communicators.base import CommunicatorBase


class FlatCommunicator(CommunicatorBase):
    """Gradients packed into one buffer (large ones that need no cast are
    reduced where they are) and summed across all ranks: on mnopt's
    pipelined ring (mnopt/ring.py), every part in one ring, or with MPI's
    Allreduce one bucket at a time, as ``_mpi.uses_ring`` decides
    ($MNOPT_ALLREDUCE=ring|mpi|auto, read when the communicator is made).
    GPU buffers are staged through pinned host memory."""

    name = 'flat'

    def _sum(self, buffer, group):
        _mpi.allreduce_sum_parts(group.comm, list(buffer.host_parts()),
                                 buffer.layout.wire, self.allreduce_algorithm)
        buffer.from_host()
