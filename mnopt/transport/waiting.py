"""Waiting for MPI requests without holding Python's GIL or a core.

MPI's blocking waits spin (MPICH and Open MPI poll their progress
engines), and a wait that polls from Python takes the GIL for every poll.
mnopt's averaging thread waits beside the training loop, whose backward
is Python (Chainer): either cost is taken from the compute.  ``wait_some``
polls in C (mnopt/_mpiwait.c) with the GIL released, napping between
polls, and comes back to Python only when a request has completed (or
after ``max_wait``, so the caller can look at the clock: stall detection
stays in Python).

The C loop calls the MPI library's own MPI_Testsome, found in the library
mpi4py loaded.  Where that cannot be found (another OS, an MPI linked
statically, no C compiler when mnopt was built) or ``MNOPT_WAIT=python``
asks for it, the same waits poll from Python (MPI_Test of each request)
with naps, the GIL released only while they nap.

Each thread's time inside the waits is tallied (``tally``): a benchmark
reads how much of an averaging thread's time went to waiting with the
GIL released, and the rest is time it ran Python (an upper bound on the
time it held the GIL).
"""

import ctypes
import os
import threading
import time

from mpi4py import MPI

from mnopt import _env

try:
    from mnopt import _mpiwait
except ImportError:  # built without a C compiler
    _mpiwait = None

WAITS = ('c', 'python')
#: Longest nap between two polls of ``wait_all`` and ``next_completed``
#: (seconds).  Progress happens only inside MPI calls (a TCP netmod reads
#: its sockets there), so the naps bound how fast a transfer goes when no
#: poll finds work; measured on 4 simulated nodes at 1 Gbit/s
#: (docs/results/netsim/waits.md), colocated reduction servers averaged
#: 1.06x flat's time with 200 us and up to 1.16x with 1 ms.
MAX_NAP = 200e-6

#: Per thread: what its waits cost (``tally``).
_local = threading.local()
#: Every thread's Tally, by native thread id (a benchmark reads them).
_tallies = {}
_tallies_lock = threading.Lock()
_testsome = None   # MPI_Testsome's address, 0 where none; None: not looked


class Tally(object):
    """What one thread's waits cost so far: ``waits`` calls, ``wall_s``
    inside them, ``cpu_s`` of that the thread spent on a core (the C
    loop's polls; for Python waits, 0: not measured), ``gil_s`` spent
    after the C loop's waits getting the GIL back, ``name`` the thread's."""

    def __init__(self, name):
        self.name = name
        self.waits = 0
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self.gil_s = 0.0

    def copy(self):
        other = Tally(self.name)
        other.__dict__.update(self.__dict__)
        return other


def tally():
    """The calling thread's Tally."""
    mine = getattr(_local, 'tally', None)
    if mine is None:
        mine = _local.tally = Tally(threading.current_thread().name)
        with _tallies_lock:
            _tallies[threading.get_native_id()] = mine
    return mine


def tallies():
    """{native thread id: a copy of its Tally} for every thread that has
    waited."""
    with _tallies_lock:
        return {k: t.copy() for k, t in _tallies.items()}


def kind():
    """'c' where waits run in mnopt's C loop, 'python' where they poll from
    Python (MNOPT_WAIT=python, or no C loop here)."""
    wanted = _env.choice('MNOPT_WAIT', 'c', WAITS)
    return 'c' if wanted == 'c' and _mpi_testsome() else 'python'


def _mpi_testsome():
    """MPI_Testsome's address in the MPI library mpi4py uses, or 0."""
    global _testsome
    if _testsome is None:
        _testsome = _find('MPI_Testsome') if _mpiwait is not None else 0
    return _testsome


def _find(symbol):
    # The library is already loaded (by mpi4py's extension, privately):
    # find it among this process's mappings and look the symbol up there,
    # without loading anything new.
    mode = getattr(os, 'RTLD_NOLOAD', 0) | getattr(os, 'RTLD_LOCAL', 0)
    candidates = []
    try:
        with open('/proc/self/maps') as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                name = os.path.basename(path)
                if name.startswith('libmpi') and '.so' in name \
                        and path not in candidates:
                    candidates.append(path)
    except OSError:
        return 0
    for path in candidates:
        try:
            lib = ctypes.CDLL(path, mode=mode)
            return ctypes.cast(getattr(lib, symbol),
                               ctypes.c_void_p).value or 0
        except (OSError, AttributeError):
            continue
    return 0


def _addresses(objects):
    return (ctypes.c_size_t * len(objects))(
        *[MPI._addressof(o) for o in objects])


def wait_some(requests, statuses=None, first_nap=10e-6, max_nap=1e-3,
              max_wait=0.05, by_yield=False):
    """Wait until at least one of ``requests`` (active mpi4py Requests)
    has completed, or ``max_wait`` seconds have passed; return the indices
    that completed (an empty list after ``max_wait``).  A completed
    request becomes MPI.REQUEST_NULL, its status in ``statuses[i]``
    (MPI.Status objects; None: not kept).

    Naps between polls start at ``first_nap`` seconds and double up to
    ``max_nap``.  ``by_yield``: in the Python fallback only, yield the
    core between polls instead of napping (ring.yield_while_waiting)."""
    if statuses is None:
        statuses = _scratch_statuses(len(requests))
    mine = tally()
    testsome = _mpi_testsome() if kind() == 'c' else 0
    if testsome:
        error, done, waited, cpu, end = _mpiwait.wait_some(
            testsome, MPI._sizeof(MPI.Request), MPI._sizeof(MPI.Status),
            MPI.UNDEFINED, _addresses(requests), _addresses(statuses),
            int(first_nap * 1e9), int(max_nap * 1e9), int(max_wait * 1e9))
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


def wait_all(requests, first_nap=20e-6, max_nap=MAX_NAP):
    """Like ``MPI.Request.Waitall``, the GIL and the core left free."""
    active = [r for r in requests if r != MPI.REQUEST_NULL]
    while active:
        wait_some(active, first_nap=first_nap, max_nap=max_nap)
        active = [r for r in active if r != MPI.REQUEST_NULL]


def next_completed(requests, max_nap=MAX_NAP):
    """Indices of the requests that completed (at least one), waiting as
    ``wait_all`` does; None once none is active.  Completed requests turn
    into MPI.REQUEST_NULL in place."""
    active = [i for i, r in enumerate(requests) if r != MPI.REQUEST_NULL]
    while active:
        done = wait_some([requests[i] for i in active], first_nap=20e-6,
                         max_nap=max_nap)
        if done:
            return [active[k] for k in done]
    return None
