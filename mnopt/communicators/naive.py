"""The naive communicator: one allreduce per gradient array, the reference
the others are checked against."""

import contextlib

import numpy
from mpi4py import MPI

from mnopt.transport import allreduce
from mnopt.transport import reduce
from mnopt.communicators.flat import FlatCommunicator


class NaiveCommunicator(FlatCommunicator):
    """One allreduce per gradient array: the simple reference the other
    communicators are checked against."""

    name = 'naive'

    def _buffer_options(self):
        return {'per_array': True}  # and every array goes through packing

    def _sum(self, buffer, group):
        # One collective per array (flat's would put them all in one
        # ring): MPI's Allreduce, or the ring for that array alone where
        # allreduce.uses_ring picks it (large float arrays across nodes, the
        # 16-bit wires).
        wires = self._bucket_wires()   # the timeline's, when it is on
        for i, part in enumerate(buffer.host_parts()):
            # With the timeline on, a 'wire' per array.
            with contextlib.nullcontext() if wires is None else \
                    wires.bucket(i, part.nbytes):
                allreduce.allreduce_sum_parts(
                    group.comm, [part], buffer.layout.wire,
                    self.allreduce_algorithm,
                    segment_bytes=self.segment_bytes)
        buffer.from_host()

    # The sharded optimizer's transports: MPI's own Reduce_scatter and
    # Allgatherv, which take one contiguous buffer (the packed copy).
    shard_parts = False

    def _shard_reduce_scatter(self, group, shards, parts):
        (host,) = parts
        lo, n = shards.starts[self.rank], shards.counts[self.rank]
        mine = numpy.empty(n, host.dtype)
        mpi_type, op = reduce.wire_sum(shards.layout.wire)
        group.comm.Reduce_scatter([host, mpi_type], [mine, mpi_type],
                                  shards.counts, op=op)
        host[lo:lo + n] = mine

    def _shard_allgather(self, group, shards, parts):
        (flat,) = parts
        group.comm.Allgatherv(MPI.IN_PLACE, [flat, (
            shards.byte_counts, shards.byte_starts), MPI.BYTE])
