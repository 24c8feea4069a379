"""A colocated reduction_server communicator's servers: one thread per
channel in each worker, serving its shard of every exchange
(mnopt/server/loop.py's ``serve``; on the rank's timeline as thread
'server'), closed once every worker said goodbye; and the timeline's spans
of a worker's streamed chunks (``chunk_spans``)."""

import atexit
import functools
import threading

from mpi4py import MPI

from mnopt.server import job as server_job
from mnopt.server import loop as server_loop
from mnopt.global_except_hook import run_or_abort


class ColocatedServers(object):
    """A colocated communicator's two server threads, one per channel.
    ``close`` says this worker's goodbye on both channels; each thread
    ends once every worker has said it, and ``close(wait=True)`` (or the
    next colocated servers made, or the exit) frees the channels.

    Closed by the communicator's finalize(), when it is garbage-collected
    (all workers drop it at the same point of the program), or at exit;
    holds no reference to the communicator."""

    def __init__(self, channels, rank, memory, monitor, timeline=None):
        self.channels = channels
        self.n_workers = channels[0].size
        self._closed = False   # every goodbye sent
        self._lock = threading.Lock()
        # Per channel: set when this worker starts an exchange on it (or
        # says goodbye), which wakes that channel's idle server thread.
        self._cues = [threading.Event() for _ in channels]
        # Set once this worker said goodbye: the threads then look for the
        # other workers' goodbyes in earnest (a finalize waits for them).
        self._leaving = threading.Event()
        self.threads = []
        for chan, name, cue in zip(channels, server_job.CHANNEL_NAMES,
                                   self._cues):
            t = threading.Thread(
                target=run_or_abort, daemon=True, args=(
                    _serve, chan, rank, memory, monitor, 'serve.' + name,
                    functools.partial(_idle, cue, self._leaving), cue.clear,
                    timeline),
                name='mnopt-colocated-server')
            t.start()
            self.threads.append(t)
        for ended in [c for c in _open_colocated if c._closed and not any(
                t.is_alive() for t in c.threads)]:
            ended.close(wait=True)   # frees their channels
        _open_colocated.add(self)

    def wake(self, chan):
        """This worker starts an exchange on ``chan``: its server thread
        there looks for requests in earnest."""
        self._cues[self.channels.index(chan)].set()

    def close(self, wait):
        """Say goodbye (once); with ``wait``, until the threads have ended,
        which needs every worker's goodbye (not from a garbage collection,
        which may run at another point on another rank).  Safe from two
        threads at once (the janitor closes a collected one while the
        main thread makes the next, which frees the ended ones)."""
        with self._lock:
            if not self._closed:
                server_job.say_goodbye(self.channels, range(self.n_workers))
                self._leaving.set()
                for cue in self._cues:
                    cue.set()
                # Only now: this rank's server threads may end before its
                # own goodbye has left for the other ranks' servers, and
                # _closed with the threads ended lets the channels be freed.
                self._closed = True
        if wait:
            for t in self.threads:
                t.join()
            # Here, not in the threads: a thread ends as soon as it has
            # every goodbye, while this one may still be sending its own.
            with self._lock:
                if not MPI.Is_finalized():
                    for chan in self.channels:
                        if chan != MPI.COMM_NULL:
                            chan.Free()
                _open_colocated.discard(self)


#: Longest sleep of an idle colocated server thread before it looks at
#: MPI anyway (seconds): the other workers' goodbyes, which no cue of
#: this worker announces, are seen within it.
IDLE_LOOK_S = 0.05


def _idle(cue, leaving):
    """serve()'s ``idle`` for a colocated server thread: sleep until this
    worker's cue (True) or IDLE_LOOK_S (False); once this worker is
    ``leaving``, look at once (True).  Polling MPI with naps of
    up to 1 ms between averagings cost the CPU the training needs (16
    simulated nodes on 2 cores: flat ran with the CPU 0-4% idle, 27%
    without a colocated communicator in the processes)."""
    if leaving.is_set():
        return True
    if cue.wait(IDLE_LOOK_S):
        cue.clear()
        return True
    return False


def _serve(chan, rank, memory, monitor, name, idle, on_headers, timeline):
    workers = list(range(chan.size))
    if timeline:   # the rank's timeline, on a thread named 'server'
        timeline.name_thread('server')
    server_loop.serve(chan, workers, rank, len(workers), memory, None, None,
                      monitor, name, idle, on_headers, timeline)


def chunk_spans(timeline, buffer, pack, unpack):
    """``pack(part)`` and ``unpack(part, means)`` of a streamed exchange,
    each chunk recorded as a 'pack' ('cast' where the wire's dtype differs
    from a gradient's) and an 'unpack' span with its bytes, on
    ``timeline`` (on)."""
    itemsize = buffer.wire.itemsize
    name = 'cast' if any(d != buffer.layout.wire
                         for d in buffer.layout.dtypes) else 'pack'

    def packed(part):
        with timeline.span(name, 'comm', bucket=0,
                           bytes=(part.stop - part.start) * itemsize):
            pack(part)

    def unpacked(part, means):
        with timeline.span('unpack', 'comm', bucket=0,
                           bytes=(part.stop - part.start) * itemsize):
            unpack(part, means)
    return packed, unpacked


#: Colocated servers not yet known to have ended: at exit, this worker
#: says goodbye to those still open and waits for all of them, before
#: MPI is finalized under their threads.
_open_colocated = set()


@atexit.register
def _close_colocated_at_exit():
    # Every goodbye first, then the waits: a set's order differs between
    # processes, and a worker waiting for one communicator's threads
    # before saying goodbye to the next would wait for a worker doing the
    # same the other way round.
    still_open = list(_open_colocated)
    for servers in still_open:
        servers.close(wait=False)
    for servers in still_open:
        servers.close(wait=True)
