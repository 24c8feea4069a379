"""A pipelined ring over MPI point-to-point: reduce-scatter, all-gather,
and the allreduce that is one then the other.

Rank r sends to rank r+1 and receives from rank r-1.  The buffer is cut
into one chunk per rank (``counts[c]`` elements for chunk c, chunk c
starting where chunk c-1 ends) and each chunk into segments.  Step s
(s = 0 .. N-2, reduce-scatter) sends chunk r-s-1 and receives chunk r-s-2,
which it sums into its own; after N-1 steps rank r holds chunk r summed
over every rank.  Steps N-1 .. 2N-3 (all-gather) pass the summed chunks on
round the ring, each rank copying what it receives.  The buffer may be
one array or a list of arrays one after another (``*_parts``: a segment
never spans two arrays), which the sharded optimizer uses to reduce its
gradients and gather its parameters where they are.

Pipelining: every (step, segment) is its own message, and a segment moves
on to the next step as soon as it has arrived and been summed, while later
segments are still on the wire; up to ``WINDOW`` receives are posted
ahead.  Sending, receiving and summing therefore overlap, and the
all-gather of the first segments starts while the reduce-scatter of the
last ones is still running.  While nothing can move, the ring waits for
whatever is in flight in mnopt's C wait (mnopt/transport/waiting.py): the
GIL released and the core left free (MPICH busy-polls inside its blocking
calls, taking the cores that the summing, the other ranks, the kernel's
TCP stack and, beside an overlapped backward, the training need), coming
back at least every 50 ms, so a rank stays responsive to mnopt's stall
detection (mnopt/stall/monitor.py) when a peer never sends.

Every element of chunk c is summed exactly once, in one fixed order
(x[c+1] + x[c+2] + ... + x[c], rank numbers mod N), by the rank it
arrives at, and then copied: every rank ends with the same bits.  Sums are
in the wire dtype: numpy's add for float32/float64, mnopt's fused 16-bit
loops for float16/bfloat16 (each pairwise sum rounded once, as the MPI
ops of mnopt/transport/reduce.py do).  With two ranks each element is a
single a + b, which is commutative: the same bits as MPI's Allreduce.

Who calls these must call them in the same order on every rank with the
same sizes; with ``check=True`` the sizes are compared first (one small
all-gather, mnopt/transport/ring_checks.py) and a mismatch is a ValueError
on every rank.
"""

import os
import threading
import time

import numpy
from mpi4py import MPI

from mnopt.transport import cpu_phases
from mnopt.transport import reduce
from mnopt.transport import ring_checks
from mnopt.transport import ring_drain
from mnopt.transport import ring_pace
from mnopt.transport import waiting

#: Largest segment (bytes): one message of the ring.
SEGMENT_BYTES = 256 << 10
#: Smallest segment a chunk is cut into (bytes), unless the chunk is
#: smaller; between the two, chunks are cut into ``SEGMENTS_PER_CHUNK``.
MIN_SEGMENT_BYTES = 32 << 10
SEGMENTS_PER_CHUNK = 4
#: Receives posted ahead of the one being waited for.
WINDOW = 8
TAG = 0x5A8

#: Per thread: whether its waits yield the core instead of napping
#: (yield_while_waiting).
_waits = threading.local()

#: Bytes this process has sent on rings so far (benchmarks read it:
#: benchmarks/zero.py counts what each rank puts on the wire per update).
bytes_sent = 0


def reduce_scatter_sum(comm, array, wire, counts, check=True):
    """Sum ``array`` across ``comm`` chunk by chunk; return this rank's.

    ``array``: a contiguous 1-D numpy array in ``wire``'s storage dtype
    (``wire_dtypes.storage_dtype``: uint16 bits for bfloat16), the same
    size on every rank, laid out as one chunk per rank: chunk c is
    ``counts[c]`` elements (zero allowed) starting at ``sum(counts[:c])``.  Returns the view of
    ``array`` holding this rank's chunk, summed over every rank; the other
    chunks of ``array`` are left holding partial sums.
    """
    counts = ring_checks.checked_counts(comm, array, wire, counts, check)
    n = comm.size
    if n > 1 and array.size:
        _ring(comm, [array], wire, counts, 0, n - 1)
    start = sum(counts[:comm.rank])
    return array[start:start + counts[comm.rank]]


def allgather_into(comm, array, counts, check=True):
    """Fill ``array`` with every rank's chunk, in place.

    ``array``: a contiguous 1-D numpy array (any dtype), the same size on
    every rank, laid out as for ``reduce_scatter_sum``; on entry each rank
    holds its own chunk, on return every chunk (bytes copied as they are).
    """
    counts = ring_checks.checked_counts(comm, array, None, counts, check)
    n = comm.size
    if n > 1 and array.size:
        itemsize = array.dtype.itemsize
        _ring(comm, [array.view(numpy.uint8)], None,
              [c * itemsize for c in counts], n - 1, 2 * (n - 1))
    return array


def reduce_scatter_sum_parts(comm, parts, wire, counts, check=True):
    """``reduce_scatter_sum`` of the concatenation of ``parts``, without
    concatenating them: the sums land where the elements are.

    ``parts``: contiguous 1-D numpy arrays of ``wire``'s storage dtype
    (sizes may differ between parts; zero allowed) that make one buffer one
    after another, the same total on every rank; ``counts`` cuts that
    buffer into one chunk per rank (a chunk may span parts, a part
    chunks).  On return the elements of this rank's chunk hold their sum
    over every rank, in the order (and so with the bits)
    ``reduce_scatter_sum`` of the concatenation gives; the other elements
    hold partial sums."""
    counts = ring_checks.checked_parts_counts(comm, parts, wire, counts,
                                              check)
    live = [p for p in parts if p.size]
    if comm.size > 1 and live:
        ring_drain.drained(comm, lambda: _ring(  # its caller computes next
            comm, live, wire, counts, 0, comm.size - 1))


def allgather_parts(comm, parts, counts, check=True):
    """``allgather_into`` of the concatenation of ``parts``, in place.

    ``parts``: contiguous 1-D numpy arrays of any dtypes (they travel as
    raw bytes); ``counts``: the *bytes* of each rank's chunk of their
    concatenation (a chunk may span parts).  On entry each rank holds its
    own chunk, on return every rank's."""
    counts = ring_checks.checked_parts_counts(comm, parts, None, counts,
                                              check)
    live = [p.view(numpy.uint8) for p in parts if p.size]
    n = comm.size
    if n > 1 and live:
        _ring(comm, live, None, counts, n - 1, 2 * (n - 1))


def allreduce_sum(comm, array, wire, check=True):
    """Sum ``array`` (as for ``reduce_scatter_sum``) in place across
    ``comm``: every rank ends with the same bits."""
    allreduce_sum_parts(comm, [array], wire, check)


def allreduce_sum_parts(comm, parts, wire, check=True, divide=None,
                        divided=None, segment_bytes=None):
    """Sum each array of ``parts`` in place across ``comm``, in one ring:
    the parts are pipelined together, so many small pieces cost one ring's
    latency, not one each, but each is chunked on its own
    (``_chunk_each_part``): every part gets the bits ``allreduce_sum`` of
    it alone gives.

    ``divide(view)``, where given, runs on each segment of the parts whose
    ``divided`` is False just before its first use (sent at the first
    step, or summed into): the division is spread over the ring, between
    its waits, instead of a pass over everything before it starts.

    ``segment_bytes``: the bytes of each message (the same on every
    rank), or None: ``_segment_elems``' rule.  It moves nothing but the
    pipelining: every element is summed in the same order, so the bits
    are the same whatever it is."""
    bad = [p for p in parts if not ring_checks.fits(p, wire)]
    total = sum(p.size for p in parts if ring_checks.fits(p, wire))
    if check:
        ring_checks.agree(comm, total, wire, [total],
                          bad and ring_checks.describe(bad[0], wire))
    elif bad:
        raise ValueError(ring_checks.describe(bad[0], wire))
    n = comm.size
    if divided is None or divide is None:
        divided = [True] * len(parts)
    live = [(p, d) for p, d in zip(parts, divided) if p.size]
    if n == 1:
        for part, done in live:
            if not done:
                divide(part)
    if n > 1 and total:
        counts = [total * (c + 1) // n - total * c // n for c in range(n)]
        _ring(comm, [p for p, _ in live], wire, counts, 0,
              2 * (n - 1), chunk_each_part=True,
              divide=divide, divided=[d for _, d in live],
              segment_bytes=segment_bytes)


# ------------------------------------------------------------------ the ring

def _segment_elems(counts, itemsize, segment_bytes=None):
    """Elements per segment: the same on every rank (from counts and
    ``segment_bytes``, a shared setting, only)."""
    if segment_bytes is not None:
        return max(1, segment_bytes // itemsize)
    largest = max(counts) * itemsize
    per = -(-largest // SEGMENTS_PER_CHUNK)
    seg = min(SEGMENT_BYTES, max(MIN_SEGMENT_BYTES, per))
    return max(1, seg // itemsize)


def _chunk_segments(parts, counts, seg_elems):
    """Per chunk, its segments as views of ``parts`` (concatenated)."""
    ends = numpy.cumsum([p.size for p in parts]).tolist()
    chunks, lo, part = [], 0, 0
    for count in counts:
        hi, segs = lo + count, []
        while lo < hi:
            while ends[part] <= lo:
                part += 1
            start = ends[part] - parts[part].size
            stop = min(hi, lo + seg_elems, ends[part])
            segs.append(parts[part][lo - start:stop - start])
            lo = stop
        chunks.append(segs)
    return chunks


def _chunk_each_part(parts, n, seg_elems, with_part=False):
    """Per chunk, its segments: chunk c is the c-th of n pieces of every
    part (split as ``counts`` split a whole buffer).  Which rank an element
    is summed from first then depends on its place in its own part, not on
    the parts before it: an allreduce of several parts gives each the bits
    an allreduce of that part alone gives (the overlapped optimizer
    averages bucket by bucket what the synchronous one averages at once)."""
    chunks = [[] for _ in range(n)]
    for i, part in enumerate(parts):
        size = part.size
        for c in range(n):
            lo, hi = size * c // n, size * (c + 1) // n
            for start in range(lo, hi, seg_elems):
                view = part[start:min(hi, start + seg_elems)]
                chunks[c].append((view, i) if with_part else view)
    return chunks


def yield_while_waiting(on=True):
    """Make the calling thread's ring waits, where they poll from Python
    (``MNOPT_WAIT=python``, mnopt/transport/waiting.py), yield the core
    between polls (``sched_yield``) instead of napping.

    For mnopt's background thread once it has a short scheduler slice
    (mnopt/common/_sched.py): there it shares a core with the rank's compute,
    and each nap's wake-up waits for that core, while a yield keeps the
    thread runnable and costs it one short slice.  The C wait (the
    default) naps without the GIL instead, at the pace of
    mnopt/transport/ring_pace.py."""
    _waits.by_yield = bool(on) and hasattr(os, 'sched_yield')


def waits_by_yielding():
    """Whether the calling thread's ring waits yield (see above)."""
    return getattr(_waits, 'by_yield', False)


def _ring(comm, parts, wire, counts, first, last, chunk_each_part=False,
          divide=None, divided=None, segment_bytes=None):
    """Run ring steps ``first`` .. ``last``-1 over ``parts`` (see the
    module's docstring: steps below N-1 sum, the others copy).  ``wire``
    None: raw bytes (copy steps only).  ``chunk_each_part``: chunk c is
    the c-th piece of every part (``_chunk_each_part``), not of their
    concatenation.  ``divide``/``divided``: see allreduce_sum_parts (with
    chunk_each_part, from step 0)."""
    global bytes_sent
    n, rank = comm.size, comm.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    mpi_type = MPI.BYTE if wire is None else reduce.MPI_TYPES[wire]
    # Each sum is a phase of the thread's CPU with MNOPT_PROFILE_THREADS=1.
    add = None if wire is None else cpu_phases.timed('sum', _adder(wire))
    seg_elems = _segment_elems(counts, parts[0].itemsize, segment_bytes)
    # This rank's segments still to divide at their first use: each
    # element is either sent at step 0 (chunk rank-1) or summed into at
    # one step below N-1 (every other chunk), exactly once.
    undivided = set()
    if chunk_each_part and divide is not None and divided is not None \
            and not all(divided):
        by_part = _chunk_each_part(parts, n, seg_elems, with_part=True)
        undivided = {id(view) for chunk in by_part for view, i in chunk
                     if not divided[i]}
        chunks = [[view for view, _ in chunk] for chunk in by_part]
    elif chunk_each_part:
        chunks = _chunk_each_part(parts, n, seg_elems)
    else:
        chunks = _chunk_segments(parts, counts, seg_elems)
    # Message lists in the order they are posted (step by step, segment by
    # segment); the left neighbour posts its sends in this same order, and
    # MPI keeps messages between two ranks on one tag in order.
    sends, send_dep = [], []      # view; receive that must be done first
    recvs, recv_sum, recv_dep = [], [], []  # view; sums?; send done first
    send_at, recv_at = {}, {}     # step -> index of its first message
    for s in range(first, last):
        send_at[s], recv_at[s] = len(sends), len(recvs)
        for k, view in enumerate(chunks[(rank - s - 1) % n]):
            sends.append(view)
            # Step s sends what step s-1 received (and summed).
            send_dep.append(recv_at[s - 1] + k if s > first else -1)
        for k, view in enumerate(chunks[(rank - s - 2) % n]):
            recvs.append(view)
            recv_sum.append(s < n - 1)
            # A copy step overwrites the chunk that step s+1-N sent: that
            # send must have left first.
            back = s + 1 - n
            recv_dep.append(send_at[back] + k if back >= first else -1)
    n_sends, n_recvs = len(sends), len(recvs)
    bytes_sent += sum(v.nbytes for v in sends)
    send_req = [None] * n_sends
    recv_req = [None] * n_recvs
    recv_status = [None] * n_recvs
    sent = MPI.Status()   # where waits put the sends' statuses
    # Sums arrive in scratch buffers (at most WINDOW are posted ahead).
    scratch = [numpy.empty(max([v.size for v in recvs], default=0),
                           parts[0].dtype)
               for _ in range(min(WINDOW, sum(recv_sum)))]
    scratch_of = {}
    posted_sends = posted_recvs = recvs_done = sends_done = 0
    by_yield = waits_by_yielding()
    per_byte = ring_pace.seconds_per_byte(comm)
    arrived = []   # (when, bytes) of each receive: the rate (ring_pace.py)
    try:
        while recvs_done < n_recvs or sends_done < n_sends:
            moved = False
            while (posted_recvs < n_recvs
                   and posted_recvs < recvs_done + WINDOW):
                i = posted_recvs
                dep = recv_dep[i]
                if dep >= 0 and not (dep < posted_sends
                                     and waiting.completed(send_req[dep])):
                    break
                if recv_sum[i]:
                    scratch_of[i] = scratch.pop()
                    buf = scratch_of[i][:recvs[i].size]
                else:
                    buf = recvs[i]
                recv_req[i] = comm.Irecv([buf, mpi_type], left, TAG)
                recv_status[i] = MPI.Status()
                posted_recvs += 1
                moved = True
            while posted_sends < n_sends and send_dep[posted_sends] < \
                    recvs_done:
                if undivided and id(sends[posted_sends]) in undivided:
                    undivided.discard(id(sends[posted_sends]))
                    divide(sends[posted_sends])
                send_req[posted_sends] = comm.Isend(
                    [sends[posted_sends], mpi_type], right, TAG)
                posted_sends += 1
                moved = True
            while recvs_done < posted_recvs:
                i = recvs_done
                status = recv_status[i]
                if not waiting.completed(recv_req[i], status):
                    break
                if status.Get_count(mpi_type) != recvs[i].size:
                    raise RuntimeError(ring_checks.size_error(
                        comm, left, recvs[i].size, status, mpi_type))
                if recv_sum[i]:
                    got = scratch_of.pop(i)
                    if undivided and id(recvs[i]) in undivided:
                        undivided.discard(id(recvs[i]))
                        divide(recvs[i])
                    add(got[:recvs[i].size], recvs[i])
                    scratch.append(got)
                recvs_done += 1
                arrived.append((time.perf_counter(), recvs[i].nbytes))
                moved = True
            while sends_done < posted_sends and waiting.completed(
                    send_req[sends_done]):
                sends_done += 1
                moved = True
            if not moved:
                # Everything still in flight, GIL and core left free until
                # one of them completes (mnopt/transport/waiting.py).
                ring_pace.wait_some(per_byte, [
                    (r, recv_status[k], recvs[k].nbytes) for k, r in
                    enumerate(recv_req[recvs_done:posted_recvs], recvs_done)
                    if r != MPI.REQUEST_NULL], [
                    (r, sent, sends[k].nbytes) for k, r in
                    enumerate(send_req[sends_done:posted_sends], sends_done)
                    if r != MPI.REQUEST_NULL], by_yield)
        ring_pace.measured_arrivals(comm, arrived)
    except MPI.Exception as e:
        if e.Get_error_class() == MPI.ERR_TRUNCATE:
            raise RuntimeError(
                'ring collective on rank %d: rank %d sent more than this '
                'rank expected (%s): ranks disagree on the buffer size'
                % (rank, left, e))
        raise


def _adder(wire):
    """fn(a, b): b += a, in the wire dtype."""
    if wire in reduce.SUM_FUNCS:
        return reduce.sum_into(wire)
    return lambda a, b: numpy.add(a, b, out=b)
