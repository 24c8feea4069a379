"""ShardLayout: where each rank's share of a set of arrays laid out by
owner lies, and the check that every rank passes the same set and shares
(mnopt/averaging/sharded.py's collectives run over these)."""

import hashlib

import numpy

from mnopt.transport import layouts
from mnopt.transport import agreement


def views(parts, lo, hi):
    """Views of ``parts`` covering range [lo, hi) of their concatenation
    (empty views left out)."""
    out, start = [], 0
    for part in parts:
        stop = start + part.size
        a, b = max(lo, start), min(hi, stop)
        if a < b:
            out.append(part[a - start:b - start])
        start = stop
    return out


class ShardLayout(object):
    """The arrays of one ``named`` set, their owners and where each rank's
    share lies in the packed gradient buffer (elements of the wire) and in
    the flat parameter buffer (bytes)."""

    def __init__(self, layout, arrays_per_rank, itemsizes, in_place=False):
        self.layout = layout
        #: Whether the collectives work on the arrays where they are (a
        #: list of parts) rather than on a packed copy: every rank must
        #: agree, the messages are cut differently.
        self.in_place = bool(in_place)
        self.arrays_per_rank = list(arrays_per_rank)
        n = len(self.arrays_per_rank)
        #: Array indices of rank r's share: first[r] .. first[r + 1] - 1.
        self.first = [0]
        for k in self.arrays_per_rank:
            self.first.append(self.first[-1] + k)
        offs = layout.offsets
        #: Wire elements of each rank's share, and where it starts.
        self.starts = [offs[self.first[r]] for r in range(n)]
        self.counts = [offs[self.first[r + 1]] - offs[self.first[r]]
                       for r in range(n)]
        #: Bytes of each array, of each rank's share, and where it starts.
        self.nbytes = [s * i for s, i in zip(layout.sizes, itemsizes)]
        self.byte_offsets = [0]
        for b in self.nbytes:
            self.byte_offsets.append(self.byte_offsets[-1] + b)
        self.byte_starts = [self.byte_offsets[self.first[r]]
                            for r in range(n)]
        self.byte_counts = [self.byte_offsets[self.first[r + 1]]
                            - self.byte_starts[r] for r in range(n)]
        h = hashlib.blake2b(repr((layout.key, self.arrays_per_rank,
                                  self.in_place)).encode(), digest_size=8)
        #: What every rank must agree on, as a 63-bit number.
        self.digest = int.from_bytes(h.digest(), 'little') >> 1
        self.grad_buffer = None   # GradBuffer, made at first use
        self.own_codec = None     # GPU: unpacks this rank's share
        self.device = {}          # pure_nccl's device buffers

    def own(self, rank):
        """Indices of the arrays ``rank`` owns."""
        return range(self.first[rank], self.first[rank + 1])

    def describe_difference(self, other):
        """A sentence naming how two ranks' layouts differ."""
        if self.layout.key != other.layout.key:
            return self.layout.first_difference(other.layout)
        if self.in_place != other.in_place:
            return ('the arrays are reduced in place on one rank and '
                    'packed on the other (numpy arrays on one, GPU arrays '
                    'on the other?)')
        return 'arrays per rank %s vs %s' % (self.arrays_per_rank,
                                             other.arrays_per_rank)


def arguments_problem(named, arrays_per_rank, size):
    """What is wrong with the arguments on this rank (a sentence), or
    None."""
    try:
        counts = [int(k) for k in arrays_per_rank]
    except (TypeError, ValueError):
        return 'arrays_per_rank must be whole numbers, not %r' % (
            arrays_per_rank,)
    if len(counts) != size or any(k < 0 for k in counts):
        return ('arrays_per_rank must give one count >= 0 per rank (%d), '
                'not %r' % (size, counts))
    if sum(counts) != len(named):
        return ('arrays_per_rank adds up to %d arrays but %d were given'
                % (sum(counts), len(named)))
    return None


def agree(comm, shards, problem):
    """Raise on every rank unless no rank has a ``problem`` (a sentence,
    or None) and every rank has the same ``shards`` (a ShardLayout, None
    where there is a problem).

    The common case costs one all-gather of two int64 per rank (a problem
    flag and the layout's digest), on the caller's hot path; only when
    something is wrong do the ranks tell each other what, in the
    agreement exchange (mnopt/transport/agreement.py), and every rank raises the
    same error from the same list."""
    mine = numpy.array([1 if problem else 0,
                        shards.digest if shards is not None else -1],
                       dtype=numpy.int64)
    everyone = agreement.numbers(comm, mine)
    if not everyone[:, 0].any() and (everyone[:, 1] == everyone[0, 1]).all():
        return
    details = agreement.everyone(comm, (problem, shards),
                                 'the sharded collective\'s check')
    bad = ['rank %d: %s' % (r, p) for r, (p, _) in enumerate(details) if p]
    if bad:
        raise ValueError('sharded collective: bad arguments on %s'
                         % '; '.join(bad))
    other = next(r for r in range(comm.size)
                 if details[r][1].digest != details[0][1].digest)
    raise layouts.LayoutMismatchError(
        'ranks would exchange shards that do not line up (rank 0 vs rank '
        '%d): %s. Every rank must pass the same arrays (names, shapes, '
        'dtypes), the same allreduce_grad_dtype and the same '
        'arrays_per_rank.' % (other, details[0][1].describe_difference(
            details[other][1])))
