"""The stall watchdog: the one thread per process that looks after every
Monitor (mnopt/stall.py): asks the other ranks what they do when an
operation is late, reports, aborts at the timeout, and runs the last-word
protocol (mnopt/stall_last_word.py), also at exit."""

import atexit
import logging
import threading
import time
import warnings

from mpi4py import MPI

from mnopt import log
from mnopt import stall_last_word
from mnopt import stall_report

logger = log.get(stall_report.LOGGER_NAME)

#: How often the watchdog looks at its operations and for questions.
TICK_S = 0.2
#: How long before a report the watchdog asks the other ranks (their
#: answers come back within a tick or two; a stopped rank never answers).
ANSWER_WAIT_S = 2.0
TAG_QUESTION, TAG_ANSWER = 0x57A1, 0x57A2


class Watchdog(object):
    """The one thread per process that looks after every Monitor, and the
    last-word protocol on them (mnopt/stall_last_word.py)."""

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
        monitor, and hear the others' (mnopt/stall_last_word.py): a rank
        still waiting for this one (sys.exit on one rank, a script that
        ends early) aborts the job at once instead of at the timeout, and
        a healthy job leaves no message unreceived."""
        self._stop.set()
        if self._thread is not None and \
                self._thread is not threading.current_thread():
            self._thread.join()
        if MPI.Is_finalized():
            return
        with self._lock:
            self._stopped = True
            for m in self._monitors:
                self._pending += stall_last_word.say(m, 'exited')
            stall_last_word.hear_everyone(self._monitors + self._leaving,
                                          self._receive)
            stall_last_word.let_leave(self._pending)

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
                self._pending += stall_last_word.say(monitor, 'finalized')
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
                        for op in m.operations():
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
                for op in m.operations():
                    if op.asked is not None and op.asked[0] == qid:
                        op.answers[source] = state
            elif tag == stall_last_word.TAG_EXIT:
                stall_last_word.hear(m, source, content)

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
        gone = stall_last_word.never_arriving(m, op)
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
            stall_report.abort()
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
                '%s', stall_report.describe(m, op, waited, timed_out),
                last_words=timed_out)
        if timed_out:
            stall_report.abort()


_the_watchdog = None


def the_watchdog():
    """This process's Watchdog (made at the first call; its thread starts
    with the first Monitor that needs it)."""
    global _the_watchdog
    if _the_watchdog is None:
        _the_watchdog = Watchdog()
    return _the_watchdog
