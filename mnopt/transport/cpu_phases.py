"""Where a thread's CPU goes while it averages, phase by phase: the layout
check, packing (with its cast), the wire (the allreduce; with
MNOPT_PROFILE_THREADS=1 the ring's divides and sums apart), unpacking,
and the bookkeeping around them.  For benchmarks (benchmarks/overlap.py:
the averaging thread's CPU per step, per phase).

Each phase is timed on the thread's own CPU clock (``time.thread_time``)
and counted in the thread's Tally (mnopt/transport/wait_tallies.py,
``phases``: seconds by name) without the phases nested inside it and
without the CPU of mnopt's network waits inside it (the C loop's polls,
the Tally's ``cpu_s``), which an outermost phase counts as 'wait'.  The
phases of a thread therefore add up to the CPU it spent inside them, no
more: 'bookkeeping' (an averaging as a whole, Averaging.timed) is what
the others leave of it.

An averaging's own phases cost two clock reads each, a few per bucket,
and are always timed.  The ring's divides and sums would cost two per
segment: they are timed only where MNOPT_PROFILE_THREADS=1 (read once
per collective); otherwise their CPU is the wire's."""

import time

from mnopt.common import _env
from mnopt.transport import wait_tallies

#: The phases, in an averaging's order: 'check' (the layout check,
#: mnopt/transport/layouts.py), 'pack' (and cast), 'wire' (the allreduce
#: less what follows), 'divide' and 'sum' (the ring's, per segment, with
#: MNOPT_PROFILE_THREADS=1), 'unpack', 'wait' (the network waits' CPU),
#: 'bookkeeping' (the rest of an averaging).
PHASES = ('check', 'pack', 'wire', 'divide', 'sum', 'unpack', 'wait',
          'bookkeeping')

_clock = time.thread_time


def detailed():
    """$MNOPT_PROFILE_THREADS: whether the ring's divides and sums are
    timed one by one (default: no, ``0``)."""
    return _env.flag('MNOPT_PROFILE_THREADS', False)


class phase(object):
    """``with phase(name):`` counts the calling thread's CPU inside as
    phase ``name`` (see above).  Phases nest; an exception passes
    through, the phase counted."""

    __slots__ = ('name', 'tally', 'start', 'waits', 'inner')

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.tally = tally = wait_tallies.mine()
        tally.open_phases.append(self)
        self.inner = 0.0
        self.waits = tally.cpu_s
        self.start = _clock()
        return self

    def __exit__(self, *exc_info):
        cpu = _clock() - self.start
        tally = self.tally
        waits = tally.cpu_s - self.waits
        cpu -= waits
        opened = tally.open_phases
        opened.pop()
        phases = tally.phases
        phases[self.name] = phases.get(self.name, 0.0) + cpu - self.inner
        if opened:
            opened[-1].inner += cpu
        else:
            phases['wait'] = phases.get('wait', 0.0) + waits
        return False


def timed(name, fn):
    """``fn`` with each call counted as phase ``name`` where
    MNOPT_PROFILE_THREADS=1, else ``fn`` itself (None stays None)."""
    if fn is None or not detailed():
        return fn

    def run(*args):
        with phase(name):
            return fn(*args)
    return run
