"""MPI transport: the only module that knows MPI datatypes, ops and pickles.

Buffers go through mpi4py's uppercase (buffer) calls; Python objects are
pickled here and moved as byte buffers in chunks, so objects beyond MPI's
2 GiB count limit work whatever the MPI library supports.
"""

import pickle
import time

import numpy
from mpi4py import MPI

from mnopt import grad_buffer


class LayoutMismatchError(ValueError):
    """Ranks tried to reduce gradient sets that do not line up."""


#: Objects are moved in pieces of at most this many bytes (tests shrink it
#: to exercise the chunking on small objects).
OBJ_CHUNK_BYTES = 1 << 30


# --------------------------------------------------------------- wire sums

def _float16_sum(inbuf, inoutbuf, datatype):
    a = numpy.frombuffer(inbuf, numpy.float16)
    b = numpy.frombuffer(inoutbuf, numpy.float16)
    numpy.add(a, b, out=b)


def _bfloat16_sum(inbuf, inoutbuf, datatype):
    a = grad_buffer.bfloat16_bits_to_float32(numpy.frombuffer(inbuf, numpy.uint16))
    b = numpy.frombuffer(inoutbuf, numpy.uint16)
    total = a + grad_buffer.bfloat16_bits_to_float32(b)
    b[...] = grad_buffer.float32_to_bfloat16_bits(total)


def _fast_sum(name):
    fn = getattr(grad_buffer._halfcast, 'sum_' + name)
    return lambda inbuf, inoutbuf, datatype: fn(inbuf, inoutbuf)


_MPI_TYPES = {'float32': MPI.FLOAT, 'float64': MPI.DOUBLE,
              'float16': MPI.UINT16_T, 'bfloat16': MPI.UINT16_T}
# Each pairwise sum is computed in float32 and rounded once; the C loops
# (when built) and numpy give bit-identical results.
_SUM_FUNCS = ({'float16': _fast_sum('float16'),
               'bfloat16': _fast_sum('bfloat16')}
              if grad_buffer._halfcast is not None else
              {'float16': _float16_sum, 'bfloat16': _bfloat16_sum})
_sum_ops = {}


def wire_sum(wire):
    """(MPI datatype, MPI op) that sum ``wire`` values.

    MPI has no 16-bit float types, so float16 and bfloat16 travel as 16-bit
    integers and are summed by a user op (each pairwise sum rounded once).
    """
    if wire not in _SUM_FUNCS:
        return _MPI_TYPES[wire], MPI.SUM
    if wire not in _sum_ops:
        _sum_ops[wire] = MPI.Op.Create(_SUM_FUNCS[wire], commute=True)
    return _MPI_TYPES[wire], _sum_ops[wire]


def allreduce_sum(comm, array, wire):
    """Sum a contiguous numpy wire array in place across ``comm``.

    float32/float64 use MPI's own Allreduce.  The 16-bit wires need a user
    op, for which MPICH falls back to a reduce + broadcast that moves the
    whole buffer log2(N) times each way (at 1 Gbit/s, 4 nodes, FP16 was
    slower than FP32); they go round a ring instead.
    """
    if not array.size:
        return
    if wire in _SUM_FUNCS and comm.size > 1:
        ring_allreduce_sum(comm, array, wire)
        return
    mpi_type, op = wire_sum(wire)
    comm.Allreduce(MPI.IN_PLACE, [array, mpi_type], op=op)


def _sum_into(wire):
    """fn(a, b): b += a for numpy arrays of the wire's storage dtype."""
    fn = _SUM_FUNCS[wire]
    return lambda a, b: fn(a, b, None)


def ring_allreduce_sum(comm, array, wire):
    """Bandwidth-optimal ring: reduce-scatter, then allgather, N-1 steps
    each, every rank sending and receiving 2(N-1)/N of the buffer.  Each
    segment is summed once, in a fixed order, then copied: every rank ends
    with the same bits."""
    n, size, rank = array.size, comm.size, comm.rank
    bounds = [n * i // size for i in range(size + 1)]

    def seg(i):
        i %= size
        return array[bounds[i]:bounds[i + 1]]

    mpi_type = _MPI_TYPES[wire]
    right, left = (rank + 1) % size, (rank - 1) % size
    add = _sum_into(wire)
    scratch = numpy.empty(bounds[1] + 1, dtype=array.dtype)
    tag = 0x5A6
    for step in range(size - 1):   # reduce-scatter
        out, into = seg(rank - step), seg(rank - step - 1)
        got = scratch[:into.size]
        comm.Sendrecv([out, mpi_type], right, tag, [got, mpi_type], left, tag)
        add(got, into)
    for step in range(size - 1):   # allgather: rank owns seg(rank + 1)
        out, into = seg(rank + 1 - step), seg(rank - step)
        comm.Sendrecv([out, mpi_type], right, tag, [into, mpi_type], left, tag)


def reduce_sum(comm, array, wire, root=0):
    if array.size:
        mpi_type, op = wire_sum(wire)
        if comm.rank == root:
            comm.Reduce(MPI.IN_PLACE, [array, mpi_type], op=op, root=root)
        else:
            comm.Reduce([array, mpi_type], None, op=op, root=root)


def bcast_bytes(comm, array, root=0):
    """Broadcast any contiguous numpy array as raw bytes (any dtype)."""
    if array.size:
        comm.Bcast([array.view(numpy.uint8).reshape(-1), MPI.BYTE], root=root)


# --------------------------------------------------------------- waiting

#: Longest nap between two polls in ``wait_all``/``wait_some`` (seconds).
MAX_NAP_SECONDS = 1e-3


def _naps():
    """Yield before each poll; nap in between, from 20 us doubling up to
    MAX_NAP_SECONDS: short waits stay short, long ones cost almost no CPU.

    MPICH busy-polls inside blocking calls.  A reduction server job runs
    workers and servers side by side, mostly waiting on the network;
    spinning processes then steal the cores that the others (and the
    kernel's TCP stack) need."""
    nap = 20e-6
    while True:
        yield
        time.sleep(nap)
        nap = min(2 * nap, MAX_NAP_SECONDS)


def wait_all(requests):
    """Like ``MPI.Request.Waitall``, napping between polls (``_naps``)."""
    for _ in _naps():
        if MPI.Request.Testall(requests):
            return


def wait_some(requests):
    """Indices of the requests that completed (at least one), napping
    between polls; None once none is active.  Completed requests turn into
    MPI.REQUEST_NULL in the list."""
    for _ in _naps():
        done = MPI.Request.Testsome(requests)
        if done is None or done:
            return done


# --------------------------------------------------------------- layouts

def check_layouts(comm, layout, what='gradients'):
    """Raise LayoutMismatchError on every rank unless all layouts agree.

    Costs one Allgather of 8 bytes per rank when they agree; only on a
    mismatch are the full layouts exchanged to name the first difference.
    """
    digests = numpy.empty(comm.size, dtype=numpy.int64)
    comm.Allgather(numpy.array([layout.digest], dtype=numpy.int64), digests)
    if (digests == digests[0]).all():
        return
    layouts = allgather_obj(comm, layout)
    bad = next(r for r in range(comm.size) if layouts[r].key != layouts[0].key)
    raise LayoutMismatchError(
        'ranks would reduce %s that do not line up (rank 0 vs rank %d): %s. '
        'Every rank must hold the same parameters, with the same shapes and '
        'dtypes, and the same allreduce_grad_dtype.'
        % (what, bad, layouts[0].first_difference(layouts[bad])))


# --------------------------------------------------------------- objects

def _dumps(obj):
    return numpy.frombuffer(
        pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=numpy.uint8)


def _loads(buf):
    return pickle.loads(buf.tobytes())


def _pieces(n):
    step = max(1, OBJ_CHUNK_BYTES)
    return [slice(s, min(s + step, n)) for s in range(0, n, step)]


def send_bytes(comm, data, dest, tag):
    comm.send(data.size, dest=dest, tag=tag)
    for piece in _pieces(data.size):
        comm.Send([data[piece], MPI.BYTE], dest=dest, tag=tag)


def recv_bytes(comm, source, tag, status=None):
    n = comm.recv(source=source, tag=tag, status=status)
    if status is not None:
        source, tag = status.Get_source(), status.Get_tag()
    data = numpy.empty(n, dtype=numpy.uint8)
    for piece in _pieces(n):
        comm.Recv([data[piece], MPI.BYTE], source=source, tag=tag)
    return data


def send_obj(comm, obj, dest, tag=0):
    send_bytes(comm, _dumps(obj), dest, tag)


def recv_obj(comm, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
    # The length message fixes source and tag for the pieces that follow.
    status = status if status is not None else MPI.Status()
    return _loads(recv_bytes(comm, source, tag, status))


def bcast_obj(comm, obj, root=0):
    data = _dumps(obj) if comm.rank == root else None
    n = comm.bcast(data.size if data is not None else None, root=root)
    if data is None:
        data = numpy.empty(n, dtype=numpy.uint8)
    for piece in _pieces(n):
        comm.Bcast([data[piece], MPI.BYTE], root=root)
    return obj if comm.rank == root else _loads(data)


def gather_obj(comm, obj, root=0):
    data = _dumps(obj)
    sizes = comm.gather(data.size, root=root)
    if comm.rank != root:
        for piece in _pieces(data.size):
            comm.Send([data[piece], MPI.BYTE], dest=root, tag=0x6A7)
        return None
    out = []
    for r, n in enumerate(sizes):
        if r == root:
            out.append(obj)
            continue
        buf = numpy.empty(n, dtype=numpy.uint8)
        for piece in _pieces(n):
            comm.Recv([buf[piece], MPI.BYTE], source=r, tag=0x6A7)
        out.append(_loads(buf))
    return out


def allgather_obj(comm, obj):
    return bcast_obj(comm, gather_obj(comm, obj), root=0)


def scatter_obj(comm, objs, root=0):
    if comm.rank == root:
        if len(objs) != comm.size:
            raise ValueError('scatter needs one object per rank (%d), got %d'
                             % (comm.size, len(objs)))
        for r, o in enumerate(objs):
            if r != root:
                send_obj(comm, o, r, tag=0x5CA)
        return objs[root]
    return recv_obj(comm, root, tag=0x5CA)
