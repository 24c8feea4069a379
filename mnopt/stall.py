"""Stall detection: no mnopt collective waits forever in silence.

Every operation a communicator runs across ranks (gradient averaging, sync
or in the background, the reduction server's push/pull, bcast_data, the
array and object collectives) is *watched*: it registers itself with its
communicator's Monitor for as long as it runs, under its name and call
count (``flat#0.mean_grads #17``).  That costs a dict insert and delete per
call; the operation itself is untouched (still one blocking MPI call).

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

The reports are records of logger ``mnopt.stall`` (mnopt/log.py): WARNING
while the job goes on, ERROR when it is aborted; by default on stderr.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import numpy
from mpi4py import MPI

from mnopt import log

logger = log.get(__name__)

DEFAULT_WARNING_S = 60.0
DEFAULT_TIMEOUT_S = 600.0
#: How often the watchdog looks at its operations and for questions.
TICK_S = 0.2
#: How long before a report the watchdog asks the other ranks (their
#: answers come back within a tick or two; a stopped rank never answers).
ANSWER_WAIT_S = 2.0
TAG_QUESTION, TAG_ANSWER = 0x57A1, 0x57A2
#: A rank's last word on a monitor, sent as its process exits or as it
#: frees the monitor (its communicator was finalized or collected): why
#: ('exited', 'finalized') and how many of each operation it entered.
#: Nothing is ever sent on a monitor after it (see ``_Watchdog``).
TAG_EXIT = 0x57A3
#: How long an exiting rank lets its last words leave (seconds).
EXIT_SEND_S = 2.0


def _seconds(value, name, env):
    if isinstance(value, (bool, numpy.bool_)):
        # float(True) is 1.0: a switch is not a number of seconds.
        raise ValueError('%s=%r: a number of seconds >= 0 (0 disables) was '
                         'expected, not a bool' % (name, value))
    if value is None:
        value = os.environ.get(env)
        if value is None or value == '':
            return None
        where = '%s=%r' % (env, value)
    else:
        where = '%s=%r' % (name, value)
    try:
        seconds = float(value)
        if not seconds >= 0:
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError('%s: a number of seconds >= 0 (0 disables) was '
                         'expected' % where)
    return seconds


def settings(stall_warning=None, timeout=None):
    """(warning, timeout) in seconds, None where disabled: the arguments,
    else $MNOPT_STALL_WARNING / $MNOPT_TIMEOUT, else the defaults."""
    warning = _seconds(stall_warning, 'stall_warning', 'MNOPT_STALL_WARNING')
    timeout = _seconds(timeout, 'timeout', 'MNOPT_TIMEOUT')
    warning = DEFAULT_WARNING_S if warning is None else warning
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    return warning or None, timeout or None


def settings_or_defaults(stall_warning=None, timeout=None):
    """``settings()``, or the defaults where they are invalid: for the
    waits and exchanges through which a bad setting gets reported (where
    the arguments are checked), which must not fail on one rank first."""
    try:
        return settings(stall_warning, timeout)
    except ValueError:
        return DEFAULT_WARNING_S, DEFAULT_TIMEOUT_S


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
        self.enabled = self.size > 1 and _watchdog().start(self.reports)
        if self.enabled:
            _watchdog().add(self)

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

    def state(self):
        """What this rank is doing, for another rank's question."""
        now = time.monotonic()
        return [(o.name, o.count, now - o.since, o.detail)
                for o in list(self._active.values())]

    def free(self):
        """Give the monitor up: its communicator is freed once every other
        rank has said its last word on it (at once where none will)."""
        _watchdog().leave(self)

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
    on ``self._monitor`` (``collective=False``: point to point)."""
    def wrap(method):
        def run(self, *args, **kwargs):
            with self._monitor.op(name, collective):
                return method(self, *args, **kwargs)
        run.__name__ = method.__name__
        run.__doc__ = method.__doc__
        run.__wrapped__ = method
        return run
    return wrap


#: Longest nap between two polls in ``wait_or_abort`` (seconds): what it
#: waits for (start-up exchanges) is rare and not latency-bound.
MAX_NAP_S = 0.01


def wait_or_abort(requests, what, stall_warning=None, timeout=None):
    """Wait until every mpi4py Request in ``requests`` has completed, with
    the same stall detection as a watched operation: after the warning
    time print one line (``mnopt: rank R has waited N s in <what>; ...``)
    and keep waiting; after the timeout print it again and abort the MPI
    job.  For waits outside any Monitor (the exchanges that precede one),
    so it cannot ask the other ranks what they do.

    Settings as ``settings_or_defaults()``: the exchange waited for is
    often how a bad setting gets reported on every rank."""
    warning, limit = settings_or_defaults(stall_warning, timeout)
    if warning is not None and limit is not None and warning >= limit:
        warning = None   # the timeout's report says it all
    who = 'rank %d' % MPI.COMM_WORLD.rank
    start, nap = time.monotonic(), 20e-6
    # Short waits stay short, long ones cost almost no CPU (MPICH spins in
    # its blocking calls, and server processes share cores with workers).
    while not MPI.Request.Testall(requests):
        waited = time.monotonic() - start
        timed_out = limit is not None and waited >= limit
        if timed_out or (warning is not None and waited >= warning):
            log.say(
                logger, logging.ERROR if timed_out else logging.WARNING,
                'mnopt: %s has waited %.1f s in %s; not every rank has '
                'arrived (one may have failed, exited or not reached it)%s',
                who, waited, what, _tail(limit, timed_out),
                last_words=timed_out)
            if timed_out:
                _abort()
            warning = None
        time.sleep(nap)
        nap = min(2 * nap, MAX_NAP_S)


def _tail(timeout, timed_out):
    """How a report ends: the abort, or how long until it."""
    if timed_out:
        return '. Timeout (%.0f s, MNOPT_TIMEOUT): aborting the MPI job.' \
            % timeout
    return '. Still waiting%s.' % (
        '; the job is aborted after %.0f s (MNOPT_TIMEOUT)' % timeout
        if timeout else '')


# ----------------------------------------------------------- the watchdog

class _Watchdog(object):
    """The one thread per process that looks after every Monitor.

    The last-word protocol: a rank's last message on a monitor says that
    it is gone (its process exits, or it freed the monitor) and how far it
    got; the others' watchdogs abort the job when they wait in an
    operation it never entered.  A rank sends nothing on a monitor after
    its last word (questions are then received and dropped), and keeps
    receiving on it until every other rank's last word has come; MPI
    keeps one sender's messages in order (all are received with any tag),
    so then nothing sent to it is left unreceived.  A freed monitor's
    communicator is freed after that; an exiting process waits for it
    (every rank exits, and MPI_Finalize waits for every rank anyway)."""

    def __init__(self):
        self._monitors = []
        self._leaving = []   # freed monitors not yet heard out
        self._stopped = False
        self._lock = threading.Lock()
        self._thread = None
        self._stop = threading.Event()
        self._questions = 0
        self._pending = []  # isend requests not yet known complete

    def start(self, say_if_off=True):
        """True once the thread runs (False without THREAD_MULTIPLE)."""
        if self._thread is not None:
            return True
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            if say_if_off:
                warnings.warn('mnopt: MPI was initialised without '
                              'MPI_THREAD_MULTIPLE; stall detection is off')
            return False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name='mnopt-watchdog')
        self._thread.start()
        atexit.register(self.stop)  # before mpi4py finalizes MPI
        return True

    def stop(self):
        """At exit: end the thread, say this process's last word on every
        monitor, and hear the others' (``_Watchdog``): a rank still waiting
        for this one (sys.exit on one rank, a script that ends early)
        aborts the job at once instead of at the timeout, and a healthy
        job leaves no message unreceived."""
        self._stop.set()
        if self._thread is not None and \
                self._thread is not threading.current_thread():
            self._thread.join()
        if MPI.Is_finalized():
            return
        with self._lock:
            self._stopped = True
            for m in self._monitors:
                self._say_last_word(m, 'exited')
            self._hear_everyone(self._monitors + self._leaving)
            deadline = time.monotonic() + EXIT_SEND_S
            while not MPI.Request.Testall(self._pending) and \
                    time.monotonic() < deadline:
                time.sleep(0.001)

    def _say_last_word(self, m, why):
        """Send every other rank of ``m`` this rank's counts (and why)."""
        with m._counts_lock:
            counts = dict(m._counts)
        m.said_last_word = True
        self._pending += [m.comm.isend((why, counts), dest=r, tag=TAG_EXIT)
                          for r in range(m.size) if r != m.rank]

    def _hear_everyone(self, monitors):
        """Receive on ``monitors`` until every other rank's last word has
        come; after a monitor's timeout (or the default one) say who is
        missing and go on."""
        start = time.monotonic()
        waiting = list(monitors)
        while waiting:
            for m in waiting:
                self._receive(m)
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

    def add(self, monitor):
        with self._lock:
            self._monitors.append(monitor)

    def leave(self, monitor):
        """``monitor`` is freed: say its last word now; its communicator
        is freed once the others' have come (at once if it never joined
        the protocol, or the process is past it)."""
        with self._lock:
            joined = monitor in self._monitors
            if joined:
                self._monitors.remove(monitor)
            if joined and not self._stopped and not MPI.Is_finalized():
                self._say_last_word(monitor, 'finalized')
                self._leaving.append(monitor)
                return
        monitor.free_comm()

    def _run(self):
        while not self._stop.wait(TICK_S):
            with self._lock:
                try:
                    for m in self._monitors + self._leaving:
                        self._receive(m)
                    for m in self._monitors:
                        for op in list(m._active.values()):
                            self._look_after(m, op)
                    for m in [m for m in self._leaving
                              if m.heard_everyone()]:
                        self._leaving.remove(m)
                        m.free_comm()
                    self._pending = [r for r in self._pending
                                     if not r.Test()]
                except Exception as e:  # never let the watchdog die silently
                    log.say(logger, logging.ERROR,
                            'mnopt: stall detection failed: %r', e)
                    return

    def _receive(self, m):
        """Every message waiting on ``m``'s communicator, in the order each
        rank sent them (any tag: TAG_QUESTION, TAG_ANSWER, TAG_EXIT)."""
        status = MPI.Status()
        while True:
            message = m.comm.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
            if message is None:
                return
            source, tag = status.Get_source(), status.Get_tag()
            content = message.recv()
            if tag == TAG_QUESTION and not m.said_last_word:
                self._pending.append(m.comm.isend(
                    (content, m.state()), dest=source, tag=TAG_ANSWER))
            elif tag == TAG_ANSWER:
                qid, state = content
                for op in list(m._active.values()):
                    if op.asked is not None and op.asked[0] == qid:
                        op.answers[source] = state
            elif tag == TAG_EXIT:
                m.why_gone[source], m.exited[source] = content

    def _ask(self, m, op):
        self._questions += 1
        qid = (m.rank, self._questions)
        op.asked, op.answers = (qid, time.monotonic()), {}
        for r in range(m.size):
            if r != m.rank:
                self._pending.append(m.comm.isend(qid, dest=r,
                                                  tag=TAG_QUESTION))

    def _look_after(self, m, op):
        """Ask, then report, when ``op`` passes the warning time (once)
        and again at the timeout (then abort)."""
        now = time.monotonic()
        waited = now - op.since
        if not m.reports:
            return
        gone = never_arriving(m, op)
        if gone:
            log.say(
                logger, logging.ERROR,
                'mnopt: %s has waited %.1f s in %s; %s without entering '
                'it, so it cannot finish. Aborting the MPI job.',
                m.name_of(m.rank), waited, op.label(), ', '.join(
                    # Under ``python -m mpi4py`` a script's end collects
                    # its communicators before the process exits.
                    '%s %s' % (m.name_of(r), 'exited' if m.why_gone.get(r)
                               == 'exited' else 'finalized or dropped its '
                               'communicator (or its script ended)')
                    for r in gone), last_words=True)
            _abort()
        if not op.warned and m.warning is not None and (
                m.timeout is None or m.warning < m.timeout):
            due = m.warning
        else:
            due = m.timeout
        if due is None:
            return
        # Ask ahead, so that the report is out at the due time.
        ask_at = max(due / 2, due - ANSWER_WAIT_S)
        if waited < ask_at:
            return
        if op.asked is None or op.asked[1] < op.since + ask_at:
            self._ask(m, op)   # fresh answers for this report
            return
        if waited < due:
            return
        timed_out = due == m.timeout
        op.warned = True
        log.say(logger, logging.ERROR if timed_out else logging.WARNING,
                '%s', describe(m, op, waited, timed_out),
                last_words=timed_out)
        if timed_out:
            _abort()


def never_arriving(m, op):
    """The ranks whose process exited before entering ``op`` (which needs
    every rank: a collective, and not on a serving rank)."""
    if not op.collective or m.rank in m.helpers:
        return []
    return sorted(r for r, counts in list(m.exited.items())
                  if r not in m.helpers and counts.get(op.name, 0) < op.count)


def describe(m, op, waited, timed_out):
    """The report: who has not arrived at ``op`` and what they do."""
    missing, arrived, helpers = [], [m.rank], []
    for r in range(m.size):
        if r == m.rank:
            continue
        ops = op.answers.get(r)
        if ops is None:
            what = 'no answer: stopped, hung outside Python, or gone'
        elif any(name == op.name and count == op.count
                 for name, count, _, _ in ops) and r not in m.helpers:
            arrived.append(r)
            continue
        elif ops:
            what = 'in ' + ', '.join(
                '%s.%s #%d for %.1f s%s' % (m.label, name, count, t,
                                            ' ' + d if d else '')
                for name, count, t, d in ops)
        elif r in m.helpers:
            what = 'idle: no request in progress'
        else:
            what = ('busy outside %s: computing, or stuck before its next '
                    'call' % m.label)
        (helpers if r in m.helpers else missing).append(
            '%s (%s)' % (m.name_of(r), what))
    head = 'mnopt: %s has waited %.1f s in %s%s' % (
        m.name_of(m.rank), waited, op.label(),
        ' (%s)' % op.detail if op.detail else '')
    arrived = ', '.join(m.name_of(r) for r in sorted(arrived))
    if missing:
        body = '; not arrived: %s; arrived: %s' % ('; '.join(missing),
                                                  arrived)
    elif helpers:
        body = '; every rank has arrived (%s): it waits on the servers' \
            % arrived
    else:
        body = '; every rank has arrived (%s): a slow operation, not a ' \
            'missing rank' % arrived
    if helpers:
        body += '; servers: ' + '; '.join(helpers)
    return head + body + _tail(m.timeout, timed_out)


def _abort():
    # What was just logged must be out before the abort ends the process
    # (this runs on the watchdog thread: nothing else would flush it).
    log.flush(__name__)
    time.sleep(1.0)  # let the launcher forward the report
    MPI.COMM_WORLD.Abort(1)


_the_watchdog = None


def _watchdog():
    global _the_watchdog
    if _the_watchdog is None:
        _the_watchdog = _Watchdog()
    return _the_watchdog
