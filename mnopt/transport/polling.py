"""Waiting for MPI requests by polling with short naps, not MPICH's spin.

For waits watched by stall detection (a report, then the abort, when a
rank never arrives) see ``stall_wait.wait_or_abort`` (mnopt/stall_wait.py).
"""

import time

from mpi4py import MPI


#: Longest nap between two polls in ``wait_all``/``wait_some`` (seconds).
MAX_NAP_SECONDS = 1e-3


def _naps():
    """Yield before each poll; nap in between, from 20 us doubling up to
    MAX_NAP_SECONDS: short waits stay short, long ones cost almost no CPU.

    MPICH busy-polls inside blocking calls.  A reduction server job runs
    workers and servers side by side, mostly waiting on the network;
    spinning processes then steal the cores that the others (and the
    kernel's TCP stack) need."""
    nap = 20e-6
    while True:
        yield
        time.sleep(nap)
        nap = min(2 * nap, MAX_NAP_SECONDS)


def wait_all(requests):
    """Like ``MPI.Request.Waitall``, napping between polls (``_naps``)."""
    for _ in _naps():
        if MPI.Request.Testall(requests):
            return


def wait_some(requests):
    """Indices of the requests that completed (at least one), napping
    between polls; None once none is active.  Completed requests turn into
    MPI.REQUEST_NULL in the list."""
    for _ in _naps():
        done = MPI.Request.Testsome(requests)
        if done is None or done:
            return done

