"""node_split: which ranks of an MPI communicator share a node."""

from mpi4py import MPI

from mnopt.common import _env


def node_split(comm):
    """(intra-node communicator, leaders communicator, node index, nodes).

    Nodes come from MPI's shared-memory split; ``MNOPT_RANKS_PER_NODE=k``
    overrides it (ranks 0..k-1 form node 0, ...) so tests can fake several
    nodes on one machine.  The leaders communicator joins the ranks with
    intra rank 0 (on other ranks it joins the ranks of equal intra rank and
    goes unused).
    """
    k = _env.whole_number('MNOPT_RANKS_PER_NODE', None, 1)
    if k:
        intra = comm.Split(comm.rank // k, comm.rank)
    else:
        intra = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    leaders = comm.Split(intra.rank, comm.rank)
    node, n_nodes = intra.bcast((leaders.rank, leaders.size), root=0)
    return intra, leaders, node, n_nodes
