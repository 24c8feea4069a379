"""The guard of ``compression='auto'``: compress a gradient set only where
the job's own averagings show that it pays.

A compressor that makes training slower is worse than none (Agarwal et
al., MLSys 2022, found compression ahead of a well-tuned synchronous
baseline in few setups).  So each gradient set (a bucket, with overlap)
is timed both ways in its first averagings once compression has started:
plain and compressed in turn, ``ROUNDS`` times each.  Its time each way
on one rank is the least of its rounds, its time overall that of its
slowest rank; after the last round the ranks exchange their times once
(``quickest``: agreement.quickest over the group), and every rank keeps
the same way for that set from then on: compressed only where it took
less than ``MARGIN`` of the plain time.  Two rounds of each cannot tell
ways a few percent apart (on a busy machine), and a tie goes to the
plain mean, which approximates nothing.  The averagings of a group run in the same order on
every rank, so each set's exchange comes at the same averaging
everywhere.
"""

import logging

from mpi4py import MPI

from mnopt.common import log

#: Each choice, at INFO on rank 0 ($MNOPT_LOG_LEVEL=INFO), on logger
#: mnopt.communicators.compression_guard: its name before averaging/
#: (docs/debugging.md).
_logger = log.get('mnopt.communicators.compression_guard')

#: The two ways a gradient set is averaged.
PLAIN, COMPRESSED = 'plain', 'compressed'
#: Averagings of each way per gradient set before the choice.
ROUNDS = 2
#: The share of the plain time a compressed averaging must stay under.
MARGIN = 0.95


class CompressionGuard(object):
    """The trials and choices of one communicator's gradient sets
    (``key``: (group label, names)).  ``choices``: {key: PLAIN or
    COMPRESSED}, the same on every rank (kept in snapshots)."""

    def __init__(self):
        self.choices = {}
        #: The sets being timed: {key: ([plain seconds], [compressed
        #: seconds])}, this rank's times.
        self.trials = {}

    def next(self, key):
        """The way the next averaging of ``key`` goes."""
        choice = self.choices.get(key)
        if choice is not None:
            return choice
        plain, compressed = self.trials.get(key, ((), ()))
        return PLAIN if len(plain) <= len(compressed) else COMPRESSED

    def record(self, key, way, seconds, quickest):
        """After an averaging of ``key`` that went ``way`` in ``seconds``
        here (and ended without an error on every rank)."""
        if key in self.choices:
            return
        plain, compressed = self.trials.setdefault(key, ([], []))
        (plain if way == PLAIN else compressed).append(seconds)
        if len(compressed) == ROUNDS and len(plain) == ROUNDS:
            best, slowest = quickest([min(plain), min(compressed) / MARGIN])
            self.choices[key] = (PLAIN, COMPRESSED)[best]
            del self.trials[key]
            if MPI.COMM_WORLD.rank == 0:
                log.say(_logger, logging.INFO,
                        "mnopt: compression='auto': %s is averaged %s: "
                        'plain %.2f ms, compressed %.2f ms (the slowest '
                        "rank's best of %d; compressed must take under "
                        '%d%% of plain)', _described(key),
                        self.choices[key], slowest[0] * 1e3,
                        slowest[1] * MARGIN * 1e3, ROUNDS,
                        round(MARGIN * 100))

    def forget_trials(self):
        """Drop the trials under way (a snapshot was loaded: they start
        again where no choice came with it)."""
        self.trials = {}


def _described(key):
    """A gradient set's key for the log: 'label (N arrays from first)'."""
    try:
        label, names = key
        return '%s (%d arrays from %s)' % (label, len(names), names[0])
    except (TypeError, ValueError, IndexError):
        return str(key)
