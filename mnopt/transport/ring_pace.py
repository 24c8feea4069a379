"""How long the ring's waits nap: from the rate its last ring moved data.

MPI over TCP moves bytes only inside progress calls, so a ring must poll
often enough that its links never idle; every poll costs the core that
an overlapped backward needs (an empty one 1-2 us, one that moves data
far more: the library's copies and the kernel's).  Polling again at once
after each poll that moved data (waiting.PROMPT's busy rule) keeps any
link busy, but at 1 Gbit/s it polls every few tens of microseconds, each
poll moving a few kilobytes.

So a ring's wait naps up to half the time its messages in flight (at
most ``WINDOW`` receives and their sends) take at the rate the thread's
previous ring over the same communicator measured: the posted messages,
not the naps, keep the link busy; as a ring drains, its naps shorten, so
its end (and the next bucket's start) is seen promptly; and on a fast
link (shared memory, InfiniBand) the naps stay short.  Bounded by
``SHORTEST`` and ``LONGEST``; before a rate is known, PROMPT's pace.  Per
communicator, since one thread may run rings over shared memory and over
the network (hierarchical); per thread, since the threads of one process
may share a communicator's links differently.  docs/overlap.md ("Waiting
for the network") has the measurements (benchmarks/ring_cpu.py).
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


def seconds_per_byte(comm):
    """The rate this thread's last ring over ``comm`` measured (seconds a
    byte received), or None."""
    return _rates().get(MPI._handleof(comm))


def pace(per_byte, in_flight_bytes):
    """(max_nap, busy_poll) while ``in_flight_bytes`` are on their way at
    ``per_byte`` seconds a byte (None: not known)."""
    if per_byte is None:
        return waiting.PROMPT
    return waiting.Pace(
        min(LONGEST, max(SHORTEST, 0.5 * in_flight_bytes * per_byte)), None)


def wait_some(per_byte, receiving, sending, by_yield=False):
    """Wait until one of a ring's messages in flight completes:
    ``receiving``, ``sending``: (request, status, bytes) of each (the
    status filled when it completes); the bytes of the larger direction
    set the naps (the two move at once)."""
    both = receiving + sending
    if not both:
        return
    nap, busy = pace(per_byte, max(sum(b for _, _, b in receiving),
                                   sum(b for _, _, b in sending)))
    waiting.wait_some([r for r, _, _ in both], [s for _, s, _ in both],
                      max_nap=nap, busy_poll=busy, by_yield=by_yield)


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

