"""Who holds which elements: the parameters of each dtype, one after
another in name order, cut into one contiguous share per rank of equal
size (up to ``ALIGN`` elements), so that a parameter may span ranks; and
their layout by rank for the sharded collectives.

A ``Piece`` is the part of one parameter one rank holds: elements
``lo:hi`` of the parameter's flat (C-order) array.  The partition is
sticky: parameters that appear later are cut among the ranks on their
own, and the pieces of the earlier ones stay (their optimizer state lives
there).  Every rank computes the same partition from the same parameters.
"""

import collections

#: Every share but the last starts and ends on a multiple of this many
#: elements (64 bytes of float32): the largest rank's share is at most
#: total/N + ALIGN elements of each dtype.
ALIGN = 16

Piece = collections.namedtuple('Piece', 'name lo hi rank')


def share_size(total, n_ranks, align=ALIGN):
    """Elements of each rank's share of ``total`` (the last may hold
    fewer, and with few elements the last ranks none)."""
    per = -(-total // n_ranks)
    return -(-per // align) * align


def cut(named_sizes, n_ranks, align=ALIGN):
    """The pieces of ``[(name, elements), ...]`` (one dtype, in their
    order) cut into ``n_ranks`` contiguous shares of equal size."""
    total = sum(size for _, size in named_sizes)
    share = max(share_size(total, n_ranks, align), 1)
    pieces, start = [], 0
    for name, size in named_sizes:
        lo = 0
        while lo < size:
            rank = (start + lo) // share
            hi = min(size, (rank + 1) * share - start)
            pieces.append(Piece(name, lo, hi, rank))
            lo = hi
        start += size
    return pieces


def partition(named_specs, n_ranks, previous=None, align=ALIGN):
    """The pieces of ``[(name, elements, dtype name), ...]``: those of
    ``previous`` (an earlier partition over as many ranks) kept for the
    parameters it covers, the other parameters cut per dtype, each dtype
    in name order.  Deterministic: every rank computes the same."""
    sizes = {name: size for name, size, _ in named_specs}
    kept = [p for p in (previous or ()) if p.name in sizes]
    covered = {p.name for p in kept}
    by_dtype = collections.defaultdict(list)
    for name, size, dtype in sorted(named_specs):
        if name not in covered and size > 0:
            by_dtype[str(dtype)].append((name, size))
    pieces = list(kept)
    for dtype in sorted(by_dtype):
        pieces += cut(by_dtype[dtype], n_ranks, align)
    return pieces


def by_rank(pieces, n_ranks):
    """(pieces laid out by rank: rank 0's, then rank 1's..., each rank's
    in partition order; pieces per rank)."""
    order, per_rank = [], []
    for r in range(n_ranks):
        mine = [p for p in pieces if p.rank == r]
        order += mine
        per_rank.append(len(mine))
    return order, per_rank


def holders(pieces):
    """{name: ranks holding a piece of it, ascending}."""
    out = collections.defaultdict(list)
    for p in pieces:
        out[p.name].append(p.rank)
    return {n: tuple(sorted(set(r))) for n, r in out.items()}


def elements_per_rank(pieces, n_ranks):
    """Elements each rank holds (the state it keeps, per element)."""
    counts = [0] * n_ranks
    for p in pieces:
        counts[p.rank] += p.hi - p.lo
    return counts


def piece_label(piece):
    """The name the collectives know a piece by."""
    return '%s[%d:%d]' % (piece.name, piece.lo, piece.hi)
