"""NCCL calls: the communicator; allreduce, reduce-scatter and all-gather."""

from mnopt.gpu.device import cupy


def nccl_communicator(mpi_comm):
    from cupy.cuda import nccl
    uid = mpi_comm.bcast(nccl.get_unique_id() if mpi_comm.rank == 0 else None)
    return nccl.NcclCommunicator(mpi_comm.size, uid, mpi_comm.rank)


def _nccl_type(wire):
    from cupy.cuda import nccl
    return {'float16': nccl.NCCL_FLOAT16, 'float32': nccl.NCCL_FLOAT32,
            'float64': nccl.NCCL_FLOAT64,
            'bfloat16': getattr(nccl, 'NCCL_BFLOAT16', 9)}[wire]


def nccl_allreduce_sum(comm, array, wire, stream):
    """Sum ``array`` in place on ``stream``, ordered after the work already
    queued on the current stream and before the work queued after it."""
    from cupy.cuda import nccl
    cp = cupy()
    current = cp.cuda.get_current_stream()
    stream.wait_event(current.record())
    if array.size:
        comm.allReduce(array.data.ptr, array.data.ptr, array.size,
                       _nccl_type(wire), nccl.NCCL_SUM, stream.ptr)
    current.wait_event(stream.record())


def nccl_reduce_scatter_sum(comm, send, recv, count, wire, stream):
    """Sum ``send`` (``count`` elements per rank, rank r's share at
    ``r * count``) over the ranks into ``recv`` (this rank's share), on
    ``stream``, ordered after the work already queued on the current
    stream and before the work queued after it."""
    from cupy.cuda import nccl
    cp = cupy()
    current = cp.cuda.get_current_stream()
    stream.wait_event(current.record())
    if count:
        comm.reduceScatter(send.data.ptr, recv.data.ptr, count,
                           _nccl_type(wire), nccl.NCCL_SUM, stream.ptr)
    current.wait_event(stream.record())


def nccl_allgather_bytes(comm, buffer, nbytes, rank, stream):
    """In place: every rank's ``nbytes`` at ``r * nbytes`` of ``buffer``
    (a uint8 CuPy array) to every rank, on ``stream`` (ordered as
    ``nccl_reduce_scatter_sum``)."""
    from cupy.cuda import nccl
    cp = cupy()
    current = cp.cuda.get_current_stream()
    stream.wait_event(current.record())
    if nbytes:
        # NCCL's in-place all-gather: the send buffer is this rank's slot
        # of the receive buffer.
        comm.allGather(buffer.data.ptr + rank * nbytes, buffer.data.ptr,
                       nbytes, nccl.NCCL_UINT8, stream.ptr)
    current.wait_event(stream.record())
