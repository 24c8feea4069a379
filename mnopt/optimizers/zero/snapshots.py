"""A sharded optimizer's snapshot: each rank's share of the state (what
it holds, writing and reading it), and re-sharding from every rank's
share on any number of ranks.

A share holds the update rules of this rank's pieces (partition.py),
under their parameters' names: ``t`` and the state arrays, flat, of the
piece's length.  ``mnopt_shard/size``, ``/rank`` say whose share it is and
``/names``, ``/lo``, ``/hi``, ``/ranks`` the whole partition, ``/write``
which write it belongs to (``write_id``: shares of two writes are never
mixed at load).  A share
written before parameters were split (whole-parameter ownership) has
``/owners`` instead of ``/lo`` ``/hi`` ``/ranks`` and its state arrays in
the parameters' shapes: it is read as pieces that cover whole parameters.
Re-sharding cuts and joins the saved pieces' arrays element by element,
so the state is the saved state bit for bit, on any number of ranks.
"""

import numpy

from mnopt.optimizers.protocol import StatesMayBeAbsent, digest
from mnopt.optimizers.shares import SHARD_KEY
from mnopt.optimizers.zero.partition import Piece, partition



def write_id(t, pieces, params):
    """The id of a write of a snapshot: the same on every rank of one
    write without a message, since it is made of what every rank holds
    alike (the optimizer's ``t``, the partition and the parameters, the
    same bytes on every rank after each update), and different for two
    writes of different state (a write at another update, or of another
    run)."""
    named = [(n, p.array) for n, p in sorted(params.items())
             if p.array is not None]
    return digest([('t', numpy.int64(t)),
                   ('pieces', numpy.array(repr(list(pieces))))] + named)


def write_share(serializer, communicator, pieces, params, t):
    """This rank's share of the state (``pieces``: the partition,
    ``params``: {name: parameter}, ``t``: the optimizer's) and whose share
    it is."""
    meta = serializer[SHARD_KEY]
    meta('size', communicator.size)
    meta('rank', communicator.rank)
    meta('write', numpy.array(write_id(t, pieces, params)))
    meta('names', numpy.array([p.name for p in pieces], dtype=str))
    for key in ('lo', 'hi', 'rank'):
        meta(key + 's' if key == 'rank' else key,
             numpy.array([getattr(p, key) for p in pieces], numpy.int64))
    for piece in pieces:
        if piece.rank == communicator.rank:
            rule = getattr(params[piece.name], 'update_rule', None)
            if rule is not None:
                rule.serialize(serializer[piece.name])


def _meta_of(read, sizes):
    """(size, rank, pieces, whether written by whole-parameter ownership,
    the write's id or None) from ``read(key)`` of the metadata (KeyError
    where absent); ``sizes``: {name: elements} of the model, for the old
    format's pieces."""
    size, rank = int(read('size')), int(read('rank'))
    names = [str(n) for n in read('names')]
    try:
        write = str(read('write'))
    except KeyError:   # written before writes had ids: loads as before
        write = None
    try:
        los = [int(x) for x in read('lo')]
    except KeyError:   # whole-parameter ownership
        owners = [int(o) for o in read('owners')]
        return size, rank, [Piece(n, 0, sizes.get(n, 0), o)
                            for n, o in zip(names, owners)], True, write
    his = [int(x) for x in read('hi')]
    ranks = [int(x) for x in read('ranks')]
    return size, rank, [Piece(*p) for p in zip(names, los, his, ranks)], \
        False, write


def read_meta(serializer, sizes):
    """What ``_meta_of`` says of the share a deserializer holds; None if
    it holds an unsharded optimizer's state."""
    meta = serializer[SHARD_KEY]
    try:
        size = meta('size', None)
    except KeyError:   # strict: an unsharded optimizer's snapshot
        size = None
    if size is None:   # (not strict: the key's absence reads as None)
        return None

    def read(key):
        value = meta(key, None)
        if value is None:
            raise KeyError(key)
        return value
    return _meta_of(read, sizes)


def mixed_writes(writes, where):
    """What is wrong with shares whose write ids are ``writes`` (None: a
    share written before writes had ids) found at ``where`` (a file name
    or a rank, one per share), or None where they are all of one write
    (shares without ids are of one write with each other only)."""
    if all(w == writes[0] for w in writes):
        return None
    groups = {}
    for w, at in zip(writes, where):
        groups.setdefault(w or 'none (an earlier mnopt)', []).append(
            str(at))
    return ('the shares are of %d different writes of the snapshot (%s): '
            'load every rank\'s share of one write, the files one '
            'multi_node_snapshot (or one save_npz on every rank) wrote '
            'at the same iteration' % (len(groups), '; '.join(
                'write %s: %s' % (w[:8], ', '.join(ats))
                for w, ats in groups.items())))


def coverage_problem(pieces, params):
    """What is wrong with ``pieces`` as a partition of ``params`` (every
    parameter with data covered exactly, in order), or None."""
    have = {n: p.array.size for n, p in params.items()
            if p.array is not None}
    covered = {}
    for p in pieces:
        if p.lo != covered.get(p.name, 0) or p.hi <= p.lo:
            return 'the pieces of %r do not follow each other' % p.name
        covered[p.name] = p.hi
    if covered != {n: s for n, s in have.items() if s}:
        extra = sorted(set(covered) - set(have))[:3]
        missing = sorted(n for n in have if covered.get(n) != have[n])[:3]
        return ('the snapshot\'s parameters are not the model\'s (only in '
                'the snapshot: %s; not as in the snapshot or without data '
                'in the model: %s)' % (extra, missing))
    return None


def _reset_others(params, pieces, rank):
    """Only a piece's rank holds state for it: rules of parameters this
    rank holds no piece of forget theirs (Chainer has no public reset:
    ``_state`` is UpdateRule's own attribute)."""
    mine = {p.name for p in pieces if p.rank == rank}
    for name, param in params.items():
        rule = getattr(param, 'update_rule', None)
        if rule is not None and name not in mine:
            rule._state = None


def load_share(serializer, meta, communicator, params):
    """Load this rank's share (``meta`` from ``read_meta``): (the pieces
    it was written with, None), or (them, why this rank cannot resume
    from it) having loaded nothing."""
    size, rank, pieces, whole, _ = meta
    comm = communicator
    problem = None
    if whole and size == comm.size:
        problem = ('the snapshot was written with whole parameters per '
                   'rank (an earlier mnopt); every rank re-shards it from '
                   'all %d shares (mnopt.zero.load_shards_of; '
                   'multi_node_snapshot\'s autoload and the ImageNet '
                   'example\'s --resume do)' % size)
    elif size != comm.size or rank != comm.rank:
        problem = ('the snapshot holds rank %d\'s share of an optimizer '
                   'sharded over %d ranks, and this is rank %d of %d: '
                   'each rank loads its own share on as many ranks, or '
                   'every rank re-shards from all %d shares '
                   '(mnopt.zero.load_shards; multi_node_snapshot\'s '
                   'autoload and the ImageNet example\'s --resume do)'
                   % (rank, size, comm.rank, comm.size, size))
    else:
        problem = coverage_problem(pieces, params)
    if problem is None:
        _reset_others(params, pieces, rank)
        for piece in pieces:
            rule = getattr(params[piece.name], 'update_rule', None)
            if piece.rank == rank and rule is not None:
                rule._state = None   # loaded as saved, the piece's shape
                # Written before the first applied update: t alone.
                rule.serialize(StatesMayBeAbsent(serializer[piece.name]))
    return pieces, problem


def _specs(params):
    return [(n, p.array.size, p.array.dtype.name)
            for n, p in sorted(params.items()) if p.array is not None]


def load_unsharded(serializer, communicator, params, previous):
    """Load a snapshot of an unsharded optimizer (every rank loads the
    same one, on any number of ranks): the partition is made now (the
    pieces of ``previous`` kept), and each rank keeps its pieces of the
    update rules' state.  Returns (pieces, None), or ([], why it
    cannot)."""
    missing = sorted(n for n, p in params.items() if p.array is None)
    if missing:
        return [], ('loading an unsharded snapshot needs every parameter '
                    'initialised (it decides who holds what); %s has no '
                    'data yet' % missing[0])
    pieces = partition(_specs(params), communicator.size, previous)
    rank = communicator.rank
    _reset_others(params, pieces, rank)
    for piece in pieces:
        rule = getattr(params[piece.name], 'update_rule', None)
        if piece.rank != rank or rule is None:
            continue
        rule._state = None
        # The whole parameter's (t alone before the first update).
        rule.serialize(StatesMayBeAbsent(serializer[piece.name]))
        if rule.state is not None:
            rule._state = {k: _cut(v, piece.lo, piece.hi)
                           for k, v in rule.state.items()}
    return pieces, None


def _cut(array, lo, hi):
    """Elements lo:hi of ``array``'s flat view, a copy."""
    return array.reshape(-1)[lo:hi].copy()


class _Shares(object):
    """Every rank's file of one sharded snapshot, opened as needed."""

    def __init__(self, shares, path, sizes):
        self.shares, self.path, self.sizes = shares, path, sizes
        self.opened, self.metas = {}, {}

    def __len__(self):
        return len(self.shares)

    def file(self, r):
        if r not in self.opened:
            f = self.shares[r]
            self.opened[r] = numpy.load(f) if isinstance(f, (str, bytes)) \
                or hasattr(f, '__fspath__') else f
        return self.opened[r]

    def name(self, r):
        """Share r's file name, or 'share r' for a mapping."""
        f = self.shares[r]
        return str(f.__fspath__() if hasattr(f, '__fspath__') else f) \
            if isinstance(f, (str, bytes)) or hasattr(f, '__fspath__') \
            else 'share %d' % r

    def meta(self, r):
        if r not in self.metas:
            f, key = self.file(r), self.path + SHARD_KEY + '/'
            if key + 'size' not in f:
                raise ValueError('share %d holds no sharded optimizer '
                                 'state under %r' % (r, self.path))
            self.metas[r] = _meta_of(lambda k: f[key + k], self.sizes)
        return self.metas[r]

    def value(self, r, name, key):
        """The array ``key`` of ``name``'s rule in share r, or None."""
        f, full = self.file(r), self.path + name.lstrip('/') + '/' + key
        return f[full] if full in f else None

    def state_keys(self, r, name):
        prefix = self.path + name.lstrip('/') + '/'
        return sorted(k[len(prefix):] for k in self.file(r).keys()
                      if k.startswith(prefix) and '/' not in
                      k[len(prefix):] and k != prefix + 't')

    def close(self):
        for r, f in self.opened.items():
            if f is not self.shares[r] and hasattr(f, 'close'):
                f.close()


def _joined_state(files, saved, piece):
    """(t, {key: flat array of the piece}) joined from the saved pieces of
    ``piece.name`` that overlap it; (t, None) where they hold no state."""
    overlaps = [p for p in saved if p.name == piece.name
                and p.lo < piece.hi and piece.lo < p.hi]
    first = overlaps[0].rank
    t = files.value(first, piece.name, 't')
    keys = files.state_keys(first, piece.name)
    if not keys:
        return t, None
    state = {}
    for key in keys:
        out = None
        for p in overlaps:
            value = files.value(p.rank, piece.name, key)
            if value is None:
                return t, None
            value = value.reshape(-1)
            if out is None:
                out = numpy.empty(piece.hi - piece.lo, value.dtype)
            lo, hi = max(p.lo, piece.lo), min(p.hi, piece.hi)
            out[lo - piece.lo:hi - piece.lo] = value[lo - p.lo:hi - p.lo]
        state[key] = out
    return t, state


def reshard(shares, path, communicator, params, actual):
    """Load this rank's pieces of a sharded snapshot from every rank's
    share (``shares``: paths of .npz files or mappings, rank 0's first;
    ``path``: the key prefix of the optimizer in them; ``actual``: the
    wrapped optimizer, whose ``t`` and ``epoch`` are loaded).  On as many
    ranks as wrote it (by elements), the saved partition; otherwise a
    fresh one for this number of ranks.  Returns (pieces, None, the
    write's id), or (None, what is wrong, None); raises if a file is missing or damaged."""
    from chainer.serializers import NpzDeserializer
    if path is None:
        raise ValueError('load_shards needs path= (the key prefix of the '
                         'optimizer in the files): no snapshot of it '
                         'was loaded yet')
    comm = communicator
    sizes = {n: p.array.size for n, p in params.items()
             if p.array is not None}
    files = _Shares(shares, path, sizes)
    try:
        size = len(files)
        for r in range(size):
            s, rank, pieces, _, _ = files.meta(r)
            if (s, rank) != (size, r):
                return None, ('share %d holds rank %d\'s share of %d ranks, '
                              'not rank %d\'s of %d' % (r, rank, s, r,
                                                         size)), None
        write = files.meta(0)[4]
        problem = mixed_writes([files.meta(r)[4] for r in range(size)],
                               [files.name(r) for r in range(size)])
        if problem is not None:
            return None, problem, None
        for r in range(size):
            if files.meta(r)[2] != files.meta(0)[2]:
                return None, ('shares 0 and %d were written by different '
                              'shardings (their partitions differ)' % r), \
                    None
        saved, whole = files.meta(0)[2:4]
        problem = coverage_problem(saved, params)
        if problem is not None:
            return None, problem, None
        pieces = saved if size == comm.size and not whole else \
            partition(_specs(params), comm.size)
        first = NpzDeserializer(files.file(0), path=path)
        actual.t = first('t', actual.t)
        actual.epoch = first('epoch', actual.epoch)
        _reset_others(params, pieces, comm.rank)
        for piece in pieces:
            rule = getattr(params[piece.name], 'update_rule', None)
            if piece.rank != comm.rank or rule is None:
                continue
            t, state = _joined_state(files, saved, piece)
            if t is not None:
                rule.t = int(t)
            rule._state = state
    finally:
        files.close()
    return pieces, None, write
