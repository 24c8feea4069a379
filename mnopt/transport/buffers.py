"""MPI buffer collectives on wire arrays: MPI's Allreduce, Reduce and
Bcast, and where the ranks are (ranks per node, nodes)."""

import contextlib

import numpy
from mpi4py import MPI

from mnopt.transport import reduce
from mnopt.transport import waiting


def ranks_on_node(comm):
    """How many of ``comm``'s ranks share this rank's shared-memory node
    (collective)."""
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        return shared.size
    finally:
        shared.Free()


#: The context around a part's sum where none is asked for.
_NOTHING = contextlib.nullcontext()

_nodes_keyval = None


def nodes_of(comm):
    """How many shared-memory nodes ``comm``'s ranks are on.  Collective
    the first time for each communicator (then kept as an attribute of
    it, which MPI drops when the communicator is freed)."""
    global _nodes_keyval
    if _nodes_keyval is None:
        _nodes_keyval = MPI.Comm.Create_keyval()
    nodes = comm.Get_attr(_nodes_keyval)
    if nodes is None:
        shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        leader = numpy.array([1 if shared.rank == 0 else 0], numpy.int64)
        shared.Free()
        waiting.wait_all([comm.Iallreduce(MPI.IN_PLACE, leader,
                                          op=MPI.SUM)])
        nodes = int(leader[0])
        comm.Set_attr(_nodes_keyval, nodes)
    return nodes


def allreduce_sum_parts(comm, parts, wire, divide=None, divided=None,
                        around_part=None):
    """Sum each contiguous numpy wire array of ``parts`` in place across
    ``comm`` with MPI's Allreduce, one call per part.  ``divide(part)``,
    where given, runs on each part whose ``divided`` is False just before
    its sum; ``around_part(index, nbytes)``, where given, is a context
    manager around each part's call (a timeline's span)."""
    if divided is None:
        divided = [True] * len(parts)
    mpi_type, op = reduce.wire_sum(wire)
    for i, (part, done) in enumerate(zip(parts, divided)):
        with _NOTHING if around_part is None else \
                around_part(i, part.nbytes):
            if not done:
                divide(part)   # just before: still in cache for the sum
            comm.Allreduce(MPI.IN_PLACE, [part, mpi_type], op=op)


def reduce_sum(comm, array, wire, root=0):
    if array.size:
        mpi_type, op = reduce.wire_sum(wire)
        if comm.rank == root:
            comm.Reduce(MPI.IN_PLACE, [array, mpi_type], op=op, root=root)
        else:
            comm.Reduce([array, mpi_type], None, op=op, root=root)


def bcast_bytes(comm, array, root=0):
    """Broadcast any contiguous numpy array as raw bytes (any dtype)."""
    if array.size:
        comm.Bcast([array.view(numpy.uint8).reshape(-1), MPI.BYTE], root=root)

