"""Stall detection: no mnopt collective waits forever in silence.

Every operation a communicator runs across ranks (gradient averaging, sync
or in the background, the reduction server's push/pull, bcast_data, the
array and object collectives) is *watched*: it registers itself with its
communicator's Monitor for as long as it runs, under its name and call
count (``flat#0.mean_grads #17``).  That costs a dict insert and delete per
call; the operation itself is untouched (its MPI calls, or its
non-blocking ones waited for in mnopt/transport/waiting.py).

One watchdog thread per process wakes every ``TICK_S``.  When one of its
operations has waited longer than the warning time, it asks every other
rank of the communicator, over a private duplicate of it, what that rank
is doing.  A rank answers from its own watchdog thread, so it answers
while its main thread is blocked in MPI or busy computing; a rank that is
stopped (SIGSTOP, a frozen node) or gone does not answer.  After the
answers (or ``ANSWER_WAIT_S``), the waiting rank prints once which ranks
have not arrived at the operation and what each is doing instead, and
keeps waiting.  After the timeout it prints the same and aborts the whole
MPI job, so the scheduler frees the nodes.  Nothing is sent unless an
operation is already late.

Settings (seconds; 0 disables): ``create_communicator(stall_warning=...,
timeout=...)``, else the environment variables ``MNOPT_STALL_WARNING`` and
``MNOPT_TIMEOUT``, else 60 and 600.

The watchdog needs MPI_THREAD_MULTIPLE (mpi4py asks for it by default);
with a lower thread level stall detection is off, with a warning.

The reports are records of logger ``mnopt.stall`` (mnopt/common/log.py):
WARNING while the job goes on, ERROR when it is aborted; by default on
stderr.

This module is the Monitor and ``watched``; beside it: the settings
(mnopt/stall/settings.py), the watchdog thread (mnopt/stall/watchdog.py),
the last-word protocol at exit (mnopt/stall/last_word.py), the report's
text and the abort (mnopt/stall/report.py), and waiting outside a Monitor
(mnopt/transport/stall_wait.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from mpi4py import MPI

from mnopt.stall.settings import settings
from mnopt.stall.watchdog import the_watchdog


class _Operation(object):
    """One watched call in progress."""

    __slots__ = ('monitor', 'name', 'count', 'since', 'detail', 'asked',
                 'answers', 'warned', 'collective')

    def __init__(self, monitor, name, count, collective=True):
        self.monitor, self.name, self.count = monitor, name, count
        #: Every rank enters it (point-to-point operations do not).
        self.collective = collective
        self.since = time.monotonic()
        self.detail = ''   # what it waits for, where the code knows
        self.asked = None  # (question id, when) once late
        self.answers = {}
        self.warned = False

    def __enter__(self):
        self.monitor._active[id(self)] = self
        return self

    def __exit__(self, *exc):
        self.monitor._active.pop(id(self), None)

    def label(self):
        return '%s.%s #%d' % (self.monitor.label, self.name, self.count)


class Monitor(object):
    """The watched operations of one communicator, and a private duplicate
    of its MPI communicator for the watchdogs' questions and answers.

    ``names`` gives a rank's name in reports (e.g. 'worker 2', 'server 5');
    by default 'rank R'.  ``helpers`` are ranks that serve the others (the
    reduction servers): reports list what they do, but they never "arrive"
    at the others' operations.  Creating one is collective over ``comm``."""

    def __init__(self, comm, label, stall_warning=None, timeout=None,
                 names=None, helpers=()):
        self.warning, self.timeout = settings(stall_warning, timeout)
        self.label = label
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.rank, self.comm.size
        self._names = names
        self.helpers = frozenset(helpers)
        self._counts = {}
        self._counts_lock = threading.Lock()  # threads share a monitor
        self._active = {}
        #: Ranks that said their last word (exited, or freed this
        #: monitor): rank -> {operation: count it entered}.  An operation
        #: they never entered can never finish.
        self.exited = {}
        self.why_gone = {}   # rank -> 'exited' or 'finalized'
        self.said_last_word = False
        #: Whether stall reports are on (else the watchdog only runs the
        #: last-word protocol, which every rank must run alike whatever
        #: its settings).
        self.reports = (self.warning or self.timeout) is not None
        self.enabled = self.size > 1 and the_watchdog().start(self.reports)
        if self.enabled:
            the_watchdog().add(self)

    def heard_everyone(self):
        """Whether every other rank has said its last word."""
        return len(self.exited) >= self.size - 1

    def name_of(self, rank):
        return self._names(rank) if self._names else 'rank %d' % rank

    def op(self, name, collective=True):
        """Context manager around one watched call of operation ``name``
        (counted per name, so ranks agree on '#k': operations that run on
        several threads at once need names of their own)."""
        with self._counts_lock:
            count = self._counts[name] = self._counts.get(name, 0) + 1
        return _Operation(self, name, count, collective)

    def operations(self):
        """The watched calls in progress."""
        return list(self._active.values())

    def counts(self):
        """{operation name: how many calls of it this rank entered}."""
        with self._counts_lock:
            return dict(self._counts)

    def state(self):
        """What this rank is doing, for another rank's question."""
        now = time.monotonic()
        return [(o.name, o.count, now - o.since, o.detail)
                for o in list(self._active.values())]

    def free(self):
        """Give the monitor up: its communicator is freed once every other
        rank has said its last word on it (at once where none will)."""
        the_watchdog().leave(self)

    def free_comm(self):
        if self.comm != MPI.COMM_NULL and not MPI.Is_finalized():
            self.comm.Free()
        self.comm = MPI.COMM_NULL


# What watched() decorates: its result keeps the method's signature
# (for type checkers; mnopt/py.typed).
_Method = TypeVar('_Method', bound=Callable[..., Any])


def watched(name: str, collective: bool = True
            ) -> Callable[[_Method], _Method]:
    """Decorator: run a communicator method as watched operation ``name``
    on ``self._monitor`` (``collective=False``: point to point).

    ``self.check_calls``: None, or MNOPT_DEBUG=detail's check
    (mnopt/transport/collective_check.py), run inside the watched
    operation before the method: one attribute test when off."""
    def wrap(method):
        def run(self, *args, **kwargs):
            with self._monitor.op(name, collective):
                if self.check_calls is not None:
                    args, kwargs = self.check_calls(
                        name, method, (self,) + args, kwargs)
                    return method(*args, **kwargs)
                return method(self, *args, **kwargs)
        run.__name__ = method.__name__
        run.__doc__ = method.__doc__
        run.__wrapped__ = method
        return run
    return wrap
