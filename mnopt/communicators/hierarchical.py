"""The hierarchical communicator: reduce inside each node, allreduce among
the node leaders, broadcast inside the node."""

from mpi4py import MPI

from mnopt.transport import allreduce, buffers, reduce, waiting
from mnopt.transport import ring
from mnopt.timeline import step_stats
from mnopt.communicators.base import MpiCommunicatorBase
from mnopt.averaging.group import Group
from mnopt.communicators.node_split import node_split
from mnopt.averaging.shard_layout import views


class NodeComms(object):
    """hierarchical's state of a group (``Group.state``): the group's
    intra-node communicator and the node leaders', freed with it, and
    (sharded collectives) where the nodes lie."""

    def __init__(self, intra, inter):
        self.intra, self.inter = intra, inter
        #: (this node's index, the first rank of every node and one past
        #: the last), found at the first sharded collective (``_nodes``).
        self.nodes = None

    def free(self):
        for c in (self.intra, self.inter):
            if c != MPI.COMM_NULL:
                c.Free()
        self.intra = self.inter = MPI.COMM_NULL


class HierarchicalCommunicator(MpiCommunicatorBase):
    """Reduce every bucket inside the node to its leader, allreduce them
    among the node leaders (on mnopt's ring or with MPI's Allreduce, as
    for ``flat``: $MNOPT_ALLREDUCE), broadcast them inside the node.  Only
    one copy of the gradients per node crosses the (slow) links between
    nodes.

    Intra-node traffic uses MPI, which moves it through shared memory;
    GPU buffers are staged through pinned host memory.
    """

    name = 'hierarchical'

    def _traffic(self, nbytes, op):
        """An estimate: a rank that is not its node's leader sends its
        buffer to the leader and receives the result (an allreduce: S
        each way; a reduce-scatter: S out, its share S/N back; an
        all-gather: its share out, S back); a leader takes the node's
        others' in and sends them theirs (as if MPI's Reduce and Bcast
        inside the node were flat trees: binomial ones move the same
        bytes in all, spread over the node's ranks), plus its part of the
        ring among the leaders (step_stats.traffic)."""
        if op == 'vote':
            return super(HierarchicalCommunicator, self)._traffic(nbytes, op)
        share = nbytes // max(self.size, 1)
        out, back = {'reduce_scatter': (nbytes, share),
                     'allgather': (share, nbytes)}.get(op, (nbytes, nbytes))
        if self.intra_rank != 0:
            return out, back
        others = self.intra_size - 1
        sent, received = step_stats.traffic(op, nbytes, self.inter_size)
        return sent + others * back, received + others * out

    def _make_group(self, comm):
        intra, inter, _, _ = node_split(comm)
        return Group(comm, NodeComms(intra, inter))

    def _tunes(self, name, buffer, group):
        # The ring's segment means nothing where the leaders' sum is MPI's
        # Allreduce (one node, or MNOPT_ALLREDUCE=mpi; as allreduce
        # decides for the leaders' communicator, one leader a node).
        if name != 'segment_bytes':
            return True
        return allreduce.ring_decision(
            self.inter_size, lambda: self.inter_size, buffer.layout.wire,
            buffer.nbytes, self.allreduce_algorithm)

    def _sum(self, buffer, group):
        wire = buffer.layout.wire
        intra, inter = group.state.intra, group.state.inter
        leader = intra.rank == 0
        parts = list(buffer.host_parts())
        wires = self._bucket_wires()
        if wires is not None:   # reduce, ring, bcast: buckets not apart
            wires.set(buckets=len(parts))
        for part in parts:
            buffers.reduce_sum(intra, part, wire, root=0)
        if leader:
            # All buckets in one call: the ring pipelines them together.
            allreduce.allreduce_sum_parts(inter, parts, wire,
                                     self.allreduce_algorithm,
                                     segment_bytes=self.segment_bytes)
        for part in parts:
            buffers.bcast_bytes(intra, part, root=0)
        buffer.from_host()

    # The sharded optimizer's transports (mnopt/averaging/sharded.py),
    # over any list of parts: the arrays themselves (numpy) or the packed
    # copy.  Only one copy of the gradients per node crosses the links
    # between nodes, as for the allreduce.
    shard_parts = True

    def _shard_reduce_scatter(self, group, shards, parts):
        """Reduce inside the node to its leader; the leaders
        reduce-scatter the nodes' ranges on the ring; each leader sends
        each rank of its node that rank's range."""
        wire = shards.layout.wire
        node, bounds = _nodes(group)
        for part in parts:
            for piece in _pieces(part, self.bucket_bytes):
                buffers.reduce_sum(group.state.intra, piece, wire, root=0)
        mpi_type, _ = reduce.wire_sum(wire)
        if group.state.intra.rank == 0:
            node_counts = [sum(shards.counts[bounds[k]:bounds[k + 1]])
                           for k in range(len(bounds) - 1)]
            ring.reduce_scatter_sum_parts(group.state.inter, parts, wire,
                                          node_counts, check=False)
        _scatter_in_node(group, bounds[node], bounds[node + 1], parts,
                         shards.starts, shards.counts, mpi_type)

    def _shard_allgather(self, group, shards, parts):
        """Each node's shares to its leader, the nodes' ranges among the
        leaders on the ring, then a broadcast inside the node."""
        node, bounds = _nodes(group)
        _gather_in_node(group, bounds[node], bounds[node + 1], parts,
                        shards.byte_starts, shards.byte_counts)
        if group.state.intra.rank == 0:
            node_counts = [sum(shards.byte_counts[bounds[k]:bounds[k + 1]])
                           for k in range(len(bounds) - 1)]
            ring.allgather_parts(group.state.inter, parts, node_counts,
                                 check=False)
        for part in parts:
            for piece in _pieces(part, self.bucket_bytes):
                buffers.bcast_bytes(group.state.intra, piece, root=0)


#: Tag of the sharded transports' messages inside a node.
_SHARD_TAG = 0x5A9


def _nodes(group):
    """(this node's index, the first rank of every node and one past the
    last): the ranks of a node must be consecutive, which every rank
    checks alike (so a bad placement is the same error everywhere)."""
    known = group.state.nodes
    if known is not None:
        return known
    intra, inter = group.state.intra, group.state.inter
    node = intra.bcast(inter.rank if intra.rank == 0 else None, root=0)
    nodes = group.comm.allgather(node)
    bounds = [0] + [r for r in range(1, len(nodes))
                    if nodes[r] != nodes[r - 1]] + [len(nodes)]
    if sorted(set(nodes)) != list(range(len(bounds) - 1)) or any(
            nodes[r] < nodes[r - 1] for r in range(1, len(nodes))):
        raise ValueError(
            'hierarchical sharded collectives need the ranks of each node '
            'to be consecutive (ranks by node: %s); launch with block '
            'placement, or use the flat communicator' % nodes)
    group.state.nodes = (node, bounds)
    return group.state.nodes


def _pieces(array, nbytes):
    """``array`` cut into pieces of about ``nbytes``: MPI's shared-memory
    Reduce and Bcast are faster on bucket-sized pieces than on one large
    buffer (as the unsharded averaging's buckets)."""
    step = max(1, nbytes // array.itemsize)
    return [array[s:s + step] for s in range(0, array.size, step)]


def _scatter_in_node(group, first, stop, parts, starts, counts, mpi_type):
    """The leader (global rank ``first``) sends every other rank r of the
    node its range [starts[r], starts[r] + counts[r]) of ``parts``' buffer,
    which r receives where it is."""
    rank, intra = group.comm.rank, group.state.intra
    if intra.rank == 0:
        requests = [intra.Isend([view, mpi_type], r - first, _SHARD_TAG)
                    for r in range(first + 1, stop)
                    for view in views(parts, starts[r],
                                       starts[r] + counts[r])]
    else:
        requests = [intra.Irecv([view, mpi_type], 0, _SHARD_TAG)
                    for view in views(parts, starts[rank],
                                       starts[rank] + counts[rank])]
    waiting.wait_all(requests)


def _gather_in_node(group, first, stop, parts, starts, counts):
    """Every rank of the node sends the leader its byte range of
    ``parts``' buffer, which the leader receives where it is."""
    rank, intra = group.comm.rank, group.state.intra
    if intra.rank == 0:
        requests = [intra.Irecv([view, MPI.BYTE], r - first, _SHARD_TAG)
                    for r in range(first + 1, stop)
                    for view in views(parts, starts[r],
                                       starts[r] + counts[r])]
    else:
        requests = [intra.Isend([view, MPI.BYTE], 0, _SHARD_TAG)
                    for view in views(parts, starts[rank],
                                       starts[rank] + counts[rank])]
    waiting.wait_all(requests)
