"""Abort the whole MPI job when one rank dies of an uncaught exception.

Without it, the other ranks wait forever in their next collective.  This
does what ``python -m mpi4py script.py`` does, for scripts launched as
plain ``python script.py``.  Before the abort the failing rank reports
the failure once (mnopt/common/failure_summary.py): its traceback, and what the
other ranks were doing.

``import mnopt`` installs it in a process that an MPI launcher started as
one of several (``install_at_import``), so that a rank failing before its
first ``create_communicator`` ends the job too: MPI's start waits for
every rank, so without the abort the others would wait there for ever.
"""

import atexit
import logging
import os
import signal
import sys
import time
import traceback

from mnopt.common import failure_summary
from mnopt.stall import launched
from mnopt.common import log

logger = log.get(__name__)

_installed = False
#: The process ``install_at_import`` found launched as one of several (its
#: pid: a fork of it is not), or None.
_launched_pid = None

#: Seconds to let the launcher forward this rank's output before the abort
#: tears the job down (without it the traceback was sometimes lost).
FORWARD_SECONDS = 1.0


#: Seconds a process that failed before MPI started gives MPI to start
#: (it starts once every rank starts it: the others may still be busy
#: before their create_communicator) before the process ends itself by a
#: signal instead, which MPICH's and Open MPI's mpiexec take as the end of
#: the job (a plain non-zero exit does not end MPICH's).
START_MPI_SECONDS = 10



def _abort_hook(exc_type, exc_value, exc_traceback):
    # The message is the traceback's last line: said once.
    failure = ('%s (its traceback below)' % exc_type.__name__,
               ''.join(traceback.format_exception(exc_type, exc_value,
                                                  exc_traceback)))
    several = _several_ranks()
    # Python's own hook would print the traceback that the failure
    # summary shows: once is enough.  A user's hook runs as before.
    if not several or _previous is not sys.__excepthook__:
        _previous(exc_type, exc_value, exc_traceback)
    if _mpi_started():
        abort('uncaught exception', failure=failure)
    elif several:
        abort_before_mpi('uncaught exception', failure=failure)


def _several_ranks():
    """Whether this process is one of several ranks that the abort would
    end (MPI's world, or before MPI starts, the launcher's variables)."""
    if _mpi_started():
        from mpi4py import MPI
        return MPI.COMM_WORLD.size > 1
    return _launched_pid == os.getpid() and not _multiprocessing_child()


def _mpi_started():
    """Whether MPI runs in this process (told without starting it)."""
    mpi = sys.modules.get('mpi4py.MPI')
    try:
        return mpi is not None and mpi.Is_initialized() and \
            not mpi.Is_finalized()
    except Exception:
        return False


def _multiprocessing_child():
    """Whether this process is one that multiprocessing started (a
    forkserver's or spawn's child imports the script, and mnopt with it,
    with the launcher's variables but is no rank of the job)."""
    mp = sys.modules.get('multiprocessing')
    return mp is not None and mp.parent_process() is not None


def install_at_import(environ=None):
    """Install the hook (``add_hook``) where ``environ`` (os.environ) says
    that a launcher started this process as one of several (MPI's
    variables: mnopt/stall/launched.py), unless multiprocessing or a rank
    started it (a helper inherits the variables: ``os.system``,
    ``subprocess``), and watch for a failing exit before MPI starts.
    Starts nothing: MPI starts only if an exception reaches the hook."""
    global _launched_pid
    environ = os.environ if environ is None else environ
    sizes = launched.job_sizes(environ)
    if any(n > 1 for n in sizes.values()) and not _multiprocessing_child() \
            and not launched.started_by_a_rank(environ):
        _launched_pid = os.getpid()
        launched.mark_launched_process()
        add_hook()
        failure_summary.note_start()
        _watch_exit()


def _watch_exit():
    """End the job when this process exits with a non-zero status before
    MPI started (sys.exit(3), raise SystemExit, argparse's errors: no
    exception reaches sys.excepthook), by a signal, as a launcher needs
    (the C watch: mnopt/stall/_startwatch.c; where it is not built, such an
    exit leaves the others waiting until their timeout in MPI's start).
    Once MPI runs, a rank that exits is the communicators' to report."""
    watch = launched.exit_watch()
    if watch is None:
        return
    rank = log.rank_name()
    before, _, after = log.tagged(
        'mnopt: %s exited with status {status} before MPI started; ending '
        "the job (a signal), since the other ranks would wait for it in "
        "MPI's start" % rank).partition('{status}')
    watch.watch_exit(before, after + '\n')
    atexit.register(_unwatch_exit_once_mpi_started, watch)


def _unwatch_exit_once_mpi_started(watch):
    # Python's atexit runs before mpi4py finalizes MPI: a rank that
    # started MPI and exits is reported by the ranks it leaves.
    if _mpi_started() or launched.start_entered():
        watch.unwatch_exit()


def abort_before_mpi(why, code=1, failure=None):
    """Abort the job from a process in which MPI has not started: say
    ``why`` (and report ``failure``: (what, traceback)), start MPI
    (which waits for every rank to start it) and abort;
    if MPI has not started after START_MPI_SECONDS, end this process by
    SIGALRM, which the launcher takes as the end of the job."""
    # Ctrl-C (or an exception) raised as MPI's start returned: MPI did
    # start, though mpi4py's module did not finish loading.
    when = 'while MPI was starting' if launched.start_entered() \
        else 'before MPI started'
    log.say(logger, logging.ERROR,
            'mnopt: %s on %s %s; aborting the MPI job',
            why, log.rank_name(), when, last_words=True)
    if failure is not None:
        failure_summary.report('uncaught exception', *failure)
    log.flush(__name__)   # the handlers, stdout and stderr
    try:
        # MPI's start holds the GIL: only a signal ends a wait that is
        # too long.  The default action of SIGALRM ends the process.
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(START_MPI_SECONDS)
        from mpi4py import MPI
        if not MPI.Is_initialized():   # mpi4py.rc.initialize = False
            MPI.Init_thread()
        signal.alarm(0)
    except Exception:
        return
    _abort_started(code)


def abort(why, code=1, failure=None):
    """Abort the whole MPI job (where MPI runs with more than one
    process), saying ``why`` first, then reporting ``failure`` ((what,
    traceback): mnopt/common/failure_summary.py); nothing said or failed here
    stops the abort."""
    try:
        from mpi4py import MPI
        if not MPI.Is_initialized() or MPI.Is_finalized() \
                or MPI.COMM_WORLD.size == 1:
            return
    except Exception:
        return
    log.say(logger, logging.ERROR,
            'mnopt: %s on rank %d; aborting the MPI job', why,
            MPI.COMM_WORLD.rank, last_words=True)
    if failure is not None and not failure_summary.report(
            'uncaught exception', *failure):
        # Another rank reports an earlier failure: its turn first.
        time.sleep(failure_summary.PEERS_WAIT_S)
    log.flush(__name__)
    _abort_started(code)


def _abort_started(code):
    """MPI_Abort over COMM_WORLD (MPI started), once the launcher has had
    the time to forward what this process said; nothing where this
    process is alone in its world."""
    from mpi4py import MPI
    if MPI.COMM_WORLD.size == 1:
        return
    time.sleep(FORWARD_SECONDS)
    MPI.COMM_WORLD.Abort(code)


def run_or_abort(fn, *args):
    """Run ``fn(*args)`` (the body of one of mnopt's own threads, which
    nobody joins to see its errors); an exception aborts the job, as on
    the main thread, instead of leaving the others to wait."""
    try:
        return fn(*args)
    except BaseException as e:
        import threading
        if not _several_ranks():
            traceback.print_exc()
        abort('uncaught exception in thread %r'
              % threading.current_thread().name,
              failure=('%s (its traceback below)' % type(e).__name__,
                       traceback.format_exc()))
        raise


_previous = sys.excepthook


def add_hook():
    """Abort the job when an exception reaches sys.excepthook (once
    printed by the hook it replaces)."""
    global _installed, _previous
    if not _installed:
        _previous = sys.excepthook
        sys.excepthook = _abort_hook
        _installed = True


def remove_hook():
    """Undo ``add_hook`` (``create_communicator(abort_on_exception=
    False)`` after ``import mnopt`` installed it), where the hook is still
    sys.excepthook."""
    global _installed
    if _installed and sys.excepthook is _abort_hook:
        sys.excepthook = _previous
        _installed = False
