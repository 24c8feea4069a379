"""Waiting for MPI requests without holding Python's GIL or a core.

MPI's blocking waits spin (MPICH and Open MPI poll their progress
engines), and a wait that polls from Python takes the GIL for every poll.
mnopt's averaging thread waits beside the training loop, whose backward
is Python (Chainer): either cost is taken from the compute.  ``wait_some``
polls in C (mnopt/transport/_mpiwait.c) with the GIL released, napping between
polls, and comes back to Python only when a request has completed (or
after ``max_wait``, so the caller can look at the clock: stall detection
stays in Python).

The C loop calls the MPI library's own MPI_Testsome, found in the library
mpi4py loaded.  Where that cannot be found (another OS, an MPI linked
statically, no C compiler when mnopt was built) or ``MNOPT_WAIT=python``
asks for it, the same waits poll from Python (MPI_Test of each request)
with naps, the GIL released only while they nap.

Each thread's time inside the waits is tallied
(mnopt/transport/wait_tallies.py): a benchmark reads how much of an
averaging thread's time went to waiting with the GIL released.
"""

import collections
import ctypes
import os
import threading
import time

from mpi4py import MPI

from mnopt.common import _env
from mnopt.transport import wait_tallies

try:
    from mnopt.transport import _mpiwait
except ImportError:  # built without a C compiler
    _mpiwait = None

WAITS = ('c', 'python')
#: How ``wait_all`` and ``next_completed`` poll: naps up to ``max_nap``
#: seconds, and a poll that took ``busy_poll`` seconds (and twice the
#: wait's fastest: it moved data) brings them back to the shortest (None:
#: never).  MPI over TCP moves bytes only inside its progress calls, so
#: the naps bound how fast a transfer goes when no thread polls.
Pace = collections.namedtuple('Pace', 'max_nap busy_poll')
#: Where threads of one process share the work (a colocated reduction
#: server's two threads and its worker's exchange; the ring's first ring
#: over a communicator, the others at ring_pace.py's pace): measured on
#: 4 simulated nodes at 1 Gbit/s (docs/results/netsim/waits.md),
#: colocated servers averaged 1.00-1.14x flat's time this way, 2.7x with
#: naps up to 1 ms and no busy rule.  An empty poll took 1.2-1.7 us there.
PROMPT = Pace(200e-6, 3e-6)
#: Where processes that wait outnumber the cores (a job with server
#: processes: 8 processes on 2 cores in that measurement): polls cost the
#: others their CPU, so naps up to 1 ms, as before the C waits.
PATIENT = Pace(1e-3, None)

#: Per thread: its scratch statuses.
_local = threading.local()
_testsome = None   # MPI_Testsome's address, 0 where none; None: not looked


def kind():
    """'c' where waits run in mnopt's C loop, 'python' where they poll from
    Python (MNOPT_WAIT=python, or no C loop here)."""
    wanted = _env.choice('MNOPT_WAIT', 'c', WAITS)
    return 'c' if wanted == 'c' and _mpi_testsome() else 'python'


def _mpi_testsome():
    """MPI_Testsome's address in the MPI library mpi4py uses, or 0."""
    global _testsome
    if _testsome is None:
        _testsome = _mpi_symbol_address('MPI_Testsome') \
            if _mpiwait is not None else 0
    return _testsome


def _mpi_symbol_address(symbol):
    """``symbol``'s address as mpi4py's own extension sees it: looked up
    through that extension (already loaded; nothing new is loaded), so it
    is the MPI library mpi4py links to even where another one is loaded
    in the process too; 0 where there is none."""
    mode = getattr(os, 'RTLD_NOLOAD', 0) | getattr(os, 'RTLD_LOCAL', 0)
    try:
        lib = ctypes.CDLL(MPI.__file__, mode=mode)
        return ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0


def _addresses(objects):
    return (ctypes.c_size_t * len(objects))(
        *[MPI._addressof(o) for o in objects])


def wait_some(requests, statuses=None, first_nap=10e-6, max_nap=1e-3,
              max_wait=0.05, by_yield=False, busy_poll=PROMPT.busy_poll):
    """Wait until at least one of ``requests`` (active mpi4py Requests:
    not MPI.REQUEST_NULL, not persistent ones) has completed, or ``max_wait`` seconds have passed; return the indices
    that completed (an empty list after ``max_wait``).  A completed
    request becomes MPI.REQUEST_NULL, its status in ``statuses[i]``
    (MPI.Status objects; None: not kept).

    Naps between polls start at ``first_nap`` seconds and double up to
    ``max_nap``; in the C loop a poll that took ``busy_poll`` seconds (and
    twice the wait's fastest poll: it moved data) brings them back to
    ``first_nap`` (None: never).  ``by_yield``: in the Python fallback only, yield the
    core between polls instead of napping (ring.yield_while_waiting)."""
    if statuses is None:
        statuses = _scratch_statuses(len(requests))
    mine = wait_tallies.mine()
    testsome = _mpi_testsome() if kind() == 'c' else 0
    if testsome:
        error, done, waited, cpu, end = _mpiwait.wait_some(
            testsome, MPI._sizeof(MPI.Request), MPI._sizeof(MPI.Status),
            MPI.UNDEFINED, _addresses(requests), _addresses(statuses),
            int(first_nap * 1e9), int(max_nap * 1e9), int(max_wait * 1e9),
            int((busy_poll or 0) * 1e9))
        mine.gil_s += (time.monotonic_ns() - end) * 1e-9
        mine.waits += 1
        mine.wall_s += waited * 1e-9
        mine.cpu_s += cpu * 1e-9
        if error:
            raise _error(error, [statuses[i] for i in done])
        return done
    return _python_wait_some(requests, statuses, first_nap, max_nap,
                             max_wait, by_yield, mine)


def _error(code, statuses):
    """The MPI.Exception for MPI_Testsome's error ``code``: for
    MPI_ERR_IN_STATUS, the first error of the completed requests'
    ``statuses`` (a truncation, say), as MPI_Test would have raised."""
    error = MPI.Exception(code)
    if error.Get_error_class() == MPI.ERR_IN_STATUS:
        for status in statuses:
            if status.Get_error() != MPI.SUCCESS:
                return MPI.Exception(status.Get_error())
    return error


def _python_wait_some(requests, statuses, first_nap, max_nap, max_wait,
                      by_yield, mine):
    start = time.perf_counter()
    nap = first_nap
    try:
        while True:
            done = [i for i, (r, s) in enumerate(zip(requests, statuses))
                    if r.Test(s)]
            if done or time.perf_counter() - start >= max_wait:
                return done
            if by_yield:
                os.sched_yield()
            else:
                time.sleep(nap)
                nap = min(2 * nap, max_nap)
    finally:
        mine.waits += 1
        mine.wall_s += time.perf_counter() - start


def _scratch_statuses(n):
    have = getattr(_local, 'statuses', [])
    if len(have) < n:
        have = _local.statuses = have + [MPI.Status()
                                         for _ in range(n - len(have))]
    return have[:n]


def completed(request, status=None):
    """Whether ``request`` has completed: it was completed by a wait
    (MPI.REQUEST_NULL: its status was filled then) or completes now."""
    return request == MPI.REQUEST_NULL or request.Test(status)


#: Requests whose wait an exception ended (a signal handler's, as
#: Ctrl-C's KeyboardInterrupt, raised between two polls): MPI may still
#: write into their buffers, which the requests hold, so they are kept
#: for the life of the process.  Their communicator is out of step after
#: that (a collective cannot be cancelled).
ABANDONED = []


def wait_all(requests, pace=PROMPT, statuses=None):
    """Like ``MPI.Request.Waitall``, the GIL and the core left free;
    ``pace``: PROMPT or PATIENT (above); ``statuses``: MPI.Status objects,
    one per request, filled as each completes (None: not kept).  An
    exception raised inside the wait leaves the unfinished requests in
    ABANDONED."""
    active = [i for i, r in enumerate(requests) if r != MPI.REQUEST_NULL]
    try:
        while active:
            wait_some([requests[i] for i in active],
                      None if statuses is None
                      else [statuses[i] for i in active],
                      first_nap=20e-6, max_nap=pace.max_nap,
                      busy_poll=pace.busy_poll)
            active = [i for i in active if requests[i] != MPI.REQUEST_NULL]
    except BaseException:
        ABANDONED.extend(requests[i] for i in active
                         if requests[i] != MPI.REQUEST_NULL)
        raise


def next_completed(requests, pace=PROMPT):
    """Indices of the requests that completed (at least one), waiting as
    ``wait_all`` does; None once none is active.  Completed requests turn
    into MPI.REQUEST_NULL in place."""
    active = [i for i, r in enumerate(requests) if r != MPI.REQUEST_NULL]
    while active:
        done = wait_some([requests[i] for i in active], first_nap=20e-6,
                         max_nap=pace.max_nap, busy_poll=pace.busy_poll)
        if done:
            return [active[k] for k in done]
    return None
