"""Waiting for MPI requests outside any stall-detection Monitor (the
exchanges that precede one), polled as ``waiting`` polls, with its
reports: one line after the warning time, and the abort at the timeout."""

import logging
import time

from mpi4py import MPI

from mnopt.common import log
from mnopt.stall import report as stall_report
from mnopt.stall.settings import settings_or_defaults
from mnopt.transport import waiting

logger = log.get(stall_report.LOGGER_NAME)

#: How often ``wait_or_abort`` looks at the clock for its reports
#: (seconds): between two looks it waits in ``waiting.wait_some``.
CHECK_EVERY_S = 0.05


def wait_or_abort(requests, what, stall_warning=None, timeout=None,
                  pace=waiting.PROMPT):
    """Wait until every mpi4py Request in ``requests`` has completed, with
    the same stall detection as a watched operation: after the warning
    time print one line (``mnopt: rank R has waited N s in <what>; ...``)
    and keep waiting; after the timeout print it again and abort the MPI
    job.  For waits outside any Monitor (the exchanges that precede one),
    so it cannot ask the other ranks what they do.

    Settings as ``settings_or_defaults()``: the exchange waited for is
    often how a bad setting gets reported on every rank.  ``pace``: how
    the wait polls (``waiting.PROMPT`` or ``PATIENT``)."""
    warning, limit = settings_or_defaults(stall_warning, timeout)
    if warning is not None and limit is not None and warning >= limit:
        warning = None   # the timeout's report says it all
    who = 'rank %d' % MPI.COMM_WORLD.rank
    start = time.monotonic()
    # The agreements every step makes wait here: the wait polls in C with
    # the GIL released and naps of at most ``pace.max_nap`` (MPICH's own
    # blocking calls spin, which costs a rank sharing a core with another
    # its compute; longer naps made each agreement late by up to a nap).
    active = [r for r in requests if r != MPI.REQUEST_NULL]
    nap = 20e-6
    while active:
        try:
            waiting.wait_some(active, first_nap=nap, max_nap=pace.max_nap,
                              max_wait=CHECK_EVERY_S,
                              busy_poll=pace.busy_poll)
        except BaseException:
            waiting.ABANDONED.extend(active)
            raise
        active = [r for r in active if r != MPI.REQUEST_NULL]
        if not active:
            return
        waited = time.monotonic() - start
        # A wait this long is not latency-bound: the naps go on from where
        # they were, and after a second are PATIENT's.
        nap = pace.max_nap
        if waited >= 1.0:
            pace = waiting.PATIENT
        timed_out = limit is not None and waited >= limit
        if timed_out or (warning is not None and waited >= warning):
            log.say(
                logger, logging.ERROR if timed_out else logging.WARNING,
                'mnopt: %s has waited %.1f s in %s; not every rank has '
                'arrived (one may have failed, exited or not reached it)%s',
                who, waited, what, stall_report.tail(limit, timed_out),
                last_words=timed_out)
            if timed_out:
                stall_report.abort()
            warning = None
