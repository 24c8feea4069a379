"""Tuning in the job itself: ``bucket_bytes='auto'``,
``segment_bytes='auto'`` (flat, hierarchical), ``chunk_bytes='auto'``,
``window='auto'`` (reduction_server) are picked by timing the job's own
first averagings, and every rank picks the same.

A coordinate search: the settings are tuned one after the other (the
bucket size, then the ring's segment size; the reduction server's chunk,
then its window), each over its ``CANDIDATES`` with the others held at
their values so far.  Each candidate runs ``REPEATS`` averagings of the
same gradient set (the first one averaged, on the synchronous or the
background group, whichever averages first; others in between run
untimed: see ``Tuner.begin``); its time on one rank is the least of its
repeats (the first use of a setting pays for a new buffer), and its time
overall that of its slowest rank.  When one setting's candidates are done
the ranks exchange their times once (``agreement.quickest``,
mnopt/transport/agreement.py) and every rank takes the quickest from the
same list: the same choice on every rank whatever each one measured, so
no rank ever runs with a setting the others do not.  At most
``max_steps()`` averagings (18) are tuned.

What a setting changes in the bits: the ring's segment, the server's chunk
and window move nothing but the pipelining (every element is summed in
the same order).  The bucket size cuts the buffer into the parts the ring
chunks one by one (or MPI sums one call each), which at three or more
ranks can change which rank's value an element's sum starts from: the
last bit of a float32 mean can differ from another bucket size's.  Each
averaging, tuned or not, gives exactly the bits that a fixed setting of
the values it ran with gives (tests/test_tune.py).
"""

import logging
import threading

from mnopt import grad_buffer
from mnopt import log
from mnopt import server_protocol

AUTO = 'auto'

#: Each tunable setting's candidates, its default first.  The bucket
#: sizes reach 256 MiB: one bucket for ResNet-50's 102 MB.
CANDIDATES = {
    'bucket_bytes': (grad_buffer.DEFAULT_BUCKET_BYTES, 4 << 20, 16 << 20,
                     64 << 20, 256 << 20),
    'segment_bytes': (256 << 10, 64 << 10, 1 << 20, 4 << 20),
    'chunk_bytes': (server_protocol.DEFAULT_CHUNK_BYTES, 64 << 10,
                    128 << 10, 1 << 20, 4 << 20),
    'window': (server_protocol.DEFAULT_WINDOW, 2, 4, 12),
}
#: The value of each tunable setting that a communicator does not take
#: (segment_bytes None: the ring's own rule).
DEFAULTS = {'bucket_bytes': grad_buffer.DEFAULT_BUCKET_BYTES,
            'segment_bytes': None,
            'chunk_bytes': server_protocol.DEFAULT_CHUNK_BYTES,
            'window': server_protocol.DEFAULT_WINDOW}
#: Averagings per candidate.
REPEATS = 2
#: What each kind tunes, in the order it tunes them.  naive averages one
#: array at a time and pure_nccl all at once: nothing to tune.
TUNABLE = {'flat': ('bucket_bytes', 'segment_bytes'),
           'hierarchical': ('bucket_bytes', 'segment_bytes'),
           'reduction_server': ('chunk_bytes', 'window')}

_logger = log.get(__name__)


def max_steps():
    """The most averagings any tuning times."""
    return max(REPEATS * sum(len(CANDIDATES[n]) for n in names)
               for names in TUNABLE.values())


def tuned_names(settings):
    """The settings that ``settings`` (check_arguments' result) tunes."""
    return sorted(n for n in CANDIDATES if settings.get(n) == AUTO)


def check(kind, settings):
    """ValueError for an 'auto' that a ``kind`` communicator with these
    ``settings`` cannot tune; local, so every rank raises alike (the
    settings it reads are shared)."""
    names = tuned_names(settings)
    if not names:
        return
    wrong = [n for n in names if n not in TUNABLE.get(kind, ())]
    if wrong:
        raise ValueError(
            "%s='auto': the %s communicator tunes %s" % (
                wrong[0], kind,
                ' and '.join("%s='auto'" % n for n in TUNABLE[kind])
                if kind in TUNABLE else
                'nothing (naive averages one array at a time, pure_nccl '
                'everything in one call): pass a number or leave it out'))
    if settings.get('compression') is not None:
        raise ValueError(
            "%s='auto' does not combine with compression=%r: tuning times "
            'plain averagings, and a compressed one is a vote; pass '
            'numbers' % (names[0], settings['compression']))


class Tuner(object):
    """The tuning of a ``kind`` communicator (``settings``: its checked
    settings; ``rank``: its rank, 0 logs the choice).  ``current()`` is
    what the averaging running on the calling thread runs with, tuned or
    not; ``result`` the choice, once made (None before; {} when nothing
    is tuned)."""

    def __init__(self, kind, settings, rank):
        check(kind, settings)
        names = tuned_names(settings)
        #: The plan: (setting, candidates), in the order they are tuned.
        self.plan = [(n, CANDIDATES[n]) for n in TUNABLE.get(kind, ())
                     if n in names]
        #: The tuned group's values: the candidate being timed, the
        #: choices made so far, then the result.
        self.values = {n: settings.get(n, DEFAULTS[n]) for n in CANDIDATES}
        for name, candidates in self.plan:
            self.values[name] = candidates[0]
        self.result = {} if not self.plan else None
        #: (setting, candidate, slowest rank's seconds) of every candidate
        #: timed, in order: the evidence of the choice.
        self.history = []
        #: Averagings timed so far.
        self.steps = 0
        #: fn(seconds, setting, value) -> seconds: what a timed averaging
        #: counts as (tests put in made-up times, per rank).
        self.measure = lambda seconds, name, value: seconds
        self._rank = rank
        self._phase = self._candidate = self._repeat = 0
        self._times = []
        self._group = self._gradients = None
        # What the other group runs with until it has agreed that every
        # rank holds the result (never changed: no race with the tuning).
        self._initial = dict(self.values)
        self._settled = set()
        self._local = threading.local()

    @property
    def done(self):
        return self.result is not None

    def current(self):
        """The values the calling thread's averaging runs with."""
        return getattr(self._local, 'values', self.values)

    def begin(self, named, group, everyone_done):
        """Whether the averaging of ``named`` (name, array) pairs about to
        run on ``group`` ('sync' or 'async') is timed; ``current()`` then
        holds the values it runs with.

        Only averagings of the first gradient set on the first group to
        average are timed: the exchanges then run on one MPI
        communicator, at the same averaging on every rank, and that
        group's values change only between its own averagings.  The other
        group (its own thread, at its own times) runs with the first
        candidates until, at one of its averagings, it finds that every
        rank holds the result (``everyone_done(self.done)``: one exchange
        over its own communicator, at the same averaging on every rank);
        then with the result.  No rank ever runs another value than the
        others at the same averaging."""
        if self._group is None:
            self._group = group
        if group != self._group:
            if group not in self._settled and everyone_done(self.done):
                self._settled.add(group)
            self._local.values = self.values if group in self._settled \
                else self._initial
            return False
        self._local.values = self.values
        if self.done:
            return False
        key = tuple((n, a.shape, a.dtype.str) for n, a in named)
        if self._gradients is None:
            self._gradients = key
        if key != self._gradients:
            return False   # another gradient set: the values so far
        name, candidates = self.plan[self._phase]
        self.values[name] = candidates[self._candidate]
        return True

    def end(self, seconds, quickest):
        """After a timed averaging that took ``seconds`` here:
        ``quickest(times)`` is ``agreement.quickest`` over the group the
        averaging ran on, called once a setting's candidates are done, on
        every rank at the same averaging."""
        name, candidates = self.plan[self._phase]
        seconds = self.measure(seconds, name, candidates[self._candidate])
        self.steps += 1
        if self._repeat == 0:
            self._times.append(seconds)
        else:
            self._times[-1] = min(self._times[-1], seconds)
        self._repeat += 1
        if self._repeat < REPEATS:
            return
        self._repeat = 0
        self._candidate += 1
        if self._candidate < len(candidates):
            return
        best, slowest = quickest(self._times)
        self.values[name] = candidates[best]
        self.history += [(name, c, s) for c, s in zip(candidates, slowest)]
        self._times, self._candidate = [], 0
        self._phase += 1
        if self._phase == len(self.plan):
            self.result = {n: self.values[n] for n, _ in self.plan}
            if self._rank == 0:
                log.say(_logger, logging.INFO,
                        'mnopt: tuned in %d averagings: %s', self.steps,
                        ', '.join('%s=%r' % kv for kv in
                                  sorted(self.result.items())))
