from mnopt import _mpi
from mnopt.communicators.base import CommunicatorBase, _Group, node_split


class HierarchicalCommunicator(CommunicatorBase):
    """Reduce every bucket inside the node to its leader, allreduce them
    among the node leaders (on mnopt's ring or with MPI's Allreduce, as
    for ``flat``: $MNOPT_ALLREDUCE), broadcast them inside the node.  Only
    one copy of the gradients per node crosses the (slow) links between
    nodes.

    Intra-node traffic uses MPI, which moves it through shared memory;
    GPU buffers are staged through pinned host memory.
    """

    name = 'hierarchical'

    def _make_group(self, comm):
        group = _Group(comm)
        group.intra, group.inter, _, _ = node_split(comm)
        group.subcomms = [group.intra, group.inter]
        return group

    def _sum(self, buffer, group):
        wire = buffer.layout.wire
        leader = group.intra.rank == 0
        parts = list(buffer.host_parts())
        for part in parts:
            _mpi.reduce_sum(group.intra, part, wire, root=0)
        if leader:
            # All buckets in one call: the ring pipelines them together.
            _mpi.allreduce_sum_parts(group.inter, parts, wire,
                                     self.allreduce_algorithm)
        for part in parts:
            _mpi.bcast_bytes(group.intra, part, root=0)
        buffer.from_host()
