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
        wire, wires = buffer.layout.wire, self._bucket_wires()
        if wires is not None and not allreduce.uses_ring(
                group.comm, wire, sum(p.nbytes for p in parts),
                self.allreduce_algorithm):
            # Timeline on, MPI's Allreduce: one call per bucket, as
            # allreduce_sum_parts makes them, each a 'wire' of its own.
            for i, (part, done) in enumerate(zip(parts, divided)):
                with wires.bucket(i, part.nbytes):
                    allreduce.allreduce_sum_parts(
                        group.comm, [part], wire, 'mpi',
                        divide=buffer.divide, divided=[done])
        else:
            # The ring pipelines every bucket in one ring: one 'wire'.
            if wires is not None:
                wires.set(buckets=len(parts))
            allreduce.allreduce_sum_parts(group.comm, parts, wire,
                                          self.allreduce_algorithm,
                                          divide=buffer.divide,
                                          divided=divided,
                                          segment_bytes=self.segment_bytes)
        buffer.from_host()

    # The sharded optimizer's transports (mnopt/communicators/sharded.py):
    # the ring's reduce-scatter and all-gather over the arrays themselves.
    # The layout was checked on every rank already: no second check.
    shard_parts = True

    def _shard_reduce_scatter(self, group, shards, parts):
        ring.reduce_scatter_sum_parts(group.comm, parts, shards.layout.wire,
                                      shards.counts, check=False)

    def _shard_allgather(self, group, shards, parts):
        ring.allgather_parts(group.comm, parts, shards.byte_counts,
                             check=False)
