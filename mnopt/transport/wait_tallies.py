"""What each thread's network waits cost (mnopt/transport/waiting.py
adds to them): how many, the wall time inside, the CPU the C loop's polls
took, and the time spent getting the GIL back after; and the CPU of its
averagings' phases (mnopt/transport/cpu_phases.py fills ``phases``).
Benchmarks read them (benchmarks/overlap.py: the averaging thread's costs
per step)."""

import threading

#: Per thread: its Tally.
_local = threading.local()
#: Every thread's Tally, by native thread id.
_tallies = {}
_lock = threading.Lock()


class Tally(object):
    """What one thread's waits cost so far: ``waits`` calls, ``wall_s``
    inside them, ``cpu_s`` of that the thread spent on a core (the C
    loop's polls; for Python waits, 0: not measured), ``gil_s`` spent
    after the C loop's waits getting the GIL back, ``name`` the thread's;
    ``phases``: CPU seconds by phase (mnopt/transport/cpu_phases.py),
    ``open_phases`` the phases open now (innermost last)."""

    def __init__(self, name):
        self.name = name
        self.waits = 0
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self.gil_s = 0.0
        self.phases = {}
        self.open_phases = []

    def copy(self):
        """The figures so far (not the open phases)."""
        other = Tally(self.name)
        other.__dict__.update(self.__dict__)
        other.phases = dict(self.phases)
        other.open_phases = []
        return other


def mine():
    """The calling thread's Tally."""
    tally = getattr(_local, 'tally', None)
    if tally is None:
        tally = _local.tally = Tally(threading.current_thread().name)
        with _lock:
            _tallies[threading.get_native_id()] = tally
    return tally


def everyone():
    """{native thread id: a copy of its Tally} for every thread that has
    waited."""
    with _lock:
        return {k: t.copy() for k, t in _tallies.items()}
