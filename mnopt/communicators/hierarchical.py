from mnopt import _mpi
from mnopt.communicators.base import CommunicatorBase, _Group, node_split


class HierarchicalCommunicator(CommunicatorBase):
    """Per bucket: reduce inside the node to its leader, allreduce among the
    node leaders, broadcast inside the node.  Only one copy of the gradients
    per node crosses the (slow) links between nodes.

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
        for part in buffer.host_parts():
            _mpi.reduce_sum(group.intra, part, wire, root=0)
            if leader:
                _mpi.allreduce_sum(group.inter, part, wire)
            _mpi.bcast_bytes(group.intra, part, root=0)
        buffer.from_host()
