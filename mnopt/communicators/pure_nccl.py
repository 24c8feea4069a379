from mnopt import _cuda
from mnopt.communicators.base import CommunicatorBase, _Group


class PureNcclCommunicator(CommunicatorBase):
    """One NCCL allreduce of the packed buffer on a non-blocking CUDA stream,
    ordered after the pack and before the unpack with events (no host
    synchronisation).  One process per GPU: select the device
    (``cupy.cuda.Device(comm.intra_rank).use()``) before creating it."""

    name = 'pure_nccl'

    def __init__(self, mpi_comm, **kwargs):
        _cuda.require_gpu(self.name)
        super(PureNcclCommunicator, self).__init__(mpi_comm, **kwargs)

    def _buffer_options(self):
        # One NCCL call over the whole packed buffer.
        return {'bucket_bytes': 1 << 62}

    def _make_group(self, comm):
        group = _Group(comm)
        group.nccl = _cuda.nccl_communicator(comm)
        group.stream = _cuda.new_stream()
        return group

    def _sum(self, buffer, group):
        if buffer.xp is not _cuda.cupy():
            raise TypeError(
                "pure_nccl averages CuPy (GPU) gradients but got numpy ones; "
                "move the model to the GPU (model.to_gpu()) or use 'flat'")
        _cuda.nccl_allreduce_sum(group.nccl, buffer.wire, buffer.layout.wire,
                                 group.stream)
