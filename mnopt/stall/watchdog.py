"""The stall watchdog: the one thread per process that looks after every
Monitor (mnopt/stall/monitor.py): asks the other ranks what they do when an
operation is late, reports, aborts at the timeout, and runs the last-word
protocol (mnopt/stall/last_word.py), also at exit; for a failing rank's
summary (mnopt/common/failure_summary.py) it asks the others what they do, and
hears whether another rank reports an earlier failure."""

import atexit
import logging
import threading
import time
import warnings

from mpi4py import MPI

from mnopt.common import failure_summary
from mnopt.common import log
from mnopt.stall import last_word as stall_last_word
from mnopt.stall import report as stall_report

logger = log.get(stall_report.LOGGER_NAME)

#: How often the watchdog looks at its operations and for questions.
TICK_S = 0.2
#: How long before a report the watchdog asks the other ranks (their
#: answers come back within a tick or two; a stopped rank never answers).
ANSWER_WAIT_S = 2.0
TAG_QUESTION, TAG_ANSWER = 0x57A1, 0x57A2
#: A rank's claim that it reports a failure: (priority, its world rank,
#: whether it has reported it, how it failed, one line of what it raised).
TAG_CLAIM = 0x57A4
#: How long a failing rank listens for another's claim when it asks
#: nothing (a stall's report already holds the answers).
CLAIM_WAIT_S = 2.5 * TICK_S


class Watchdog(object):
    """The one thread per process that looks after every Monitor, and the
    last-word protocol on them (mnopt/stall/last_word.py)."""

    def __init__(self):
        self._monitors = []
        self._leaving = []   # freed monitors not yet heard out
        self._stopped = False
        self._lock = threading.Lock()
        self._thread = None
        self._stop = threading.Event()
        self._questions = 0
        self._pending = []  # isend requests not yet known complete
        self._claims = []   # other ranks' claims (TAG_CLAIM), their names
        self._failure = None   # this rank's failure question, answers

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
        failure_summary.set_peers(self.failing, self.reported)
        return True

    def stop(self):
        """At exit: end the thread, say this process's last word on every
        monitor, and hear the others' (mnopt/stall/last_word.py): a rank
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
            elif tag == TAG_CLAIM:
                self._claims.append((tuple(content), m.name_of(source)))
            elif tag == TAG_ANSWER and self._failure is not None and \
                    content[0] == self._failure['qid']:
                self._failure['answers'][(m, source)] = content[1]
            elif tag == TAG_ANSWER:
                qid, state = content
                for op in m.operations():
                    if op.asked is not None and op.asked[0] == qid:
                        op.answers[source] = state
            elif tag == stall_last_word.TAG_EXIT:
                stall_last_word.hear(m, source, content)

    def failing(self, claim, wait_s, question=True):
        """This rank reports a failure (mnopt/common/failure_summary.py):
        ``claim`` ((priority, how, line)) it on every monitor, ask the
        other ranks what they do (where ``question``), and listen up to
        ``wait_s`` for their answers, and at least CLAIM_WAIT_S for their
        claims (ranks that fail at once).  Returns ({name: what it does}
        or None, whether no other rank claimed an earlier failure,
        {name: (how, line)} of the others' claimed failures)."""
        mine = (claim[0], MPI.COMM_WORLD.rank)
        here = threading.current_thread() is self._thread
        if not here:
            self._lock.acquire()
        try:
            monitors = [m for m in self._monitors if not m.said_last_word]
            self._questions += 1
            self._failure = {'qid': ('failure', self._questions),
                             'answers': {}}
            for m in monitors:
                for r in range(m.size):
                    if r == m.rank:
                        continue
                    self._pending.append(m.comm.isend(
                        mine + (False,) + tuple(claim[1:]), dest=r,
                        tag=TAG_CLAIM))
                    if question:
                        self._pending.append(m.comm.isend(
                            self._failure['qid'], dest=r, tag=TAG_QUESTION))
        finally:
            if not here:
                self._lock.release()
        # Ranks that said their last word answer no more questions.
        expected = sum(m.size - 1 - len(m.exited) for m in monitors)
        start = time.monotonic()
        deadline = start + (wait_s if question else CLAIM_WAIT_S)
        while time.monotonic() < deadline and (
                not question or len(self._failure['answers']) < expected
                or time.monotonic() < start + CLAIM_WAIT_S):
            if here:   # the watchdog reports a stall: it receives itself
                for m in monitors:
                    self._receive(m)
            time.sleep(0.01)
        # Of the ranks that claim at once, the lowest priority, then the
        # lowest rank reports; none where one has reported already.
        claims = [c for c, _ in self._claims]
        first = all(not c[2] and mine <= tuple(c[:2]) for c in claims)
        names = {c[1]: name for c, name in self._claims}
        also = failure_summary.also_failed(claims, names.get)
        if not question or not monitors:
            return None, first, also
        return self._others(monitors, self._failure['answers']), first, \
            also

    def reported(self):
        """This rank has reported its failure: the others, if they fail
        too, leave theirs unsaid (mnopt/common/failure_summary.py)."""
        here = threading.current_thread() is self._thread
        if not here:
            self._lock.acquire()
        try:
            done = (0, MPI.COMM_WORLD.rank, True)
            for m in self._monitors:
                if not m.said_last_word:
                    self._pending += [m.comm.isend(done, dest=r,
                                                   tag=TAG_CLAIM)
                                      for r in range(m.size) if r != m.rank]
        finally:
            if not here:
                self._lock.release()

    @staticmethod
    def _doing(m, r, answer):
        if r in m.exited:
            return 'its process %s' % m.why_gone.get(r, 'exited')
        return stall_report.doing(m, r, answer)

    @staticmethod
    def _others(monitors, answers):
        """{name: what it does} from the answers to a failure question."""
        others = {}
        for m in monitors:
            for r in range(m.size):
                if r != m.rank:
                    text = Watchdog._doing(m, r, answers.get((m, r)))
                    name = m.name_of(r)
                    others[name] = text if name not in others or \
                        others[name] == text else others[name] + '; ' + text
        return others

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
            self._summarize(m, op, 'exit', '%s without entering %s, '
                            'which it therefore cannot finish' % (
                                'exited' if m.why_gone.get(gone[0]) ==
                                'exited' else 'finalized or dropped its '
                                'communicator', op.label()),
                            m.name_of(gone[0]))
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
            self._summarize(m, op, 'stall', 'waited %.1f s in %s%s, past '
                            'the timeout (%.0f s, MNOPT_TIMEOUT)' % (
                                waited, op.label(), ' (%s)' % op.detail
                                if op.detail else '', m.timeout))
            stall_report.abort()

    def _summarize(self, m, op, how, what, who=None):
        """The failure summary of a rank that aborts from here: with what
        the others said they do in a stall (the answers to ``op``'s
        question), else asked now."""
        others = None
        if how == 'stall':
            others = {m.name_of(r): self._doing(m, r, op.answers.get(r))
                      for r in range(m.size) if r != m.rank}
        if not failure_summary.report(how, what, others=others, who=who):
            time.sleep(failure_summary.PEERS_WAIT_S)  # the reporter's turn


_the_watchdog = None


def the_watchdog():
    """This process's Watchdog (made at the first call; its thread starts
    with the first Monitor that needs it)."""
    global _the_watchdog
    if _the_watchdog is None:
        _the_watchdog = Watchdog()
    return _the_watchdog
