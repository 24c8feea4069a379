"""MPI transport: the only module that knows MPI datatypes, ops and pickles.

Buffers go through mpi4py's uppercase (buffer) calls; Python objects are
pickled here and moved as byte buffers in chunks, so objects beyond MPI's
2 GiB count limit work whatever the MPI library supports.
"""

import pickle
import time

import numpy
from mpi4py import MPI

from mnopt import _env
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


#: MNOPT_ALLREDUCE: which allreduce sums float32/float64 buffers.
ALGORITHMS = ('auto', 'ring', 'mpi')


def allreduce_algorithm():
    """$MNOPT_ALLREDUCE: 'ring' (mnopt/ring.py), 'mpi' (the MPI library's
    Allreduce) or 'auto' (default: see ``uses_ring``)."""
    return _env.choice('MNOPT_ALLREDUCE', 'auto', ALGORITHMS)


#: auto: float32/float64 sums of at least this many bytes (in one call)
#: go round mnopt's ring when the ranks span several nodes.  Measured on
#: the simulated cluster (docs/results/netsim/ring.md, 250 Mbit/s, one
#: buffer): at 64 KiB MPI's Allreduce takes 1/3 of the ring's time at 8
#: and 16 nodes; from 256 KiB to 1 MiB they are even (0.97-1.12); at 4
#: MiB and up the ring is 1.4-2x faster at 4 to 16 nodes, even at 2.  On
#: ResNet-50's 102 MB the ring is even at 2 and 4 nodes and 1.10x/1.32x
#: faster at 8/16, and leaves the CPU 47-92% idle (2-8 nodes) where
#: MPICH's busy polling leaves none (so it is used from 2 nodes on).  Inside one
#: shared-memory node MPICH is faster below 16 MiB (3-8x at 64 KiB).
RING_MIN_BYTES = 1 << 20


def uses_ring(comm, wire, nbytes, algorithm=None):
    """Whether ``allreduce_sum_parts`` sums ``nbytes`` of ``wire`` over
    ``comm`` on mnopt's pipelined ring rather than with MPI's Allreduce.

    The 16-bit wires need a user op, for which MPICH falls back to a
    reduce + broadcast that moves the whole buffer log2(N) times each way
    (at 1 Gbit/s, 4 nodes, FP16 was slower than FP32): always the ring.
    float32/float64 (auto): the ring for sums of RING_MIN_BYTES and more
    across nodes, MPI's Allreduce for smaller ones (its latency is lower)
    and inside one shared-memory node (it sums through shared memory)."""
    algorithm = algorithm or allreduce_algorithm()
    if comm.size == 1 or algorithm == 'mpi':
        return False
    if algorithm == 'ring' or wire in _SUM_FUNCS:
        return True
    return nbytes >= RING_MIN_BYTES and nodes_of(comm) > 1


def ranks_on_node(comm):
    """How many of ``comm``'s ranks share this rank's shared-memory node
    (collective)."""
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    try:
        return shared.size
    finally:
        shared.Free()


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
        comm.Allreduce(MPI.IN_PLACE, leader, op=MPI.SUM)
        nodes = int(leader[0])
        comm.Set_attr(_nodes_keyval, nodes)
    return nodes


def allreduce_sum(comm, array, wire, algorithm=None):
    """Sum a contiguous numpy wire array in place across ``comm`` (see
    ``allreduce_sum_parts``)."""
    allreduce_sum_parts(comm, [array], wire, algorithm)


def allreduce_sum_parts(comm, parts, wire, algorithm=None, divide=None,
                        divided=None):
    """Sum each contiguous numpy wire array of ``parts`` in place across
    ``comm``: on mnopt's pipelined ring (mnopt/ring.py; all parts in one
    ring) or with MPI's Allreduce (one call per part), as ``uses_ring``
    decides for their total size; ``algorithm`` overrides
    $MNOPT_ALLREDUCE.  Every rank ends with the same bits, and at two
    ranks both give the same bits (each element is one a + b).
    ``divide(view)``, where given, runs on every piece of the parts whose
    ``divided`` is False just before the sum first uses it.

    Sizes are not checked here: the communicators check their gradient
    layouts across ranks before summing."""
    if divided is None:
        divided = [True] * len(parts)
    live = [(p, d) for p, d in zip(parts, divided) if p.size]
    if comm.size == 1:
        for part, done in live:
            if not done:
                divide(part)
        return
    if not live:
        return
    parts, divided = [p for p, _ in live], [d for _, d in live]
    nbytes = sum(p.nbytes for p in parts)
    if uses_ring(comm, wire, nbytes, algorithm):
        from mnopt import ring
        ring.allreduce_sum_parts(comm, parts, wire, check=False,
                                 divide=divide, divided=divided)
        return
    mpi_type, op = wire_sum(wire)
    for part, done in live:
        if not done:
            divide(part)   # just before: still in cache for the reduction
        comm.Allreduce(MPI.IN_PLACE, [part, mpi_type], op=op)


def _sum_into(wire):
    """fn(a, b): b += a for numpy arrays of the wire's storage dtype."""
    fn = _SUM_FUNCS[wire]
    return lambda a, b: fn(a, b, None)


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


# The collectives below use MPI collectives only (sizes, then the bytes
# in rounds), never point-to-point messages: a user's
# ``recv_obj(ANY_SOURCE, ANY_TAG)`` on the same communicator can never
# receive a piece of one (MPI never matches a collective's traffic with a
# point-to-point receive).  A rank whose object does not pickle says so
# in the sizes (-1): every rank raises, none waits for bytes that never
# come.

UNPICKLABLE = -1


def _pickled(obj):
    """(bytes as a uint8 array, None), or (empty, the pickling error)."""
    try:
        return _dumps(obj), None
    except Exception as e:
        return numpy.empty(0, numpy.uint8), e


def _raise_if_unpicklable(sizes, problem, what, ranks=None):
    """Raise on every rank if any rank's size says its object did not
    pickle: that rank its own error, the others a RuntimeError naming it."""
    if problem is not None:
        raise problem
    bad = [r for r, n in zip(ranks or range(len(sizes)), sizes)
           if n == UNPICKLABLE]
    if bad:
        raise RuntimeError('%s: the object of rank(s) %s could not be '
                           'pickled' % (what, ', '.join(map(str, bad))))


def _round_step(comm):
    """Bytes each rank moves per round: a round's total stays within
    OBJ_CHUNK_BYTES, so every count and displacement fits MPI's int."""
    return max(1, OBJ_CHUNK_BYTES // comm.size)


def _rounds(sizes, step):
    return max([-(-int(n) // step) for n in sizes] + [1])


def _in_round(n, k, step):
    """The slice of an ``n``-byte object that moves in round ``k``."""
    return slice(min(n, k * step), min(n, (k + 1) * step))


def _counts(sizes, k, step):
    counts = [_in_round(int(n), k, step) for n in sizes]
    counts = [s.stop - s.start for s in counts]
    return counts, [sum(counts[:r]) for r in range(len(counts))]


def _gathered(comm, obj, data, sizes, step, root):
    """Every rank's object (``root`` None: on every rank, by Allgatherv;
    else on ``root`` by Gatherv, None elsewhere).  This rank's own object
    is returned as it is."""
    receives = root is None or comm.rank == root
    bufs = [numpy.empty(int(n), numpy.uint8) for n in sizes] \
        if receives else None
    for k in range(_rounds(sizes, step)):
        counts, displacements = _counts(sizes, k, step)
        mine = data[_in_round(data.size, k, step)]
        if receives:
            got = numpy.empty(sum(counts), numpy.uint8)
            spec = [got, (counts, displacements), MPI.BYTE]
            if root is None:
                comm.Allgatherv([mine, MPI.BYTE], spec)
            else:
                comm.Gatherv([mine, MPI.BYTE], spec, root=root)
            for r, (c, d) in enumerate(zip(counts, displacements)):
                bufs[r][_in_round(int(sizes[r]), k, step)] = got[d:d + c]
        else:
            comm.Gatherv([mine, MPI.BYTE], None, root=root)
    if not receives:
        return None
    return [obj if r == comm.rank else _loads(b) for r, b in enumerate(bufs)]


def _all_sizes(comm, data, problem):
    sizes = numpy.empty(comm.size, numpy.int64)
    mine = UNPICKLABLE if problem is not None else data.size
    comm.Allgather(numpy.array([mine], numpy.int64), sizes)
    return sizes


def bcast_obj(comm, obj, root=0):
    data, problem = _pickled(obj) if comm.rank == root else (None, None)
    n = numpy.array([UNPICKLABLE if problem is not None else
                     data.size if data is not None else 0], numpy.int64)
    comm.Bcast(n, root=root)
    n = int(n[0])
    _raise_if_unpicklable([n], problem, 'bcast_obj', [root])
    if data is None:
        data = numpy.empty(n, dtype=numpy.uint8)
    for piece in _pieces(n):
        comm.Bcast([data[piece], MPI.BYTE], root=root)
    return obj if comm.rank == root else _loads(data)


def gather_obj(comm, obj, root=0):
    """Every rank's object on ``root`` (a list in rank order), None on
    the others."""
    data, problem = _pickled(obj)
    sizes = _all_sizes(comm, data, problem)
    _raise_if_unpicklable(sizes, problem, 'gather_obj')
    return _gathered(comm, obj, data, sizes, _round_step(comm), root)


def allgather_obj(comm, obj):
    """Every rank's object, in rank order, on every rank."""
    data, problem = _pickled(obj)
    sizes = _all_sizes(comm, data, problem)
    _raise_if_unpicklable(sizes, problem, 'allgather_obj')
    return _gathered(comm, obj, data, sizes, _round_step(comm), None)


#: What the root of a scatter tells a rank in place of its size.
_WRONG_COUNT = -2


def scatter_obj(comm, objs, root=0):
    """``objs[r]`` (given on ``root``) on rank r.  A wrong number of
    objects, or one that does not pickle, is an error on every rank."""
    # Each rank learns (its size, the rounds, how many objects root gave).
    header = numpy.empty((comm.size, 3), numpy.int64)
    problem = None
    if comm.rank == root:
        step = _round_step(comm)
        datas = []
        if len(objs) != comm.size:
            header[:] = (_WRONG_COUNT, 0, len(objs))
        else:
            for o in objs:
                data, problem = _pickled(o)
                datas.append(data)
                if problem is not None:
                    break
            if problem is not None:
                header[:] = (UNPICKLABLE, 0, len(objs))
            else:
                sizes = [d.size for d in datas]
                header[:, 0] = sizes
                header[:, 1] = _rounds(sizes, step)
                header[:, 2] = len(objs)
    mine = numpy.empty(3, numpy.int64)
    comm.Scatter(header, mine, root=root)
    size, rounds, given = (int(v) for v in mine)
    if size == _WRONG_COUNT:
        raise ValueError('scatter needs one object per rank (%d), got %d'
                         % (comm.size, given))
    _raise_if_unpicklable([size], problem, 'scatter_obj', [root])
    step = _round_step(comm)
    data = numpy.empty(size, numpy.uint8)
    for k in range(rounds):
        piece = _in_round(size, k, step)
        if comm.rank == root:
            counts, displacements = _counts(sizes, k, step)
            sending = numpy.concatenate(
                [d[_in_round(d.size, k, step)] for d in datas])
            comm.Scatterv([sending, (counts, displacements), MPI.BYTE],
                          [data[piece], MPI.BYTE], root=root)
        else:
            comm.Scatterv(None, [data[piece], MPI.BYTE], root=root)
    return objs[root] if comm.rank == root else _loads(data)
