"""Tuning in the job itself: ``bucket_bytes='auto'``,
``segment_bytes='auto'`` (flat, hierarchical), ``chunk_bytes='auto'``,
``window='auto'`` (reduction_server) are picked by timing the job's own
first averagings, and every rank picks the same.

A coordinate search: the settings are tuned one after the other (the
bucket size, then the ring's segment size; the reduction server's chunk,
then its window), each over its ``CANDIDATES`` with the others held at
their values so far.  Each candidate runs ``REPEATS`` averagings of the
same gradient set (the one a group averages first, or the one averaged
when that has not come back for ``REKEY_AFTER`` averagings; others in
between run untimed), the candidates in turn, then again; its time on one
rank is the least of its repeats (the first use of a setting pays for a
new buffer, a busy moment of the machine for one), and its time overall
that of its slowest rank.  Each group (the caller's, the background's)
tunes on its own averagings, whose order is the same on every rank.
When one setting's candidates are done the ranks exchange their times once (``agreement.quickest``,
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

from mnopt.codecs import grad_buffer
from mnopt.common import log
from mnopt.server import protocol as server_protocol

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
#: Averagings of other gradient sets after which the set being timed,
#: not seen since, gives way to the one averaged then.
REKEY_AFTER = 4
#: What each kind tunes, in the order it tunes them.  naive averages one
#: array at a time and pure_nccl all at once: nothing to tune.
TUNABLE = {'flat': ('bucket_bytes', 'segment_bytes'),
           'hierarchical': ('bucket_bytes', 'segment_bytes'),
           'reduction_server': ('chunk_bytes', 'window')}

#: The choice, on rank 0 at INFO: logger mnopt.communicators.tuning, its
#: name before averaging/ (docs/debugging.md, docs/tuning.md).
_logger = log.get('mnopt.communicators.tuning')


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
            'plain averagings of one gradient set, and a compressed one '
            'is a vote or averages other sets (the low-rank factors); '
            'pass numbers' % (names[0], settings['compression']))


class Tuner(object):
    """The tuning of a ``kind`` communicator (``settings``: its checked
    settings; ``rank``: its rank, 0 logs the choice; ``alone``: it does
    not average, one rank alone: nothing to time).  Each group (the caller's 'sync',
    the background's 'async') tunes on its own averagings: a group's
    averagings and its exchanges run in the same order on every rank,
    whatever the threads' timing.  ``current()`` is what the averaging
    running on the calling thread runs with, tuned or not; ``result`` the
    choice, once made."""

    def __init__(self, kind, settings, rank, alone=False):
        check(kind, settings)
        names = tuned_names(settings)
        #: The plan: (setting, candidates), in the order they are tuned.
        self.plan = [(n, CANDIDATES[n]) for n in TUNABLE.get(kind, ())
                     if n in names]
        #: What an averaging outside any tuning runs with: the settings,
        #: the first candidates where 'auto'.
        self.values = {n: settings.get(n, DEFAULTS[n]) for n in CANDIDATES}
        for name, candidates in self.plan:
            self.values[name] = candidates[0]
        #: fn(seconds, setting, value) -> seconds: what a timed averaging
        #: counts as (tests put in made-up times, per rank).
        self.measure = lambda seconds, name, value: seconds
        self._rank = rank
        self._alone = alone
        self._searches = {}    # group -> _Search
        self._local = threading.local()

    @property
    def result(self):
        """The choice (the same on every rank): the caller's group's once
        it has made one, else the background's; None before; {} when
        nothing is tuned; alone, the first candidates (nothing to
        time)."""
        if not self.plan:
            return {}
        if self._alone:
            return {n: self.values[n] for n, _ in self.plan}
        for group in ('sync', 'async'):
            search = self._searches.get(group)
            if search is not None and search.result is not None:
                return search.result
        return None

    @property
    def done(self):
        return self.result is not None

    @property
    def steps(self):
        """Averagings timed so far, every group's."""
        return sum(s.steps for s in self._searches.values())

    @property
    def history(self):
        """(setting, candidate, slowest rank's seconds) of every candidate
        timed: the evidence of the choice (the group that made it)."""
        for group in ('sync', 'async'):
            search = self._searches.get(group)
            if search is not None and search.result is not None:
                return list(search.history)
        return []

    def current(self):
        """The values the calling thread's averaging runs with (outside
        an averaging: the caller's group's)."""
        search = getattr(self._local, 'search', None) or \
            self._searches.get('sync')
        return self.values if search is None else search.values

    def begin(self, named, group):
        """Before the averaging of ``named`` (name, array) pairs on
        ``group``: sets what ``current()`` gives on this thread, and
        returns the averaging's ticket for ``end`` (None: nothing to
        tune, no need to call it)."""
        if not self.plan or self._alone:
            return None
        search = self._searches.get(group)
        if search is None:
            search = self._searches[group] = _Search(self.plan, self.values)
        self._local.search = search
        if search.result is not None:
            return None
        key = tuple((n, a.shape, a.dtype.str) for n, a in named)
        if search.key in (None, key):
            name, candidates = self.plan[search.phase]
            search.values[name] = candidates[search.candidate]
        return key

    def end(self, ticket, seconds, quickest, applies=lambda name: True):
        """After an averaging that ``begin`` gave ``ticket`` for, and that
        took ``seconds`` here, ended without an error on every rank (so
        each rank's state moves alike; the layout check raised on all of
        them otherwise).  ``quickest(times)`` is ``agreement.quickest``
        over the group's communicator, called once a setting's candidates
        are done, at the same averaging on every rank; ``applies(name)``
        says whether the averaging used that setting at all (the ring's
        segment where MPI's Allreduce sums), the same on every rank."""
        search = self._local.search
        if search.result is not None:
            return
        if search.key not in (None, ticket):
            # Another gradient set than the one being timed: not timed.
            # A set that stops coming back gives way to the one averaged
            # now (the same averaging on every rank).
            search.misses += 1
            if search.misses >= REKEY_AFTER:
                search.key, search.misses = None, 0
                search.restart_setting()
            return
        search.key, search.misses = ticket, 0
        name, candidates = self.plan[search.phase]
        if not applies(name):
            search.values[name] = DEFAULTS[name]
            search.next_setting()
        else:
            seconds = self.measure(seconds, name,
                                   candidates[search.candidate])
            search.steps += 1
            if search.record(seconds):
                best, slowest = quickest(search.times)
                search.values[name] = candidates[best]
                search.history += [(name, c, t)
                                   for c, t in zip(candidates, slowest)]
                search.next_setting()
        if search.phase == len(self.plan):
            search.result = {n: search.values[n] for n, _ in self.plan}
            if self._rank == 0:
                log.say(_logger, logging.INFO,
                        'mnopt: tuned in %d averagings: %s', search.steps,
                        ', '.join('%s=%r' % kv for kv in
                                  sorted(search.result.items())))


class _Search(object):
    """One group's coordinate search: where it is, and its times.  A
    setting's candidates are timed in turn, then all again (``REPEATS``
    rounds), so that a burst of load on the machine slows one averaging
    of several candidates rather than both of one."""

    def __init__(self, plan, values):
        self.plan = plan
        self.values = dict(values)
        self.phase = self.sample = 0
        self.times = []
        self.key = None         # the gradient set being timed
        self.misses = 0         # averagings of other sets since it came
        self.steps = 0
        self.history = []
        self.result = None

    @property
    def candidate(self):
        """The index of the candidate the next averaging times."""
        return self.sample % len(self.plan[self.phase][1])

    def record(self, seconds):
        """Count one averaging of the candidate in force; True once every
        candidate of the setting has its ``REPEATS`` (its time: the least
        of them)."""
        n = len(self.plan[self.phase][1])
        if self.sample < n:
            self.times.append(seconds)
        else:
            self.times[self.candidate] = min(self.times[self.candidate],
                                             seconds)
        self.sample += 1
        return self.sample == REPEATS * n

    def restart_setting(self):
        self.sample = 0
        self.times = []

    def next_setting(self):
        self.restart_setting()
        self.phase += 1
