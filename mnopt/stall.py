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
"""

import atexit
import os
import sys
import threading
import time
import warnings

import numpy
from mpi4py import MPI

DEFAULT_WARNING_S = 60.0
DEFAULT_TIMEOUT_S = 600.0
#: How often the watchdog looks at its operations and for questions.
TICK_S = 0.2
#: How long before a report the watchdog asks the other ranks (their
#: answers come back within a tick or two; a stopped rank never answers).
ANSWER_WAIT_S = 2.0
TAG_QUESTION, TAG_ANSWER = 0x57A1, 0x57A2
#: A rank's last word, sent as its process exits: how many of each
#: operation it entered.
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
        #: Ranks whose process has exited: rank -> {operation: count it
        #: entered}.  An operation they never entered can never finish.
        self.exited = {}
        self.enabled = (self.warning or self.timeout) is not None \
            and self.size > 1 and _watchdog().start()
        if self.enabled:
            _watchdog().add(self)

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
        _watchdog().remove(self)
        if self.comm != MPI.COMM_NULL and not MPI.Is_finalized():
            self.comm.Free()
        self.comm = MPI.COMM_NULL


def watched(name, collective=True):
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
            sys.stderr.write(
                'mnopt: %s has waited %.1f s in %s; not every rank has '
                'arrived (one may have failed, exited or not reached it)%s'
                '\n' % (who, waited, what, _tail(limit, timed_out)))
            sys.stderr.flush()
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
    """The one thread per process that looks after every Monitor."""

    def __init__(self):
        self._monitors = []
        self._lock = threading.Lock()
        self._thread = None
        self._stop = threading.Event()
        self._questions = 0
        self._pending = []  # isend requests not yet known complete

    def start(self):
        """True once the thread runs (False without THREAD_MULTIPLE)."""
        if self._thread is not None:
            return True
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            warnings.warn('mnopt: MPI was initialised without '
                          'MPI_THREAD_MULTIPLE; stall detection is off')
            return False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name='mnopt-watchdog')
        self._thread.start()
        atexit.register(self.stop)  # before mpi4py finalizes MPI
        return True

    def stop(self):
        """At exit: tell the other ranks, then end the thread."""
        self._say_exiting()
        self._stop.set()
        if self._thread is not None and \
                self._thread is not threading.current_thread():
            self._thread.join()

    def _say_exiting(self):
        """Send every other rank of every monitor this process's counts:
        a rank still waiting for it (sys.exit on one rank, a script that
        ends early) aborts the job at once instead of at the timeout.
        MPI_Finalize waits for every rank, so the others are there to
        hear it."""
        if MPI.Is_finalized():
            return
        with self._lock:
            sends = []
            for m in self._monitors:
                with m._counts_lock:
                    counts = dict(m._counts)
                sends += [m.comm.isend(counts, dest=r, tag=TAG_EXIT)
                          for r in range(m.size) if r != m.rank]
        deadline = time.monotonic() + EXIT_SEND_S
        while not MPI.Request.Testall(sends) and \
                time.monotonic() < deadline:
            time.sleep(0.001)

    def add(self, monitor):
        with self._lock:
            self._monitors.append(monitor)

    def remove(self, monitor):
        with self._lock:
            if monitor in self._monitors:
                self._monitors.remove(monitor)

    def _run(self):
        while not self._stop.wait(TICK_S):
            with self._lock:
                monitors = list(self._monitors)
                try:
                    for m in monitors:
                        self._answer_questions(m)
                        self._collect_answers(m)
                        self._collect_exits(m)
                        for op in list(m._active.values()):
                            self._look_after(m, op)
                    self._pending = [r for r in self._pending
                                     if not r.Test()]
                except Exception as e:  # never let the watchdog die silently
                    sys.stderr.write('mnopt: stall detection failed: %r\n'
                                     % (e,))
                    return

    def _answer_questions(self, m):
        while m.comm.iprobe(source=MPI.ANY_SOURCE, tag=TAG_QUESTION):
            status = MPI.Status()
            qid = m.comm.recv(source=MPI.ANY_SOURCE, tag=TAG_QUESTION,
                              status=status)
            self._pending.append(m.comm.isend(
                (qid, m.state()), dest=status.Get_source(), tag=TAG_ANSWER))

    def _collect_answers(self, m):
        while m.comm.iprobe(source=MPI.ANY_SOURCE, tag=TAG_ANSWER):
            status = MPI.Status()
            qid, state = m.comm.recv(source=MPI.ANY_SOURCE, tag=TAG_ANSWER,
                                     status=status)
            for op in list(m._active.values()):
                if op.asked is not None and op.asked[0] == qid:
                    op.answers[status.Get_source()] = state

    def _collect_exits(self, m):
        while m.comm.iprobe(source=MPI.ANY_SOURCE, tag=TAG_EXIT):
            status = MPI.Status()
            counts = m.comm.recv(source=MPI.ANY_SOURCE, tag=TAG_EXIT,
                                 status=status)
            m.exited[status.Get_source()] = counts

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
        gone = never_arriving(m, op)
        if gone:
            sys.stderr.write(
                'mnopt: %s has waited %.1f s in %s; %s exited without '
                'entering it, so it cannot finish. Aborting the MPI job.\n'
                % (m.name_of(m.rank), waited, op.label(),
                   ', '.join(m.name_of(r) for r in gone)))
            sys.stderr.flush()
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
        sys.stderr.write(describe(m, op, waited, timed_out) + '\n')
        sys.stderr.flush()
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
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(1.0)  # let the launcher forward the report
    MPI.COMM_WORLD.Abort(1)


_the_watchdog = None


def _watchdog():
    global _the_watchdog
    if _the_watchdog is None:
        _the_watchdog = _Watchdog()
    return _the_watchdog
