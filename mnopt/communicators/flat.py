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

    @classmethod
    def check_arguments(cls, **kwargs):
        _mpi.allreduce_algorithm()
        super(FlatCommunicator, cls).check_arguments(**kwargs)

    def __init__(self, mpi_comm, **kwargs):
        super(FlatCommunicator, self).__init__(mpi_comm, **kwargs)
        #: 'auto', 'ring' or 'mpi': $MNOPT_ALLREDUCE when it was made.
        self.allreduce_algorithm = _mpi.allreduce_algorithm()

    def _sum(self, buffer, group):
        _mpi.allreduce_sum_parts(group.comm, list(buffer.host_parts()),
                                 buffer.layout.wire, self.allreduce_algorithm)
        buffer.from_host()
