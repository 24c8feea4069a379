"""After a ring reduce-scatter: stay in MPI until the left neighbour's
sends to this rank have completed.

MPICH completes a large send over shared memory only while its receiver
makes progress, that is, while the receiver is inside an MPI call.  A rank
that leaves the ring with its last message received and then computes
(ZeRO's update of its share) kept its left neighbour waiting on its last
sends until its next MPI call, one update's time, every step: both ranks
then paid the update twice.  Here each rank tells its right neighbour once
its own sends are done, and waits to hear the same from its left one;
inside that wait it makes the progress the left one's sends need.  One
empty message each way per call; the bits of the sums do not change."""

import numpy

from mnopt.transport import waiting

#: Apart from the ring's own messages (ring.TAG) and hierarchical's.
TAG = 0x5AA

_EMPTY = numpy.empty(0, numpy.uint8)


def drained(comm, ring):
    """Run ``ring()`` (this rank's part of a ring reduce-scatter), then
    drain.  Where it raises, the right neighbour is told anyway (not
    waited for), so that it leaves its drain and meets the failure where
    mnopt's stall detection names this rank, as it did before drains."""
    try:
        ring()
    except BaseException:
        if comm.size > 1:
            comm.Isend(_EMPTY, (comm.rank + 1) % comm.size, TAG)
        raise
    drain(comm)


def drain(comm):
    """Return once this rank's left neighbour has finished its sends of
    the ring just run (every rank of ``comm`` calls it after the ring)."""
    n = comm.size
    if n < 2:
        return
    right, left = (comm.rank + 1) % n, (comm.rank - 1) % n
    # Nothing is written into an empty receive: one buffer serves both.
    waiting.wait_all([comm.Isend(_EMPTY, right, TAG),
                      comm.Irecv(_EMPTY, left, TAG)])
