"""The allreduce of wire buffers: mnopt's ring or MPI's Allreduce, chosen
by $MNOPT_ALLREDUCE and the buffer's size and span (``uses_ring``)."""

import contextlib

from mnopt.common import _env
from mnopt.transport import buffers
from mnopt.transport import cpu_phases
from mnopt.transport import reduce
from mnopt.transport import ring


#: MNOPT_ALLREDUCE: which allreduce sums float32/float64 buffers.
ALGORITHMS = ('auto', 'ring', 'mpi')
#: The context around a part's sum where none is asked for.
_NOTHING = contextlib.nullcontext()


def allreduce_algorithm():
    """$MNOPT_ALLREDUCE: 'ring' (mnopt/transport/ring.py), 'mpi' (the MPI
    library's Allreduce) or 'auto' (default: see ``uses_ring``)."""
    return _env.choice('MNOPT_ALLREDUCE', 'auto', ALGORITHMS)


#: auto: float32/float64 sums of at least this many bytes (in one call)
#: go round mnopt's ring when the ranks span several nodes.  Measured on
#: the simulated cluster (docs/results/netsim/ring.md, 250 Mbit/s, one
#: buffer): at 64 KiB MPI's Allreduce takes 1/3 of the ring's time at 8
#: and 16 nodes; from 256 KiB to 1 MiB they are even (0.97-1.12); at 4
#: MiB and up the ring is 1.4-2x faster at 4 to 16 nodes, even at 2.  On
#: ResNet-50's 102 MB the ring is even at 2 and 4 nodes and 1.10x/1.32x
#: faster at 8/16, and leaves the CPU 47-92% idle (2-8 nodes) where
#: MPICH's busy polling leaves none (so it is used from 2 nodes on).  Inside one
#: shared-memory node MPICH is faster below 16 MiB (3-8x at 64 KiB).
RING_MIN_BYTES = 1 << 20


def uses_ring(comm, wire, nbytes, algorithm=None):
    """Whether ``allreduce_sum_parts`` sums ``nbytes`` of ``wire`` over
    ``comm`` on mnopt's pipelined ring rather than with MPI's Allreduce
    (``ring_decision`` says when)."""
    if comm.size == 1:
        return False
    return ring_decision(comm.size, lambda: buffers.nodes_of(comm), wire,
                         nbytes, algorithm)


def ring_decision(size, nodes, wire, nbytes, algorithm=None):
    """Whether a sum of ``nbytes`` of ``wire`` over ``size`` ranks on
    ``nodes()`` nodes (a callable: asked only when it matters) runs on
    mnopt's ring.

    The 16-bit wires need a user op, for which MPICH falls back to a
    reduce + broadcast that moves the whole buffer log2(N) times each way
    (at 1 Gbit/s, 4 nodes, FP16 was slower than FP32): always the ring.
    float32/float64 (auto): the ring for sums of RING_MIN_BYTES and more
    across nodes, MPI's Allreduce for smaller ones (its latency is lower)
    and inside one shared-memory node (it sums through shared memory)."""
    algorithm = algorithm or allreduce_algorithm()
    if size == 1 or algorithm == 'mpi':
        return False
    if algorithm == 'ring' or wire in reduce.SUM_FUNCS:
        return True
    return nbytes >= RING_MIN_BYTES and nodes() > 1


def allreduce_sum(comm, array, wire, algorithm=None):
    """Sum a contiguous numpy wire array in place across ``comm`` (see
    ``allreduce_sum_parts``)."""
    allreduce_sum_parts(comm, [array], wire, algorithm)


def allreduce_sum_parts(comm, parts, wire, algorithm=None, divide=None,
                        divided=None, segment_bytes=None, around_part=None):
    """Sum each contiguous numpy wire array of ``parts`` in place across
    ``comm``: on mnopt's pipelined ring (mnopt/transport/ring.py; all
    parts in one ring) or with MPI's Allreduce (one call per part), as
    ``uses_ring``
    decides for their total size; ``algorithm`` overrides
    $MNOPT_ALLREDUCE.  Every rank ends with the same bits, and at two
    ranks both give the same bits (each element is one a + b).
    ``divide(view)``, where given, runs on every piece of the parts whose
    ``divided`` is False just before the sum first uses it.
    ``around_part(index, nbytes)``, where given, is a context manager
    around each part's own sum where the parts are summed one at a time
    (MPI's Allreduce, or nothing to sum at one rank): a timeline's span
    per part.  The ring sums all parts in one and does not use it.

    Sizes are not checked here: the communicators check their gradient
    layouts across ranks before summing."""
    if divided is None:
        divided = [True] * len(parts)
    # Each division is a phase of the thread's CPU (MNOPT_PROFILE_THREADS).
    divide = cpu_phases.timed('divide', divide)
    live = [(p, d) for p, d in zip(parts, divided) if p.size]
    if comm.size == 1:
        for i, (part, done) in enumerate(live):
            with _NOTHING if around_part is None else \
                    around_part(i, part.nbytes):
                if not done:
                    divide(part)
        return
    if not live:
        return
    parts, divided = [p for p, _ in live], [d for _, d in live]
    nbytes = sum(p.nbytes for p in parts)
    if uses_ring(comm, wire, nbytes, algorithm):
        ring.allreduce_sum_parts(comm, parts, wire, check=False,
                                 divide=divide, divided=divided,
                                 segment_bytes=segment_bytes)
        return
    buffers.allreduce_sum_parts(comm, parts, wire, divide, divided,
                                around_part)

