"""Who owns which parameter: whole parameters, balanced by bytes, and
their layout by owner.

Ownership: the largest first, each to the rank with the fewest bytes so
far (ties by name, then lowest rank), and sticky: a parameter keeps its
owner (where its state lives) when parameters appear later.
"""


def assign_owners(named_nbytes, n_ranks, previous=None):
    """{name: rank} for ``[(name, nbytes), ...]``.

    Names in ``previous`` (an earlier assignment) keep their rank: their
    optimizer state lives there.  The others go, largest first (ties by
    name), each to the rank owning the fewest bytes so far (ties: the
    lowest rank): every rank's share is within the largest parameter of
    the mean.  Deterministic: every rank computes the same."""
    previous = previous or {}
    load = [0] * n_ranks
    owners = {}
    for name, nbytes in named_nbytes:
        if name in previous and previous[name] < n_ranks:
            owners[name] = previous[name]
            load[owners[name]] += nbytes
    for name, nbytes in sorted(named_nbytes, key=lambda x: (-x[1], x[0])):
        if name not in owners:
            rank = min(range(n_ranks), key=lambda r: (load[r], r))
            owners[name] = rank
            load[rank] += nbytes
    return owners


def layout_by_owner(owners, n_ranks):
    """(names laid out by owner: rank 0's, sorted, then rank 1's...,
    arrays per rank)."""
    order, per_rank = [], []
    for r in range(n_ranks):
        mine = sorted(n for n, o in owners.items() if o == r)
        order += mine
        per_rank.append(len(mine))
    return order, per_rank

