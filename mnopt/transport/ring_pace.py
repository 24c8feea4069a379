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
link (InfiniBand, shared memory at some GB/s) the naps stay short.
Bounded by ``SHORTEST`` and ``LONGEST``; before a rate is known,
PROMPT's pace.  The rate is the median of the times between a ring's
messages arriving, so a peer that came late, or paused once, is not
taken for a slow link; and it slows by at most ``MOST_SLOWER`` from one
ring to the next, so that one odd ring cannot make the naps long for
good (a slower rate makes longer naps, which could make the next ring
slower).  Per communicator object, since one thread may
run rings over shared memory and over the network (hierarchical); per
thread, since the threads of one process may share a communicator's
links differently.  Measured: docs/results/ring_cpu/README.md
(benchmarks/ring_cpu.py) and docs/overlap.md.
"""

import threading
import weakref

from mnopt.transport import waiting

#: Bounds of the longest nap (seconds).  LONGEST: PATIENT's naps, which
#: measured no slower than PROMPT's at 500 Mbit/s and 1 Gbit/s.
SHORTEST = 20e-6
LONGEST = waiting.PATIENT.max_nap
#: A ring that received fewer bytes says little about the rate.
MIN_BYTES = 64 << 10
#: The most one ring may slow the rate by (a factor).
MOST_SLOWER = 2.0

_local = threading.local()


def seconds_per_byte(comm):
    """The rate this thread's last ring over ``comm`` measured (seconds a
    byte received), or None."""
    known = _rates().get(id(comm))
    # Keyed by the object: a freed communicator's handle (and a collected
    # object's id) may come back for another one.
    return known[1] if known and known[0]() is comm else None


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


def measured_arrivals(comm, arrived):
    """A ring of this thread over ``comm`` received its messages at
    ``arrived``: (time.perf_counter(), bytes) of each, in order.  The
    rate: the median over its messages of the time since the one before,
    per byte.  Where messages complete together (one poll finds several),
    it errs fast: shorter naps, more polls, never an idle link."""
    gaps = sorted((t - before) / nbytes for (before, _), (t, nbytes)
                  in zip(arrived, arrived[1:]) if nbytes)
    if gaps:
        total = sum(nbytes for _, nbytes in arrived[1:])
        measured(comm, total, gaps[len(gaps) // 2] * total)


def measured(comm, nbytes, seconds):
    """A ring of this thread over ``comm`` moved ``nbytes`` at a rate of
    ``nbytes`` in ``seconds`` (measured_arrivals' estimate)."""
    if nbytes < MIN_BYTES or seconds <= 0:
        return
    per_byte = seconds / nbytes
    before = seconds_per_byte(comm)
    if before is not None:
        per_byte = min(per_byte, MOST_SLOWER * before)
    rates = _rates()
    if len(rates) > 64:   # communicators gone
        for key in [k for k, (ref, _) in rates.items() if ref() is None]:
            del rates[key]
    rates[id(comm)] = (weakref.ref(comm), per_byte)


def forget():
    """Back to PROMPT's pace on every communicator (tests)."""
    _rates().clear()


def _rates():
    """This thread's {id of a communicator: (weak reference to it,
    seconds per byte)}."""
    rates = getattr(_local, 'rates', None)
    if rates is None:
        rates = _local.rates = {}
    return rates

