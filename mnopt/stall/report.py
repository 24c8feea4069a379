"""The stall report's text (who has not arrived at an operation, and what
each rank does instead), and the abort that follows a timeout's report."""

import time

from mpi4py import MPI

from mnopt.common import log

#: The stall reports' logger (mnopt/common/log.py), whichever module says them.
LOGGER_NAME = 'mnopt.stall'


def tail(timeout, timed_out):
    """How a report ends: the abort, or how long until it."""
    if timed_out:
        return '. Timeout (%.0f s, MNOPT_TIMEOUT): aborting the MPI job.' \
            % timeout
    return '. Still waiting%s.' % (
        '; the job is aborted after %.0f s (MNOPT_TIMEOUT)' % timeout
        if timeout else '')


def doing(m, r, ops):
    """What rank ``r`` of monitor ``m`` said it does (``ops``, its
    answer: Monitor.state(), or None where it did not answer)."""
    if ops is None:
        return 'no answer: stopped, hung outside Python, or gone'
    if ops:
        return 'in ' + ', '.join(
            '%s.%s #%d for %.1f s%s' % (m.label, name, count, t,
                                        ' ' + d if d else '')
            for name, count, t, d in ops)
    if r in m.helpers:
        return 'idle: no request in progress'
    return ('busy outside %s: computing, or stuck before its next call'
            % m.label)


def describe(m, op, waited, timed_out):
    """The report: who has not arrived at ``op`` and what they do."""
    missing, arrived, helpers = [], [m.rank], []
    for r in range(m.size):
        if r == m.rank:
            continue
        ops = op.answers.get(r)
        if ops is not None and r not in m.helpers and any(
                name == op.name and count == op.count
                for name, count, _, _ in ops):
            arrived.append(r)
            continue
        what = doing(m, r, ops)
        (helpers if r in m.helpers else missing).append(
            '%s (%s)' % (m.name_of(r), what))
    head = 'mnopt: %s has waited %.1f s in %s%s' % (
        m.name_of(m.rank), waited, op.label(),
        ' (%s)' % op.detail if op.detail else '')
    arrived = ', '.join(m.name_of(r) for r in sorted(arrived))
    if missing:
        body = '; not arrived: %s; arrived: %s' % ('; '.join(missing),
                                                  arrived)
    elif helpers:
        body = '; every rank has arrived (%s): it waits on the servers' \
            % arrived
    else:
        body = '; every rank has arrived (%s): a slow operation, not a ' \
            'missing rank' % arrived
    if helpers:
        body += '; servers: ' + '; '.join(helpers)
    return head + body + tail(m.timeout, timed_out)


def abort():
    """End the whole MPI job, once what was just reported is out."""
    # What was just logged must be out before the abort ends the process
    # (this runs on the watchdog thread: nothing else would flush it).
    log.flush(LOGGER_NAME)
    time.sleep(1.0)  # let the launcher forward the report
    MPI.COMM_WORLD.Abort(1)
