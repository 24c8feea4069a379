"""Waiting for MPI requests outside any stall-detection Monitor (the
exchanges that precede one), with its reports: one line after the warning
time, and the abort at the timeout."""

import logging
import time

from mpi4py import MPI

from mnopt import log
from mnopt import stall_report
from mnopt.stall_settings import settings_or_defaults

logger = log.get(stall_report.LOGGER_NAME)

#: Longest nap between two polls in ``wait_or_abort`` (seconds): what it
#: waits for (start-up exchanges) is rare and not latency-bound.
MAX_NAP_S = 0.01


def wait_or_abort(requests, what, stall_warning=None, timeout=None):
    """Wait until every mpi4py Request in ``requests`` has completed, with
    the same stall detection as a watched operation: after the warning
    time print one line (``mnopt: rank R has waited N s in <what>; ...``)
    and keep waiting; after the timeout print it again and abort the MPI
    job.  For waits outside any Monitor (the exchanges that precede one),
    so it cannot ask the other ranks what they do.

    Settings as ``settings_or_defaults()``: the exchange waited for is
    often how a bad setting gets reported on every rank."""
    warning, limit = settings_or_defaults(stall_warning, timeout)
    if warning is not None and limit is not None and warning >= limit:
        warning = None   # the timeout's report says it all
    who = 'rank %d' % MPI.COMM_WORLD.rank
    start, nap = time.monotonic(), 20e-6
    # Short waits stay short, long ones cost almost no CPU (MPICH spins in
    # its blocking calls, and server processes share cores with workers).
    while not MPI.Request.Testall(requests):
        waited = time.monotonic() - start
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
        time.sleep(nap)
        nap = min(2 * nap, MAX_NAP_S)
