"""Stall detection's "last word" protocol: what a rank says on a Monitor as
it goes (its process exits, or it frees the monitor), how the others hear
it, and which ranks can therefore never arrive at an operation.

A rank's last message on a monitor says that it is gone and how far it
got (how many of each operation it entered); the others' watchdogs abort
the job when they wait in an operation it never entered.  A rank sends
nothing on a monitor after its last word (questions are then received and
dropped), and keeps receiving on it until every other rank's last word has
come; MPI keeps one sender's messages in order (all are received with any
tag), so then nothing sent to it is left unreceived.  A freed monitor's
communicator is freed after that; an exiting process waits for it (every
rank exits, and MPI_Finalize waits for every rank anyway).  The watchdog
(mnopt/stall/watchdog.py) runs the protocol."""

import logging
import time

from mpi4py import MPI

from mnopt.common import log
from mnopt.stall import report as stall_report
from mnopt.stall.settings import DEFAULT_TIMEOUT_S

logger = log.get(stall_report.LOGGER_NAME)

#: A rank's last word on a monitor, sent as its process exits or as it
#: frees the monitor (its communicator was finalized or collected): why
#: ('exited', 'finalized') and how many of each operation it entered.
#: Nothing is ever sent on a monitor after it.
TAG_EXIT = 0x57A3
#: How long an exiting rank lets its last words leave (seconds).
EXIT_SEND_S = 2.0


def say(m, why):
    """Send every other rank of monitor ``m`` this rank's counts (and
    why); returns the send requests, for the caller to complete."""
    counts = m.counts()
    m.said_last_word = True
    return [m.comm.isend((why, counts), dest=r, tag=TAG_EXIT)
            for r in range(m.size) if r != m.rank]


def hear(m, source, content):
    """Rank ``source``'s last word ``content`` came on ``m``."""
    m.why_gone[source], m.exited[source] = content


def hear_everyone(monitors, receive):
    """Receive (``receive(monitor)``) on ``monitors`` until every other
    rank's last word has come; after a monitor's timeout (or the default
    one) say who is missing and go on."""
    start = time.monotonic()
    waiting = list(monitors)
    while waiting:
        for m in waiting:
            receive(m)
        waiting = [m for m in waiting if not m.heard_everyone()]
        late = [m for m in waiting
                if time.monotonic() - start > (m.timeout or
                                               DEFAULT_TIMEOUT_S)]
        for m in late:
            # Not a failure: the others may still be working (a long
            # last evaluation); this rank just stops waiting for them.
            log.say(
                logger, logging.WARNING,
                'mnopt: %s exits after waiting %.0f s (MNOPT_TIMEOUT) '
                'for the last word of %s on %s, which may still be '
                'working', m.name_of(m.rank), time.monotonic() - start,
                ', '.join(m.name_of(r) for r in range(m.size)
                          if r != m.rank and r not in m.exited),
                m.label)
            waiting.remove(m)
        time.sleep(0.002)


def let_leave(pending):
    """Give the send requests ``pending`` (last words among them) up to
    ``EXIT_SEND_S`` to complete, as the process exits."""
    deadline = time.monotonic() + EXIT_SEND_S
    while not MPI.Request.Testall(pending) and \
            time.monotonic() < deadline:
        time.sleep(0.001)


def never_arriving(m, op):
    """The ranks whose process exited before entering ``op`` (which needs
    every rank: a collective, and not on a serving rank)."""
    if not op.collective or m.rank in m.helpers:
        return []
    return sorted(r for r, counts in list(m.exited.items())
                  if r not in m.helpers and counts.get(op.name, 0) < op.count)
