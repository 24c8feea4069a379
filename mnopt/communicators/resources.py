"""Resources: what a communicator must give back (its groups' MPI
communicators, its monitor's, its background thread, its hold on the
timeline), held apart from it so that they can be released after it is
garbage-collected."""

import collections
import threading

from mpi4py import MPI

from mnopt.timeline import recorder as timelines

#: Communicators holding each open Timeline (one file per rank, shared by
#: every communicator of the rank): the last to let go closes it.
_holders = collections.Counter()
_holders_lock = threading.Lock()


def hold_timeline(tl):
    """``tl`` (a Timeline or NULL), held by one more communicator."""
    if tl:
        with _holders_lock:
            _holders[tl] += 1
    return tl


def let_go_of_timeline(tl):
    """One communicator fewer holds ``tl``; the last one closes it (its
    file is then complete)."""
    if not tl:
        return
    with _holders_lock:
        _holders[tl] -= 1
        last = _holders[tl] <= 0
        if last:
            del _holders[tl]
    if last:
        tl.close()


class Resources(object):
    """What a communicator must give back: its groups' MPI communicators,
    its monitor's, and its background thread.  Holds no reference to the
    communicator, so it can be released when the communicator is
    garbage-collected (communicators are local handles in MPI: freeing
    one on each rank at different times is sound)."""

    def __init__(self):
        self.sync_group = self.async_group = None
        self.executor = None
        self.monitor = None
        #: MNOPT_DEBUG=detail's check (its own duplicate communicator).
        self.call_check = None
        #: The timeline this communicator holds (hold_timeline).
        self.timeline = timelines.NULL

    def release(self):
        """Free everything (once; later calls do nothing)."""
        executor, self.executor = self.executor, None
        if executor is not None:
            # Not from the executor's own thread (a collection may run
            # there): that thread is idle, it ends by itself.
            executor.shutdown(wait=not any(
                t is threading.current_thread()
                for t in getattr(executor, '_threads', ())))
        groups = (self.sync_group, self.async_group)
        self.sync_group = self.async_group = None
        if not MPI.Is_finalized():
            for group in groups:
                if group is not None:
                    group.free()
        call_check, self.call_check = self.call_check, None
        if call_check is not None:
            call_check.free()
        monitor, self.monitor = self.monitor, None
        if monitor is not None:
            monitor.free()
        tl, self.timeline = self.timeline, timelines.NULL
        let_go_of_timeline(tl)
