"""How long the ring's waits nap: from the rate its last ring moved data.

MPI over TCP moves bytes only inside progress calls, so a ring must poll
often enough that its links never idle; every poll costs the core that
an overlapped backward needs (an empty one 1-2 us, one that moves data
far more: the library's copies and the kernel's).  Polling again at once
after each poll that moved data (waiting.PROMPT's busy rule) keeps any
link busy, but at 1 Gbit/s it polls every few tens of microseconds, each
poll moving a few kilobytes: 1.8-2.3 ms of CPU per MB averaged, where
naps up to 1 ms leave the links as busy for 1.1-1.4 ms per MB
(docs/overlap.md, "Where the averaging thread's CPU goes").

So a ring naps up to half the time its posted window of messages takes
at the rate this thread's previous ring on the same communicator
measured: the window, not the naps, keeps the link busy, and on a fast
link (shared memory, InfiniBand) the naps stay short.  Bounded by
``SHORTEST`` and ``LONGEST``; before a rate is known, PROMPT's pace.  Per
communicator, since one thread may run rings over shared memory and over
the network (hierarchical); per thread, since the threads of one process
may share a communicator's links differently.
"""

import threading

from mpi4py import MPI

from mnopt.transport import waiting

#: Bounds of the longest nap (seconds).  LONGEST: PATIENT's naps, which
#: measured no slower than PROMPT's at 500 Mbit/s and 1 Gbit/s.
SHORTEST = 20e-6
LONGEST = waiting.PATIENT.max_nap
#: A ring that received fewer bytes says little about the rate.
MIN_BYTES = 64 << 10

_local = threading.local()


def pace(comm, window_bytes):
    """(max_nap, busy_poll) for a ring of this thread over ``comm`` whose
    posted messages hold ``window_bytes``."""
    per_byte = _rates().get(MPI._handleof(comm))
    if per_byte is None:
        return waiting.PROMPT
    return waiting.Pace(
        min(LONGEST, max(SHORTEST, 0.5 * window_bytes * per_byte)), None)


def measured(comm, nbytes, seconds):
    """A ring of this thread over ``comm`` received ``nbytes`` in
    ``seconds``."""
    if nbytes >= MIN_BYTES and seconds > 0:
        _rates()[MPI._handleof(comm)] = seconds / nbytes


def forget():
    """Back to PROMPT's pace on every communicator (tests)."""
    _rates().clear()


def _rates():
    """This thread's {communicator handle: seconds per byte}."""
    rates = getattr(_local, 'rates', None)
    if rates is None:
        rates = _local.rates = {}
    return rates

