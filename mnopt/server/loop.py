"""The reduction server's loop: serve requests on a channel until every
worker says goodbye; each request's headers received and checked, then its
shard reduced chunk by chunk in bounded staging memory (the workers' mean
in float32, or the majority of their sign bits), with per-phase times.

A server sums each chunk's shares over the workers in float32, in worker
order (bitwise deterministic), rounds once to the wire dtype and pushes
the mean back.  Staging memory is bounded (``--memory``, like
FAIRRING_TOTAL_MEMORY): at least one chunk's worth of slots is always
available, so any bound makes progress."""

import threading
import time

import numpy
from mpi4py import MPI

from mnopt.transport import waiting
from mnopt.common import _sched
from mnopt.codecs import grad_buffer
from mnopt.codecs import sign
from mnopt.server.protocol import (DEFAULT_MEMORY, HEADER_FIELDS, KIND_BYE,
                                   KIND_REDUCE, STATUS_BYTES, TAG_DATA,
                                   TAG_HEADER, TAG_RESULT, TAG_STATUS, WIRES,
                                   check_headers, chunk_slices, wire_storage)


class Stats(object):
    """Count, median, min and max seconds per phase (Optcast-style)."""

    def __init__(self):
        self.samples = {}
        self.bytes = 0
        self.lock = threading.Lock()

    def add(self, phase, seconds):
        with self.lock:
            self.samples.setdefault(phase, []).append(seconds)

    def summary(self):
        out = {}
        for phase, xs in sorted(self.samples.items()):
            xs = numpy.asarray(xs)
            out[phase] = {'count': int(xs.size), 'median_s': float(
                numpy.median(xs)), 'min_s': float(xs.min()),
                'max_s': float(xs.max()), 'total_s': float(xs.sum())}
        return out

    def format(self, who):
        lines = ['%s: %-8s %6s %10s %10s %10s' % (
            who, 'phase', 'count', 'median ms', 'min ms', 'max ms')]
        for phase, s in self.summary().items():
            lines.append('%s: %-8s %6d %10.3f %10.3f %10.3f' % (
                who, phase, s['count'], s['median_s'] * 1e3,
                s['min_s'] * 1e3, s['max_s'] * 1e3))
        return '\n'.join(lines)


def serve(chan, workers, my_index, n_servers, memory=DEFAULT_MEMORY,
          stats=None, on_error=None, monitor=None, name='serve',
          idle=None, on_headers=None, timeline=None, pace=waiting.PROMPT):
    """Serve reductions on ``chan`` until every worker says goodbye.

    ``workers`` are the workers' ranks in ``chan`` (in worker order);
    ``my_index`` is this server's shard index.  With a stall-detection
    ``monitor``, each request is watched as operation ``name`` from its
    first reduction header on: waiting for one is idle time, not a stall,
    and so is waiting for the others' goodbyes once a worker has said
    its own (it finished early).

    ``idle()``, where given, is called between requests for as long as no
    header has come: it returns True once the server should look in
    earnest (it blocks until then, or for a while, and returns False).  A
    colocated server's cue is its own process's worker starting an
    exchange: no request can complete without that worker's part, so
    between averagings the thread sleeps instead of polling MPI.
    ``on_headers()`` runs once each round's headers are all in (the
    colocated server forgets its cue there: that exchange is this one).
    ``timeline`` (mnopt/timeline/recorder.py), where on: per chunk a 'wire' (op
    'recv': waiting for every worker's share) and a 'sum' (the reduction),
    then a 'wire' (op 'send') until the results have left, with bytes.
    ``pace``: how its waits poll (mnopt/transport/waiting.py): PATIENT in
    a server process, PROMPT for a colocated server's threads.
    """
    _sched.prefer_low_latency()   # it waits on the network: common/_sched.py
    n = len(workers)
    headers = numpy.empty((n, HEADER_FIELDS), dtype=numpy.int64)
    byes = set()
    while len(byes) < n:
        watch = None
        try:
            watch = _receive_headers(chan, workers, headers, byes, monitor,
                                     name, idle, pace)
            if on_headers is not None:
                on_headers()
            if watch is not None:
                watch.detail = '(reducing)'
            _serve_request(chan, workers, headers, my_index, n_servers,
                           memory, stats, on_error, timeline, pace)
        finally:
            if watch is not None:
                watch.__exit__(None, None, None)


def _receive_headers(chan, workers, headers, byes, monitor, name,
                     idle=None, pace=waiting.PROMPT):
    """Receive the next header of every worker still here into
    ``headers`` (zeros for those gone), adding goodbyes to ``byes``.
    Returns the watched operation, entered at the first reduction header
    (None if there was none, or no ``monitor``).  ``idle``: see serve."""
    awaited = {}
    for i, w in enumerate(workers):
        if w in byes:
            headers[i] = 0
        else:
            awaited[i] = chan.Irecv([headers[i], MPI.INT64_T], source=w,
                                    tag=TAG_HEADER)
    index, requests = list(awaited), list(awaited.values())
    if idle is not None:
        # Get_status looks without completing (Testsome does that below).
        while not any(r.Get_status() for r in requests):
            if idle():
                break
    watch = None
    while True:
        done = waiting.next_completed(requests, pace)
        if done is None:
            return watch
        for k in done:
            i = index[k]
            del awaited[i]
            if headers[i, 0] == KIND_BYE:
                byes.add(workers[i])
            elif watch is None and monitor is not None:
                watch = monitor.op(name).__enter__()
        if watch is not None and awaited:
            watch.detail = "(waiting for the header of %s)" % ', '.join(
                'worker %d' % i for i in sorted(awaited))


def _serve_request(chan, workers, headers, my_index, n_servers, memory,
                   stats, on_error, timeline=None, pace=waiting.PROMPT):
    """One request, its headers in: check them, answer, reduce."""
    n = len(workers)
    active = [i for i, w in enumerate(workers) if headers[i, 0] ==
              KIND_REDUCE]
    if not active:
        return
    problem = check_headers(headers, active, n, my_index, n_servers)
    status = numpy.frombuffer(
        (problem or '').encode()[:STATUS_BYTES].ljust(STATUS_BYTES, b'\0'),
        numpy.uint8)
    for i in active:
        chan.Send([status, MPI.BYTE], dest=workers[i], tag=TAG_STATUS)
    if problem:
        if on_error:
            on_error(problem)
        _drain(chan, workers, headers, active)
        return
    _reduce(chan, workers, headers[active[0]], memory, stats, timeline,
            pace)


def _drain(chan, workers, headers, active):
    """Receive and drop what each worker sends after a refused header."""
    for i in active:
        dtype = wire_storage(WIRES[int(headers[i, 7])]
                             if 0 <= headers[i, 7] < len(WIRES) else 'float32')
        for piece in chunk_slices(int(headers[i, 5]), max(1, int(headers[i, 6]))):
            sink = numpy.empty(piece.stop - piece.start, dtype)
            chan.Recv([sink, MPI.BYTE], source=workers[i], tag=TAG_DATA)


class _MeanOfWorkers(object):
    """Sum the workers' shares (their gradients divided by W) in float32
    (float64 for a float64 wire) in worker order, round once: the workers'
    codec does the casts."""

    def __init__(self, wire, n, chunk):
        self.n = n
        self.codec = grad_buffer.HostCodec(wire)
        acc_dtype = numpy.float64 if wire == 'float64' else numpy.float32
        self.acc = numpy.empty(chunk, acc_dtype)
        self.decoded = numpy.empty(chunk, acc_dtype)

    def __call__(self, stage, result, size, first):
        acc, decoded, codec = self.acc[:size], self.decoded[:size], self.codec
        codec.decode(stage[0, :size], acc)
        for i in range(1, self.n):  # fixed worker order: deterministic
            codec.decode(stage[i, :size], decoded)
            acc += decoded
        codec.encode(acc, result[:size], 1)


class _MajorityOfWorkers(object):
    """Count the workers' packed sign bits, return the majority bits (ties
    by the coin of mnopt/codecs/sign.py, from each element's index and the
    step)."""

    def __init__(self, n, step):
        self.n, self.step = n, step
        self.counts_dtype = numpy.uint8 if n < 256 else numpy.uint16

    def __call__(self, stage, result, size, first):
        counts = numpy.zeros(8 * size, self.counts_dtype)
        for i in range(self.n):
            counts += numpy.unpackbits(stage[i, :size])
        result[:size] = numpy.packbits(
            sign.majority_bits(counts, self.n, 8 * first, self.step))


def _reduce(chan, workers, header, memory, stats, timeline=None,
            pace=waiting.PROMPT):
    n = len(workers)
    shard_start, shard_len, chunk = int(header[4]), int(header[5]), \
        int(header[6])
    wire = WIRES[int(header[7])]
    dtype = wire_storage(wire)
    pieces = chunk_slices(shard_len, chunk)
    if not pieces:
        return
    # Slots of staging memory: each holds one chunk from every worker plus
    # its result.  At least one, so any bound makes progress.
    per_slot = (n + 1) * chunk * dtype.itemsize
    n_slots = max(1, min(len(pieces), memory // max(per_slot, 1)))
    slots = [(numpy.empty((n, chunk), dtype), numpy.empty(chunk, dtype))
             for _ in range(n_slots)]
    recvs = [None] * len(pieces)
    sends = [[] for _ in range(n_slots)]

    def post(c):
        k = c % n_slots
        waiting.wait_all(sends[k], pace)  # its last result has left
        size = pieces[c].stop - pieces[c].start
        stage = slots[k][0]
        recvs[c] = [chan.Irecv([stage[i, :size], MPI.BYTE], source=w,
                               tag=TAG_DATA) for i, w in enumerate(workers)]

    for c in range(min(n_slots, len(pieces))):
        post(c)
    combine = _MajorityOfWorkers(n, int(header[9])) if wire == 'sign' \
        else _MeanOfWorkers(wire, n, chunk)
    record = timeline.record if timeline else None   # off: one test a chunk
    for c, piece in enumerate(pieces):
        k = c % n_slots
        size = piece.stop - piece.start
        t0 = time.perf_counter()
        waiting.wait_all(recvs[c], pace)
        t1 = time.perf_counter()
        stage, result = slots[k]
        combine(stage, result, size, shard_start + piece.start)
        t2 = time.perf_counter()
        sends[k] = [chan.Isend([result[:size], MPI.BYTE], dest=w,
                               tag=TAG_RESULT) for w in workers]
        if c + n_slots < len(pieces):
            post(c + n_slots)
        if stats is not None:
            stats.add('recv', t1 - t0)
            stats.add('reduce', t2 - t1)
        if record is not None:
            nbytes = n * size * dtype.itemsize
            record('wire', 'comm', t0, t1, op='recv', bytes=nbytes)
            record('sum', 'comm', t1, t2, bytes=nbytes)
    t3 = time.perf_counter()
    for s in sends:
        waiting.wait_all(s, pace)
    if record is not None:
        record('wire', 'comm', t3, time.perf_counter(), op='send',
               bytes=n * shard_len * dtype.itemsize)
    if stats is not None:
        stats.add('send', time.perf_counter() - t3)
        stats.bytes += 2 * n * shard_len * dtype.itemsize
