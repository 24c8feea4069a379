"""The reduction server (Herring / Fairring / Optcast): protocol and loop.

    mpiexec -n W python train.py : -n S python -m mnopt.server [--memory B]

Workers (``create_communicator('reduction_server')``) pack their gradients
divided by W (in the cast to the wire dtype, as every communicator does;
the servers' float32 sums then leave only gradient / W and the mean to fit
a 16-bit wire), split them into one near-equal
contiguous shard per server, cut each shard into chunks, and push them; a
server sums each chunk's shares over the workers in float32, in worker
order (bitwise deterministic), rounds once to the wire dtype and pushes
the mean back.  Each worker sends S bytes and
receives S bytes, against 2(N-1)/N S for a ring.

Every request starts with a header from each worker to each server; the
server answers a status as soon as it has all headers, so a disagreement
(protocol version, number of workers, sizes, dtype, layout) is an error on
every worker at once, which the server also reports.  Staging memory is
bounded (``--memory``, like FAIRRING_TOTAL_MEMORY): at least one chunk's
worth of slots is always available, so any bound makes progress.

Launched without servers, the communicator runs this same loop on a thread
in every worker (colocated, as Fairring does).
"""

import argparse
import atexit
import threading
import time

import numpy
from mpi4py import MPI

from mnopt.transport import polling
from mnopt import _sched
from mnopt import grad_buffer
from mnopt import log
from mnopt import sign
from mnopt import stall
from mnopt import stall_settings
from mnopt import stall_wait

logger = log.get('mnopt.server')   # also when run as __main__

#: 3: workers send their gradients divided by W; the server only sums.
PROTOCOL_VERSION = 3
# Wires: the gradient dtypes, and 'sign' (packed sign bits; the servers
# count the votes and return the majority bits, see mnopt/sign.py).
WIRES = tuple(grad_buffer.WIRE_DTYPES) + ('sign',)
WIRE_CODES = {name: i for i, name in enumerate(WIRES)}
TAG_HEADER, TAG_STATUS, TAG_DATA, TAG_RESULT = 0x3A0, 0x3A1, 0x3A2, 0x3A3
KIND_REDUCE, KIND_BYE = 1, 2
DEFAULT_CHUNK_BYTES = 1 << 18
DEFAULT_WINDOW = 6  # chunks in flight per worker and server
STATUS_BYTES = 4000  # a server's answer to a header: '' or why it refused
DEFAULT_MEMORY = 64 << 20

# Header: kind, version, n_workers, total, shard_start, shard_len, chunk,
# wire code, layout digest, step (the votes' coin for ties).
HEADER_FIELDS = 10


def shard_bounds(total, n_servers):
    return [total * j // n_servers for j in range(n_servers + 1)]


def chunk_slices(length, chunk):
    return [slice(s, min(s + chunk, length)) for s in range(0, length, chunk)]


def stall_settings_problem(stall_warning, timeout):
    """In a job with server processes the job's one monitor watches every
    process, so stall times come from the environment only: a ValueError
    for keywords that set them, else None."""
    if stall_warning is not None or timeout is not None:
        return ValueError(
            'with reduction servers, stall detection covers the whole '
            'job: set MNOPT_STALL_WARNING / MNOPT_TIMEOUT in the '
            'environment of every process instead')
    return None


_job = None
ROLES = ('worker', 'server')
#: The channels' names, in the order of ``Job.channels()``: serve counts
#: its requests per channel (two threads serve them at once).
CHANNEL_NAMES = ('sync', 'async')


class Job(object):
    """Who is what in COMM_WORLD, agreed once per process by every process
    (workers at their first create_communicator, servers at start-up)."""

    def __init__(self, roles):
        self.roles = roles
        self.servers = [r for r, role in enumerate(roles) if role == 'server']
        self.workers = [r for r, role in enumerate(roles) if role == 'worker']
        self._channels = None
        self._monitor = None
        self.async_user = None  # weakref to the communicator averaging on
        #                         the async channel in the background

    def name_of(self, world_rank):
        """'worker k' or 'server k' (k counts within the role)."""
        if world_rank in self.servers:
            return 'server %d' % self.servers.index(world_rank)
        return 'worker %d' % self.workers.index(world_rank)

    def monitor(self):
        """Stall detection over the whole job (workers and servers), made
        with the channels; shared by every process's reduction_server
        communicators."""
        self.channels()
        return self._monitor

    def channels(self):
        """(this role's communicator, [sync channel, async channel]).

        Made once per process, collectively over COMM_WORLD (servers at
        start-up, workers at their first reduction_server communicator),
        and shared by every such communicator of the process.  Workers say
        goodbye on them when the process exits."""
        if self._channels is None:
            world = MPI.COMM_WORLD
            is_server = world.rank in self.servers
            # Read before the first collective, so that a bad setting on
            # one process cannot leave the others in the Split (it is
            # reported where the arguments are checked).
            warning, timeout = stall_settings.settings_or_defaults()
            mine = world.Split(1 if is_server else 0, world.rank)
            self._channels = (mine, [world.Dup(), world.Dup()])
            self._monitor = stall.Monitor(
                world, 'job', warning or 0, timeout or 0, names=self.name_of,
                helpers=self.servers)
            if not is_server:
                atexit.register(say_goodbye, self._channels[1], self.servers)
        return self._channels


def say_goodbye(channels, servers):
    """Tell every server, on every channel, that this worker is done;
    servers exit once all workers have."""
    if MPI.Is_finalized():
        return
    bye = numpy.zeros(HEADER_FIELDS, numpy.int64)
    bye[0] = KIND_BYE
    for chan in channels:
        for server in servers:
            chan.Send([bye, MPI.INT64_T], dest=server, tag=TAG_HEADER)


def job(default_role='worker', stall_warning=None, timeout=None):
    """This process's Job, agreed at the first call (collective over
    COMM_WORLD: every worker at its first create_communicator, every
    server at start-up).  With servers, the channels are made at once.

    The exchange is waited for with stall detection (``stall_warning``,
    ``timeout``, else MNOPT_STALL_WARNING / MNOPT_TIMEOUT): a process that
    never gets there (a worker that fails or exits before creating a
    communicator) ends the job at the timeout, with a report, instead of
    leaving the others waiting forever."""
    global _job
    if _job is None:
        # A process's role is its entry point's (mnopt.server serves, any
        # other script works), not MPI's APPNUM: an MPMD launch also gives
        # ranks of one script their own environments.
        roles = _exchange_roles(default_role, stall_warning, timeout)
        the_job = Job(roles)
        if the_job.servers and max(the_job.workers, default=-1) > \
                min(the_job.servers):
            # Every process sees the same roles: the same error everywhere.
            raise ValueError(
                'reduction servers must come after the workers in the '
                'job (servers at ranks %s, workers at %s): launch as in '
                'mpiexec -n W python train.py : -n S python -m mnopt.server'
                % (the_job.servers, the_job.workers))
        if the_job.servers:
            # Straight after the exchange, which every process has passed:
            # these collectives cannot wait for a process that is not
            # coming.
            the_job.channels()
        _job = the_job
    return _job


def _exchange_roles(mine, stall_warning, timeout):
    world = MPI.COMM_WORLD
    codes = numpy.empty(world.size, numpy.int32)
    request = world.Iallgather(
        [numpy.array([ROLES.index(mine)], numpy.int32), MPI.INT],
        [codes, MPI.INT])
    stall_wait.wait_or_abort(
        [request], 'the job start-up (every worker at its first '
        'create_communicator, every reduction server at its start)',
        stall_warning, timeout)
    return [ROLES[c] for c in codes]


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
          idle=None, on_headers=None):
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
    """
    _sched.prefer_low_latency()   # it waits on the network: mnopt/_sched.py
    n = len(workers)
    headers = numpy.empty((n, HEADER_FIELDS), dtype=numpy.int64)
    byes = set()
    while len(byes) < n:
        watch = None
        try:
            watch = _receive_headers(chan, workers, headers, byes, monitor,
                                     name, idle)
            if on_headers is not None:
                on_headers()
            if watch is not None:
                watch.detail = '(reducing)'
            _serve_request(chan, workers, headers, my_index, n_servers,
                           memory, stats, on_error)
        finally:
            if watch is not None:
                watch.__exit__(None, None, None)


def _receive_headers(chan, workers, headers, byes, monitor, name,
                     idle=None):
    """Receive the next header of every worker still here into
    ``headers`` (zeros for those gone), adding goodbyes to ``byes``.
    Returns the watched operation, entered at the first reduction header
    (None if there was none, or no ``monitor``).  ``idle``: see serve."""
    waiting = {}
    for i, w in enumerate(workers):
        if w in byes:
            headers[i] = 0
        else:
            waiting[i] = chan.Irecv([headers[i], MPI.INT64_T], source=w,
                                    tag=TAG_HEADER)
    index, requests = list(waiting), list(waiting.values())
    if idle is not None:
        # Get_status looks without completing (Testsome does that below).
        while not any(r.Get_status() for r in requests):
            if idle():
                break
    watch = None
    while True:
        done = polling.wait_some(requests)
        if done is None:
            return watch
        for k in done:
            i = index[k]
            del waiting[i]
            if headers[i, 0] == KIND_BYE:
                byes.add(workers[i])
            elif watch is None and monitor is not None:
                watch = monitor.op(name).__enter__()
        if watch is not None and waiting:
            watch.detail = "(waiting for the header of %s)" % ', '.join(
                'worker %d' % i for i in sorted(waiting))


def _serve_request(chan, workers, headers, my_index, n_servers, memory,
                   stats, on_error):
    """One request, its headers in: check them, answer, reduce."""
    n = len(workers)
    active = [i for i, w in enumerate(workers) if headers[i, 0] ==
              KIND_REDUCE]
    if not active:
        return
    problem = _check_headers(headers, active, n, my_index, n_servers)
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
    _reduce(chan, workers, headers[active[0]], memory, stats)


def _check_headers(headers, active, n, my_index, n_servers):
    if len(active) != n:
        return ('%d of %d workers asked for a reduction while the others '
                'finished' % (len(active), n))
    first = headers[active[0]]
    if first[1] != PROTOCOL_VERSION:
        return ('protocol version %d, server speaks %d'
                % (first[1], PROTOCOL_VERSION))
    if first[2] != n:
        return ('workers think there are %d workers, the server sees %d'
                % (first[2], n))
    for i in active:
        if not (headers[i, 1:] == first[1:]).all():
            fields = ('version', 'workers', 'total elements', 'shard start',
                      'shard length', 'chunk', 'wire dtype', 'layout digest',
                      'step')
            diff = [f for f, a, b in zip(fields, headers[i, 1:], first[1:])
                    if a != b]
            return ('worker %d and worker %d disagree on %s (protocol %d, '
                    'signature %s vs %s)' % (
                        active[0], i, ', '.join(diff), PROTOCOL_VERSION,
                        list(first[1:]), list(headers[i, 1:])))
    bounds = shard_bounds(int(first[3]), n_servers)
    if (first[4], first[5]) != (bounds[my_index],
                                bounds[my_index + 1] - bounds[my_index]):
        return 'shard %d is [%d, +%d), workers sent [%d, +%d)' % (
            my_index, bounds[my_index], bounds[my_index + 1]
            - bounds[my_index], first[4], first[5])
    return None


def _drain(chan, workers, headers, active):
    """Receive and drop what each worker sends after a refused header."""
    for i in active:
        dtype = wire_storage(WIRES[int(headers[i, 7])]
                             if 0 <= headers[i, 7] < len(WIRES) else 'float32')
        for piece in chunk_slices(int(headers[i, 5]), max(1, int(headers[i, 6]))):
            sink = numpy.empty(piece.stop - piece.start, dtype)
            chan.Recv([sink, MPI.BYTE], source=workers[i], tag=TAG_DATA)


def wire_storage(wire):
    return numpy.dtype(numpy.uint8) if wire == 'sign' else \
        grad_buffer.storage_dtype(wire)


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
    by the coin of mnopt/sign.py, from each element's index and the step)."""

    def __init__(self, n, step):
        self.n, self.step = n, step
        self.counts_dtype = numpy.uint8 if n < 256 else numpy.uint16

    def __call__(self, stage, result, size, first):
        counts = numpy.zeros(8 * size, self.counts_dtype)
        for i in range(self.n):
            counts += numpy.unpackbits(stage[i, :size])
        result[:size] = numpy.packbits(
            sign.majority_bits(counts, self.n, 8 * first, self.step))


def _reduce(chan, workers, header, memory, stats):
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
        polling.wait_all(sends[k])  # its last result has left
        size = pieces[c].stop - pieces[c].start
        stage = slots[k][0]
        recvs[c] = [chan.Irecv([stage[i, :size], MPI.BYTE], source=w,
                               tag=TAG_DATA) for i, w in enumerate(workers)]

    for c in range(min(n_slots, len(pieces))):
        post(c)
    combine = _MajorityOfWorkers(n, int(header[9])) if wire == 'sign' \
        else _MeanOfWorkers(wire, n, chunk)
    for c, piece in enumerate(pieces):
        k = c % n_slots
        size = piece.stop - piece.start
        t0 = time.perf_counter()
        polling.wait_all(recvs[c])
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
    t3 = time.perf_counter()
    for s in sends:
        polling.wait_all(s)
    if stats is not None:
        stats.add('send', time.perf_counter() - t3)
        stats.bytes += 2 * n * shard_len * dtype.itemsize


def main(argv=None):
    from mnopt import cli
    p = argparse.ArgumentParser(prog='python -m mnopt.server',
                                description=__doc__.split('\n')[0])
    p.add_argument('--memory', type=cli.positive_int, default=DEFAULT_MEMORY,
                   metavar='BYTES',
                   help='bytes of staging memory per channel (default 64 MiB)')
    p.add_argument('--stats', action='store_true',
                   help='print per-phase statistics when the job ends')
    from mnopt import global_except_hook
    # First: a bad option or setting must end the job, not leave the
    # workers waiting for this process.
    global_except_hook.add_hook()
    args = cli.parse_args(p, argv)
    # A bad MNOPT_STALL_WARNING / MNOPT_TIMEOUT raises.
    stall_settings.settings()
    world = MPI.COMM_WORLD
    the_job = job(default_role='server')
    # Mirror the workers' start-up: the split and the two channels.
    _, chans = the_job.channels()
    index = the_job.servers.index(world.rank)
    stats = Stats() if args.stats else None

    def report(problem):
        # An ERROR record of logger mnopt.server (mnopt/log.py): the
        # worker that sent it fails; the server goes on serving.
        logger.error('mnopt.server %d: refused a reduction: %s', index,
                     problem)

    from mnopt.global_except_hook import run_or_abort
    threads = [threading.Thread(target=run_or_abort, args=(
        serve, chan, the_job.workers, index, len(the_job.servers),
        args.memory, stats, report, the_job.monitor(), 'serve.' + name))
        for chan, name in zip(chans, CHANNEL_NAMES)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if stats is not None:
        elapsed = time.perf_counter() - start
        print(stats.format('server %d' % index))
        print('server %d: %.1f MB moved, %.3f GB/s over the job' % (
            index, stats.bytes / 1e6, stats.bytes / max(elapsed, 1e-9) / 1e9))


if __name__ == '__main__':
    main()
