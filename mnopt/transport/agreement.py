"""Agreement: ranks decide alike because each sees what every rank said.

Multi-rank code goes wrong where each rank decides on its own about shared
state: which snapshot files to keep, which write to load, which settings
are in force, whether to go on after one rank's argument was bad.  The
remedy is always the same: exchange what each rank knows, then let every
rank compute the same decision from the same list.  This module is that
exchange (``everyone``; ``numbers`` for the cheap fixed-size first step of
a check made on every call) and the decisions built on it (``settle``,
``raise_together``, ``same``, ``unequal``, ``common``); every "same error
on every rank" check and every shared choice goes through here.

The exchange is two non-blocking collectives (the sizes, then the pickled
values), waited for with stall detection (``stall_wait.wait_or_abort``):
a rank that never arrives is reported and, after the timeout, ends the
job.
Collectives never match a user's point-to-point receive, whatever its tag
or source.
"""

import pickle

import numpy

_MISSING = object()


def everyone(comm, value, what, stall_warning=None, timeout=None,
             exchange=None):
    """``[rank 0's value, rank 1's value, ...]`` on every rank of the
    mpi4py communicator ``comm``.  ``value`` must pickle; ``what`` names
    the exchange in a stall report.

    Every rank must be in the same exchange, named by ``exchange``
    (default ``what``): ranks in different ones (a trigger, a condition or
    an exception that differs between ranks put them there) would take
    each other's values for their own and decide on them, so every rank
    raises a RuntimeError naming each rank's exchange instead."""
    # Imported here: importing mpi4py.MPI starts MPI, which importing
    # mnopt's Chainer layer (which uses this module) must not.
    from mpi4py import MPI
    from mnopt.transport import stall_wait
    try:
        data = numpy.frombuffer(pickle.dumps(
            (what if exchange is None else exchange, value),
            pickle.HIGHEST_PROTOCOL), numpy.uint8)
        problem = None
    except Exception as e:   # pickling runs the value's own code
        data, problem = numpy.empty(0, numpy.uint8), e
    # A size of -1 says "mine does not pickle": every rank learns it in
    # the first exchange and raises, instead of waiting in the second.
    sizes = numpy.empty(comm.size, numpy.int64)
    stall_wait.wait_or_abort(
        [comm.Iallgather(numpy.array([-1 if problem else data.size],
                                     numpy.int64), sizes)],
        what, stall_warning, timeout)
    if problem is not None:
        raise problem
    unpicklable = [r for r, n in enumerate(sizes) if n < 0]
    if unpicklable:
        raise RuntimeError('%s: the value of rank(s) %s could not be pickled'
                           % (what, ', '.join(map(str, unpicklable))))
    counts = [int(n) for n in sizes]
    displacements = [sum(counts[:r]) for r in range(comm.size)]
    gathered = numpy.empty(sum(counts), numpy.uint8)
    stall_wait.wait_or_abort(
        [comm.Iallgatherv([data, MPI.BYTE],
                          [gathered, (counts, displacements), MPI.BYTE])],
        what, stall_warning, timeout)
    said = [pickle.loads(gathered[d:d + n].tobytes())
            for d, n in zip(displacements, counts)]
    if any(name != said[0][0] for name, _ in said):
        raise RuntimeError(
            'the ranks are in different exchanges (%s): every rank must '
            "make mnopt's exchanges in the same order; a trigger, a "
            'condition or an exception that differs between ranks puts '
            'them out of step' % '; '.join(
                'rank %d in %r' % (r, name)
                for r, (name, _) in enumerate(said)))
    return [v for _, v in said]


def numbers(comm, mine, wait=None):
    """Every rank's int64 ``mine`` (the same count on every rank), as a
    (ranks, count) array: one all-gather of fixed size, nothing pickled,
    no stall watch of its own.  The cheap first step of a check made on
    every call (a digest per rank; the details exchanged with ``everyone``
    only when they differ).  A non-blocking Allgather that
    ``wait([request])`` waits for (default ``waiting.wait_all``).

    Not MPI's blocking Allgather: this is where ranks wait for each
    other's compute (the first exchange of a bucket waits for the
    slowest rank's backward), and MPICH's blocking calls spin on the
    core meanwhile, which a rank beside it (more ranks than cores, or
    the training thread beside an averaging thread) needed."""
    from mnopt.transport import waiting
    mine = numpy.asarray(mine, dtype=numpy.int64).reshape(-1)
    said = numpy.empty((comm.size, mine.size), dtype=numpy.int64)
    (wait or waiting.wait_all)([comm.Iallgather(mine, said)])
    return said


def describe(problem):
    """One line for an exception (or None)."""
    if problem is None:
        return None
    return '%s: %s' % (type(problem).__name__, problem)


def raise_together(comm, problem, what, stall_warning=None, timeout=None):
    """Every rank learns every rank's ``problem`` (an exception or None);
    if any rank had one, every rank raises: that rank its own exception,
    the others a RuntimeError naming each rank's problem.  ``what`` is
    the operation, as the error says it ("create_communicator('flat')
    failed on rank 1: ...")."""
    settle(problem, everyone(comm, describe(problem), what, stall_warning,
                             timeout), what)


def settle(problem, said, what, error=RuntimeError,
           message='%s failed on %s'):
    """What every rank does once it has every rank's ``describe``d
    problem (``said``, in rank order): raise its own ``problem``, else an
    ``error`` naming each rank's (``message % (what, 'rank 1: ...; rank
    2: ...')``), else nothing."""
    if problem is not None:
        raise problem
    failed = ['rank %d: %s' % (r, p) for r, p in enumerate(said)
              if p is not None]
    if failed:
        raise error(message % (what, '; '.join(failed)))


def disagreement(values, what):
    """The message for settings dicts (one per rank) that differ, naming
    each differing setting and every rank's value of it; None when they
    agree."""
    names = sorted(set().union(*values), key=str)
    differ = [k for k in names
              if any(v.get(k, _MISSING) != values[0].get(k, _MISSING)
                     for v in values)]
    if not differ:
        return None
    return 'ranks disagree on %s: %s' % (what, '; '.join(
        '%s (%s)' % (k, ', '.join(
            'rank %d: %s' % (r, repr(v[k]) if k in v else 'not set')
            for r, v in enumerate(values)))
        for k in differ))


def unequal(values, what):
    """The message for values (one per rank) that are not all equal,
    naming every rank's value; None when they are equal."""
    if any(v != values[0] for v in values):
        return 'ranks disagree on %s: %s' % (what, ', '.join(
            'rank %d: %r' % rv for rv in enumerate(values)))
    return None


def same(comm, settings, what, problem=None, stall_warning=None,
         timeout=None):
    """Raise ValueError on every rank unless every rank passed equal
    ``settings`` (a dict); the error names each setting that differs and
    every rank's value.  Returns ``settings``.

    ``problem``: this rank's exception found checking them (or None),
    raised as ``raise_together`` raises it, in the same exchange."""
    said = everyone(comm, (describe(problem), dict(settings)), what,
                    stall_warning, timeout)
    settle(problem, [p for p, _ in said], what)
    message = disagreement([s for _, s in said], what)
    if message:
        raise ValueError(message)
    return settings


def common(comm, items, what, stall_warning=None, timeout=None):
    """The items (hashable) that every rank holds, sorted: a choice among
    things some ranks may lack (snapshot files, checkpoints) that every
    rank makes alike."""
    held = everyone(comm, sorted(set(items)), what, stall_warning, timeout)
    shared = set(held[0]).intersection(*held[1:])
    return sorted(shared)


def quickest(comm, seconds, what, stall_warning=None, timeout=None):
    """The choice among candidates that every rank timed (``seconds``:
    this rank's time of each, the same count on every rank): each
    candidate's time is its slowest rank's, and the quickest of those
    wins (the first of equals).  Returns ``(index, slowest)``, the same
    on every rank whatever each rank measured: every rank computes it
    from the same list."""
    said = everyone(comm, [float(s) for s in seconds], what, stall_warning,
                    timeout)
    message = unequal([len(s) for s in said],
                      '%s (the number of candidates timed)' % what)
    if message:
        raise RuntimeError(message)
    slowest = [max(times) for times in zip(*said)]
    return slowest.index(min(slowest)), slowest
