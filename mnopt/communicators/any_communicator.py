"""Agreements for the pieces that take any ChainerMN-like communicator
(evaluators, extensions, iterators): over mnopt's private duplicate where
the communicator is mnopt's (``comm.everyone``,
mnopt/transport/agreement.py), so they never share the user's
communicator; over the communicator's own ``allgather_obj`` otherwise, as
ChainerMN's versions do.  Every rank holds the same kind of communicator,
so every rank takes the same path."""

from mnopt.transport import agreement


def everyone(comm, value, what):
    """``[rank 0's value, rank 1's, ...]`` on every rank."""
    if hasattr(comm, 'everyone'):
        return comm.everyone(value, what)
    return comm.allgather_obj(value)


def raise_together(comm, problem, what):
    """If any rank's ``problem`` is an exception, raise on every rank:
    that rank its own, the others a RuntimeError naming each rank's
    (agreement.raise_together)."""
    if hasattr(comm, 'raise_together'):
        return comm.raise_together(problem, what)
    agreement.settle(problem, comm.allgather_obj(agreement.describe(problem)),
                     what)


def same_on_every_rank(comm, what, value):
    """Raise ValueError on every rank unless every rank passed the same
    ``value`` (agreement.unequal names every rank's); otherwise return it.
    The iterators check their arguments with it once, at creation."""
    message = agreement.unequal(everyone(comm, value, what), what)
    if message:
        raise ValueError(message)
    return value
