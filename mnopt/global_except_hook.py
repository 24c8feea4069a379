"""Abort the whole MPI job when one rank dies of an uncaught exception.

Without it, the other ranks wait forever in their next collective.  This
does what ``python -m mpi4py script.py`` does, for scripts launched as
plain ``python script.py``.
"""

import logging
import sys
import time

from mnopt import log

logger = log.get(__name__)

_installed = False

#: Seconds to let the launcher forward this rank's output before the abort
#: tears the job down (without it the traceback was sometimes lost).
FORWARD_SECONDS = 1.0


def _abort_hook(exc_type, exc_value, exc_traceback):
    _previous(exc_type, exc_value, exc_traceback)
    abort('uncaught exception')


def abort(why, code=1):
    """Abort the whole MPI job (where MPI runs with more than one
    process), saying ``why`` first; nothing said or failed here stops
    the abort."""
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
    log.flush(__name__)
    time.sleep(FORWARD_SECONDS)
    MPI.COMM_WORLD.Abort(code)



def run_or_abort(fn, *args):
    """Run ``fn(*args)`` (the body of one of mnopt's own threads, which
    nobody joins to see its errors); an exception aborts the job, as on
    the main thread, instead of leaving the others to wait."""
    try:
        return fn(*args)
    except BaseException:
        import threading
        import traceback
        traceback.print_exc()
        abort('uncaught exception in thread %r'
               % threading.current_thread().name)
        raise


_previous = sys.excepthook


def add_hook():
    global _installed, _previous
    if not _installed:
        _previous = sys.excepthook
        sys.excepthook = _abort_hook
        _installed = True
