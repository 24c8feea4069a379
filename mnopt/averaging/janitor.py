"""The GC janitor: what garbage-collected communicators leave to give back
is released soon after, on another thread, never in the collection itself.

A collection runs wherever an allocation triggers it, also inside an
mpi4py call that holds mpi4py's lock table (its pickling collectives
allocate a lock there), where freeing an MPI communicator on that same
thread waits for that lock for ever (seen at -n 2: a rank stuck in bcast
-> gc -> Comm.Free); and on the background thread.  So a finalizer only
queues the release (``release_after_collection``); the janitor thread
(with MPI_THREAD_MULTIPLE), or else the next of mnopt's entry points
(``release_collected``), runs it.
"""

import collections
import threading

from mpi4py import MPI

from mnopt.common import log

#: What garbage-collected communicators left to give back, released by
#: the janitor thread or at the next of mnopt's entry points
#: (release_collected).
_collected = collections.deque()
_collected_waiting = threading.Event()
_janitor = None
#: Where the janitor reports a release that failed (mnopt/common/log.py): the
#: logger of mnopt.communicators.base, where this was said before.
logger = log.get('mnopt.communicators.base')


def release_after_collection(release):
    """A finalizer for ``weakref.finalize``: ``release()`` is called soon
    after, on another thread, not during the garbage collection."""
    _collected.append(release)
    _collected_waiting.set()


def release_collected():
    """Release what collected communicators left (``_collected``) on this
    thread; called where mnopt is not inside an MPI call (a communicator is
    made, averages or is finalized)."""
    while _collected:
        try:
            release = _collected.popleft()
        except IndexError:   # the janitor took the last one
            return
        try:
            release()
        except Exception:
            if MPI.Is_finalized():   # at exit, under the janitor
                return
            # As Python does for an error in a finalizer: said, not
            # raised into whatever call this entry point serves, and the
            # rest is still released.
            # (A record of logger mnopt.communicators.base,
            # mnopt/common/log.py: the message, then the traceback, as
            # before on stderr.)
            logger.error('mnopt: releasing what a garbage-collected '
                         'communicator left failed (ignored):', exc_info=True)


def _janitor_run(waiting=_collected_waiting):
    # ``waiting`` is bound once, here: the janitor always waits on the
    # event the module made (a test swaps the module's to keep it asleep).
    while True:
        waiting.wait()
        waiting.clear()
        if MPI.Is_finalized():
            return
        release_collected()


def start_janitor():
    """The thread that releases what collections left, as soon as they
    leave it: with MPI_THREAD_MULTIPLE only (else the entry points do)."""
    global _janitor
    if _janitor is not None or MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        return
    _janitor = threading.Thread(target=_janitor_run, name='mnopt-janitor',
                                daemon=True)
    _janitor.start()
