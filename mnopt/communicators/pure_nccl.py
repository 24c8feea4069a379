from mnopt import _cuda
from mnopt.communicators.base import CommunicatorBase


class PureNcclCommunicator(CommunicatorBase):
    """One NCCL allreduce of the packed buffer on a non-blocking CUDA stream,
    ordered after the pack and before the unpack with events (no host
    synchronisation).  One process per GPU.

    The NCCL communicator (one per group: the synchronous and the
    background averaging each have theirs) is created at the first
    averaging, on the GPU holding the gradients, as ChainerMN does: a script
    creates the communicator first and selects its GPU afterwards, from
    ``comm.intra_rank``.  Created in ``__init__``, every rank of a node
    would initialise NCCL on GPU 0, which NCCL refuses.
    """

    name = 'pure_nccl'

    @classmethod
    def check_arguments(cls, **kwargs):
        _cuda.require_gpu(cls.name)
        super(PureNcclCommunicator, cls).check_arguments(**kwargs)

    def __init__(self, mpi_comm, **kwargs):
        _cuda.require_gpu(self.name)
        super(PureNcclCommunicator, self).__init__(mpi_comm, **kwargs)

    def _buffer_options(self):
        # One NCCL call over the whole packed buffer.
        return {'bucket_bytes': 1 << 62}

    def _sum(self, buffer, group):
        if buffer.xp is not _cuda.cupy():
            raise TypeError(
                "pure_nccl averages CuPy (GPU) gradients but got numpy ones; "
                "move the model to the GPU (model.to_gpu()) or use 'flat'")
        if group.nccl is None:
            # Collective: every rank reaches its first sum at the same
            # averaging.  The current device is the gradients' (_mean).
            group.nccl = _cuda.nccl_communicator(group.comm)
            group.stream = _cuda.new_stream()
        elif group.nccl.device_id() != buffer.device:
            raise RuntimeError(
                'pure_nccl: the gradients moved from GPU %d to GPU %d after '
                'the first averaging; NCCL is bound to the first GPU (create '
                'the communicator again after moving the model)'
                % (group.nccl.device_id(), buffer.device))
        _cuda.nccl_allreduce_sum(group.nccl, buffer.wire, buffer.layout.wire,
                                 group.stream)
