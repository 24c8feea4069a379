"""Deep copies of links that hold a communicator share it.

A communicator owns MPI communicators, threads and buffers: it cannot be
copied, and a copy of a model (``link.copy(mode='copy')``,
``copy.deepcopy``, ``create_mnbn_model``) must talk to the same ranks as
the original anyway.
"""

import copy


def deepcopy_sharing(obj, memo, *shared):
    """A deep copy of ``obj`` (a plain object: its ``__dict__`` is its
    state) in which the objects ``shared`` are the originals."""
    for item in shared:
        memo.setdefault(id(item), item)
    new = object.__new__(type(obj))
    memo[id(obj)] = new
    for key, value in obj.__dict__.items():
        new.__dict__[key] = copy.deepcopy(value, memo)
    return new
