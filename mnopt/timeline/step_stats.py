"""Where each step's communication time went, kept by the communicator as
it runs, timeline or no timeline: ``StepStats``, and what the online
report (mnopt/extensions/communication_report.py) and the offline one
(mnopt/report/trace_analysis.py) share: the bus bandwidth factors, the
link rate (``MNOPT_LINK_RATE``) and who arrived last at a collective.

A communicator holds one StepStats (``comm.step_stats``) and adds to it
at a few places of every averaging; ``comm.communication_stats()``
returns what was added since the last call and starts again (``take``).
What is kept, all on this rank:

- ``exposed``: seconds the caller (the training loop's thread) was
  blocked on communication: a synchronous averaging whole (``mean_grads``,
  ``reduce_scatter_mean``: pack, wire and unpack), a wait for background
  averaging (``MeanHandle.wait``, and ``mean_grads_async`` waiting for
  the previous one), ZeRO's parameter all-gather (``allgather_params``);
- ``hidden``: seconds of averaging on the background thread
  (``mean_grads_async``, ``reduce_scatter_mean_async``: pack, wire and
  unpack) less the waits for it, at least 0: the averaging that ran while
  the caller computed.  0 without background averaging;
- ``wire``: seconds inside collectives ('wire' spans: from this rank's
  arrival until its result is in), on either thread;
- ``bytes``: the collectives' payload (the wire-dtype bytes of the
  buffer, as the timeline's 'wire' spans say), and ``bytes_sent`` /
  ``bytes_received``: what this rank put on and took off the wire for it,
  by the communicator's algorithm (``traffic`` for rings and MPI's
  collectives; the reduction server: the payload each way; sign
  compression: the vote's bytes as its algorithm counts them);
- ``bus_bytes``: the payload times nccl-tests' bus factor of each
  collective (``BUS_FACTOR``): over ``wire`` seconds it is the bus
  bandwidth, comparable with the link rate;
- ``arrivals``: (collective, seconds waited) of the last ``keep``
  collectives (1024), a collective named by (communicator label, seq):
  the same on every rank.  Seconds waited: from this rank's arrival
  (``arrive``: before the averaging's first exchange, the cross-rank
  check of its layout, where a late rank is waited for) until the
  result is in.  The rank that arrived last waited least
  (``stragglers``).

Adding costs two ``clock()`` readings, a lock and a few additions per
collective or wait; no communication.

Leaf module: imports only the standard library.
"""

import collections
import contextlib
import os
import re
import statistics
import threading
import time

#: The clock every duration is read on (seconds): the timeline's.
clock = time.perf_counter
#: The environment variable giving the link rate (bits per second).
LINK_RATE_ENV = 'MNOPT_LINK_RATE'

#: Bytes on the busiest link per byte of payload, by the 'op' of a
#: collective (nccl-tests' bus bandwidth factors), n = the number of ranks.
BUS_FACTOR = {
    'allreduce': lambda n: 2.0 * (n - 1) / n,
    'reduce_scatter': lambda n: (n - 1.0) / n,
    'allgather': lambda n: (n - 1.0) / n,
    'bcast': lambda n: 1.0,
    'reduce': lambda n: 1.0,
}


def bus_factor(op, n):
    """``BUS_FACTOR`` of ``op`` (an allreduce's for another op: the sign
    vote) at ``n`` ranks; 0 at one rank."""
    if n < 2:
        return 0.0
    return BUS_FACTOR.get(op, BUS_FACTOR['allreduce'])(n)


def traffic(op, nbytes, n):
    """(bytes sent, bytes received) by one of ``n`` ranks in a ring (or
    a bandwidth-optimal MPI collective: reduce-scatter then all-gather)
    of ``nbytes`` of payload: an allreduce sends and receives
    2(n-1)/n of it, a reduce-scatter or all-gather (n-1)/n."""
    if n < 2:
        return 0, 0
    moved = int(round(nbytes * BUS_FACTOR.get(op, BUS_FACTOR['allreduce'])(
        n)))
    return moved, moved


_RATE = re.compile(r'^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:bit)?(?:/s)?\s*$',
                   re.I)


def parse_rate(text):
    """'1gbit', '250mbit', '10Gbit/s', '1e9'... -> bits per second."""
    m = _RATE.match(str(text))
    if m is None:
        try:
            return float(text)
        except ValueError:
            raise ValueError('not a link rate: %r (say 1gbit, 250mbit, '
                             '10gbit/s: bits per second)' % (text,))
    scale = {'': 1, 'k': 1e3, 'm': 1e6, 'g': 1e9, 't': 1e12}
    return float(m.group(1)) * scale[m.group(2).lower()]


def link_rate(given=None):
    """The link rate in bits/s: ``given`` (a number or a rate as
    ``parse_rate`` reads it), else $MNOPT_LINK_RATE, else None (unknown).
    ValueError for a rate that cannot be read."""
    text = given if given is not None else \
        os.environ.get(LINK_RATE_ENV, '').strip() or None
    if text is None:
        return None
    rate = text if isinstance(text, (int, float)) else parse_rate(text)
    if not rate > 0:
        raise ValueError('the link rate must be positive, not %r' % (text,))
    return float(rate)


def last_arrival(arrivals):
    """(rank, how late) of one collective from {rank: arrival time}: the
    rank that arrived last, late by its arrival less the median arrival
    of the others (in the unit given).  None for fewer than 2 ranks."""
    if len(arrivals) < 2:
        return None
    times = sorted((t, rank) for rank, t in arrivals.items())
    last, rank = times[-1]
    return rank, last - statistics.median(t for t, _ in times[:-1])


#: Seconds a rank must be late by to count as last at a collective (as
#: ``python -m mnopt.report --min-late``): ranks that arrive together are
#: last by chance.
MIN_LATE = 1e-4


def stragglers(per_rank, min_late=MIN_LATE):
    """Who arrived last at the collectives, from every rank's
    ``arrivals`` (``per_rank[r]``: [(collective, seconds waited)]): the
    rank that waited least at a collective arrived last, late by the
    median wait of the others less its own.  Returns {'matched':
    collectives seen on 2 or more ranks, 'last': {rank: [seconds late,
    ...]} where late by ``min_late`` or more, 'straggler': the rank last
    most often (of a tie, the one late by more in all; None if no rank
    was late), 'late': its median lateness at those (s; 0.0 if none)}.
    The median: a rank late to a step is late at each collective until
    the ranks wait for each other, and one late by chance adds little."""
    waits = collections.defaultdict(dict)
    for rank, arrivals in enumerate(per_rank):
        for key, seconds in arrivals:
            key = tuple(key) if isinstance(key, list) else key
            waits[key][rank] = waits[key].get(rank, 0.0) + seconds
    last = collections.defaultdict(list)
    matched = 0
    for wait in waits.values():
        # Every rank's wire ends together: arrival = end - wait.
        found = last_arrival({r: -w for r, w in wait.items()})
        if found is not None:
            matched += 1
            if found[1] >= min_late:
                last[found[0]].append(found[1])
    straggler = min(last, key=lambda r: (-len(last[r]), -sum(last[r]), r)) \
        if last else None
    return {'matched': matched, 'last': dict(last), 'straggler': straggler,
            'late': statistics.median(last[straggler]) if last else 0.0}


class _Wire(object):
    """A collective timed for StepStats, and the timeline's 'wire' span
    around it (``span``, a do-nothing one when the timeline is off)."""

    __slots__ = ('_stats', '_span', '_key', '_nbytes', '_op', '_traffic',
                 '_start')

    def __init__(self, stats, span, key, nbytes, op, traffic_of):
        self._stats, self._span, self._key = stats, span, key
        self._nbytes, self._op, self._traffic = nbytes, op, traffic_of

    def __enter__(self):
        self._span.__enter__()
        self._start = clock()
        return self

    def set(self, **args):
        """Args for the timeline's span (as Timeline spans take)."""
        self._span.set(**args)

    def __exit__(self, *exc):
        end = clock()
        self._span.__exit__(*exc)
        stats = self._stats
        arrived = stats.arrived.pop(threading.get_ident(), None)
        if exc[0] is None:
            sent, received = self._traffic(self._nbytes, self._op)
            stats.add_wire(self._key, end - self._start, self._nbytes,
                           self._op, sent, received,
                           None if arrived is None else end - arrived)
        return False


class StepStats(object):
    """One communicator's communication figures since they were last
    taken (see the module).  ``size``: its number of ranks (the bus
    factors'); ``keep``: how many collectives' arrivals are kept.
    Thread-safe: the caller and the background thread add to it."""

    FIELDS = ('exposed', 'waited', 'background', 'wire', 'collectives',
              'bytes', 'bytes_sent', 'bytes_received', 'bus_bytes')

    def __init__(self, size, keep=1024):
        self.size = size
        self._lock = threading.Lock()
        self._arrivals = collections.deque(maxlen=keep)
        #: {thread ident: clock() at its arrival}, for its next collective.
        self.arrived = {}
        #: (CommunicationReport, its trainer) that takes the figures, if
        #: one claimed them: ``take`` hands each figure out once, so a
        #: second reader would see only what the first left.
        self.reader = None
        self._reset()

    def _reset(self):
        self.exposed = self.waited = self.background = self.wire = 0.0
        self.bus_bytes = 0.0
        self.collectives = self.bytes = 0
        self.bytes_sent = self.bytes_received = 0
        self._arrivals.clear()

    # -- adding --------------------------------------------------------------

    def add_time(self, where, seconds):
        """``seconds`` of communication: where='caller' (the caller
        blocked on it: exposed), 'waited' (the caller waiting for the
        background: exposed, and set against the background's time) or
        'background' (averaging on the background thread)."""
        with self._lock:
            if where == 'background':
                self.background += seconds
            else:
                self.exposed += seconds
                if where == 'waited':
                    self.waited += seconds

    @contextlib.contextmanager
    def timed(self, where='caller'):
        """``add_time(where, the time spent inside)``."""
        start = clock()
        try:
            yield
        finally:
            self.add_time(where, clock() - start)

    def arrive(self):
        """This thread arrives at its next collective now: its wait is
        counted from here (where ranks first wait for each other)."""
        self.arrived[threading.get_ident()] = clock()

    def add_arrival(self, key, waited):
        """An exchange that only synchronizes (an agreement: nothing of
        it counts as wire time or bytes): ``waited`` seconds from this
        rank's arrival until it was done."""
        with self._lock:
            self._arrivals.append((key, waited))

    def add_wire(self, key, seconds, nbytes, op, sent, received,
                 waited=None):
        """One collective: ``key`` names it alike on every rank (label,
        seq), ``seconds`` in its wire, ``nbytes`` of payload, ``op``
        ('allreduce', 'reduce_scatter', 'allgather', 'vote'),
        ``sent``/``received`` bytes by this rank, ``waited`` seconds from
        its arrival until the result was in (default ``seconds``)."""
        with self._lock:
            self.wire += seconds
            self.collectives += 1
            self.bytes += nbytes
            self.bytes_sent += sent
            self.bytes_received += received
            self.bus_bytes += nbytes * bus_factor(op, self.size)
            self._arrivals.append((key, seconds if waited is None
                                   else waited))

    def wire_timer(self, span, key, nbytes, op, traffic_of):
        """A context manager timing one collective (``add_wire`` at its
        end, ``traffic_of(nbytes, op)`` giving (sent, received)) and
        entering ``span`` (the timeline's) around it; the wait is counted
        from this thread's ``arrive``, where it was called."""
        return _Wire(self, span, key, nbytes, op, traffic_of)

    # -- taking --------------------------------------------------------------

    def take(self):
        """What was added since the last ``take``, as a dict of the
        FIELDS, 'hidden' (background less waited, at least 0), 'busbw'
        (bus_bytes / wire, bytes/s; None without wire time) and
        'arrivals' (a list); then starts again from zero."""
        with self._lock:
            out = {f: getattr(self, f) for f in self.FIELDS}
            out['arrivals'] = list(self._arrivals)
            self._reset()
        out['hidden'] = max(out['background'] - out['waited'], 0.0)
        out['busbw'] = out['bus_bytes'] / out['wire'] \
            if out['wire'] > 0 and out['bus_bytes'] else None
        return out
