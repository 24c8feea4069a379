"""MPI object collectives: Python objects pickled and moved as bytes.

Objects are pickled here and moved as byte buffers in chunks, so objects
beyond MPI's 2 GiB count limit work whatever the MPI library supports.
"""

import pickle

import numpy
from mpi4py import MPI

from mnopt.transport import agreement
from mnopt.transport import waiting


#: Objects are moved in pieces of at most this many bytes (tests shrink it
#: to exercise the chunking on small objects).
OBJ_CHUNK_BYTES = 1 << 30


def _dumps(obj):
    return numpy.frombuffer(
        pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=numpy.uint8)


def _loads(buf):
    return pickle.loads(buf.tobytes())


def _wait(request):
    waiting.wait_all([request])


def _pieces(n):
    step = max(1, OBJ_CHUNK_BYTES)
    return [slice(s, min(s + step, n)) for s in range(0, n, step)]


# Point to point: the size (one int64), then the bytes in pieces, with the
# same tag.  Waited for in ``waiting.wait_all``, as the collectives below
# are: a receive waits for the sender's compute (a MultiNodeChainList's
# next stage), which MPI's blocking receive would spin through.


def send_bytes(comm, data, dest, tag):
    size = numpy.array([data.size], numpy.int64)
    _wait(comm.Isend([size.view(numpy.uint8), MPI.BYTE], dest=dest,
                     tag=tag))
    for piece in _pieces(data.size):
        _wait(comm.Isend([data[piece], MPI.BYTE], dest=dest, tag=tag))


def recv_bytes(comm, source, tag, status=None):
    """What ``send_bytes`` sent (None from MPI.PROC_NULL)."""
    status = MPI.Status() if status is None else status
    size = numpy.zeros(1, numpy.int64)
    header = comm.Irecv([size.view(numpy.uint8), MPI.BYTE], source=source,
                        tag=tag)
    try:
        waiting.wait_all([header], statuses=[status])
    except BaseException:
        # Interrupted (Ctrl-C): no later receive may lose its message to
        # this one.
        header.Cancel()
        header.Wait()
        raise
    if status.Get_source() == MPI.PROC_NULL:
        return None
    if status.Get_count(MPI.BYTE) != size.nbytes:
        raise RuntimeError(
            'recv_obj: the message from rank %d (tag %d) is not one that '
            "mnopt's send_obj sent (its first message is %d bytes, not "
            "the 8 of a size): pair mnopt's send and recv, or use the "
            'communicator\'s mpi_comm on both sides'
            % (status.Get_source(), status.Get_tag(),
               status.Get_count(MPI.BYTE)))
    # The size message fixes source and tag for the pieces that follow.
    source, tag = status.Get_source(), status.Get_tag()
    data = numpy.empty(int(size[0]), dtype=numpy.uint8)
    for piece in _pieces(data.size):
        _wait(comm.Irecv([data[piece], MPI.BYTE], source=source, tag=tag))
    return data


def send_obj(comm, obj, dest, tag=0):
    send_bytes(comm, _dumps(obj), dest, tag)


def recv_obj(comm, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=None):
    data = recv_bytes(comm, source, tag, status)
    return None if data is None else _loads(data)


# The collectives below use MPI's non-blocking collectives, waited for in
# ``waiting.wait_all`` (C polls with naps, the GIL released): a rank
# waits here for the others to arrive, and MPI's blocking calls spin on
# the core meanwhile, which another rank or this rank's training thread
# needed.  They use MPI collectives only (sizes, then the bytes
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
                _wait(comm.Iallgatherv([mine, MPI.BYTE], spec))
            else:
                _wait(comm.Igatherv([mine, MPI.BYTE], spec, root=root))
            for r, (c, d) in enumerate(zip(counts, displacements)):
                bufs[r][_in_round(int(sizes[r]), k, step)] = got[d:d + c]
        else:
            _wait(comm.Igatherv([mine, MPI.BYTE], None, root=root))
    if not receives:
        return None
    return [obj if r == comm.rank else _loads(b) for r, b in enumerate(bufs)]


def _all_sizes(comm, data, problem):
    return agreement.numbers(
        comm, [UNPICKLABLE if problem is not None else data.size])[:, 0]


def bcast_obj(comm, obj, root=0):
    data, problem = _pickled(obj) if comm.rank == root else (None, None)
    n = numpy.array([UNPICKLABLE if problem is not None else
                     data.size if data is not None else 0], numpy.int64)
    _wait(comm.Ibcast(n, root=root))
    n = int(n[0])
    _raise_if_unpicklable([n], problem, 'bcast_obj', [root])
    if data is None:
        data = numpy.empty(n, dtype=numpy.uint8)
    for piece in _pieces(n):
        _wait(comm.Ibcast([data[piece], MPI.BYTE], root=root))
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
    _wait(comm.Iscatter(header, mine, root=root))
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
            _wait(comm.Iscatterv(
                [sending, (counts, displacements), MPI.BYTE],
                [data[piece], MPI.BYTE], root=root))
        else:
            _wait(comm.Iscatterv(None, [data[piece], MPI.BYTE],
                                 root=root))
    return objs[root] if comm.rank == root else _loads(data)
