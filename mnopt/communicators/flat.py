"""The flat communicator: every rank's gradients summed in one ring (or
MPI's Allreduce) over all ranks."""

from mnopt.transport import allreduce
from mnopt.transport import ring
from mnopt.communicators.base import MpiCommunicatorBase


class FlatCommunicator(MpiCommunicatorBase):
    """Gradients packed into one buffer (large ones that need no cast are
    reduced where they are) and summed across all ranks: on mnopt's
    pipelined ring (mnopt/transport/ring.py), every part in one ring, or with MPI's
    Allreduce one bucket at a time, as ``allreduce.uses_ring`` decides
    ($MNOPT_ALLREDUCE=ring|mpi|auto, read when the communicator is made).
    GPU buffers are staged through pinned host memory."""

    name = 'flat'

    def _tunes(self, name, buffer, group):
        # The ring's segment means nothing where MPI's Allreduce sums.
        if name != 'segment_bytes':
            return True
        return allreduce.uses_ring(group.comm, buffer.layout.wire,
                                   buffer.nbytes, self.allreduce_algorithm)

    def _sum(self, buffer, group):
        parts, divided = buffer.parts_to_divide()
        wires = self._bucket_wires()   # the timeline's, when it is on
        if wires is not None:
            # The ring pipelines every bucket in one ring: one 'wire'
            # (MPI's Allreduce, one call a bucket: a 'wire' each).
            wires.set(buckets=len(parts))
        allreduce.allreduce_sum_parts(
            group.comm, parts, buffer.layout.wire, self.allreduce_algorithm,
            divide=buffer.divide, divided=divided,
            segment_bytes=self.segment_bytes,
            around_part=None if wires is None else wires.bucket)
        buffer.from_host()

    # The sharded optimizer's transports (mnopt/averaging/sharded.py):
    # the ring's reduce-scatter and all-gather over the arrays themselves.
    # The layout was checked on every rank already: no second check.
    shard_parts = True

    def _shard_reduce_scatter(self, group, shards, parts):
        ring.reduce_scatter_sum_parts(group.comm, parts, shards.layout.wire,
                                      shards.counts, check=False)

    def _shard_allgather(self, group, shards, parts):
        ring.allgather_parts(group.comm, parts, shards.byte_counts,
                             check=False)
