"""A sharded optimizer's snapshot: each rank's share of the state (what
it holds, writing and reading it), and re-sharding from every rank's
share on another number of ranks.

A share holds the update rules of the parameters its rank owns, under
their names, and whose share it is: ``mnopt_shard/size``, ``/rank``,
``/names``, ``/owners``.  The functions read and write the serializer and
the parameters' update rules; the optimizer keeps what they return.
"""

import numpy

from mnopt.optimizers.zero.ownership import assign_owners

#: Serializer group holding a shard's metadata in snapshots.
SHARD_KEY = 'mnopt_shard'


def write_share(serializer, communicator, owners, params):
    """This rank's share of the state (``owners``: {name: rank}, ``params``:
    {name: parameter}) and whose share it is."""
    meta = serializer[SHARD_KEY]
    names = sorted(owners)
    meta('size', communicator.size)
    meta('rank', communicator.rank)
    meta('names', numpy.array(names, dtype=str))
    meta('owners', numpy.array([owners[n] for n in names],
                               dtype=numpy.int64))
    rank = communicator.rank
    for name in sorted(n for n, r in owners.items() if r == rank):
        rule = getattr(params[name], 'update_rule', None)
        if rule is not None:
            rule.serialize(serializer[name])


def read_meta(serializer):
    """(size, rank, names, owners as a list) of the share a deserializer
    holds; None if it holds an unsharded optimizer's state."""
    meta = serializer[SHARD_KEY]
    try:
        size = meta('size', None)
    except KeyError:   # strict: an unsharded optimizer's snapshot
        size = None
    if size is None:   # (not strict: the key's absence reads as None)
        return None
    size = int(size)
    rank = int(meta('rank', None))
    names = [str(n) for n in meta('names', None)]
    owner_list = [int(o) for o in meta('owners', None)]
    return size, rank, names, owner_list


def load_share(serializer, meta, communicator, params):
    """Load this rank's share (``meta`` from ``read_meta``): (the owners
    it was written with, None), or (them, why this rank cannot resume
    from it) having loaded nothing."""
    size, rank, names, owner_list = meta
    comm = communicator
    problem = None
    if size != comm.size or rank != comm.rank:
        problem = ('the snapshot holds rank %d\'s share of an optimizer '
                   'sharded over %d ranks, and this is rank %d of %d: '
                   'each rank loads its own share on as many ranks, or '
                   'every rank re-shards from all %d shares '
                   '(mnopt.zero.load_shards; multi_node_snapshot\'s '
                   'autoload and the ImageNet example\'s --resume do)'
                   % (rank, size, comm.rank, comm.size, size))
    owners = dict(zip(names, owner_list))
    if problem is None:
        for name in names:
            if owners[name] == rank and name in params:
                rule = getattr(params[name], 'update_rule', None)
                if rule is not None:
                    rule.serialize(serializer[name])
    return owners, problem


def load_unsharded(serializer, communicator, params, previous):
    """Load a snapshot of an unsharded optimizer (every rank loads the
    same one, on any number of ranks): the owners are assigned now (names
    in ``previous`` keep theirs), and each rank loads the update rules of
    its share only.  Returns (owners, None), or ({}, why it cannot)."""
    missing = sorted(n for n, p in params.items() if p.array is None)
    if missing:
        return {}, ('loading an unsharded snapshot needs every parameter '
                    'initialised (it decides who owns what); %s has no data '
                    'yet' % missing[0])
    owners = assign_owners(
        [(n, p.array.nbytes) for n, p in sorted(params.items())],
        communicator.size, previous)
    rank = communicator.rank
    for name in sorted(owners):
        rule = getattr(params[name], 'update_rule', None)
        if owners[name] == rank and rule is not None:
            rule.serialize(serializer[name])
    return owners, None


def reshard(shares, path, communicator, params, actual):
    """Load this rank's part of a sharded snapshot from every rank's share
    (``shares``: paths of .npz files or mappings, rank 0's first; ``path``:
    the key prefix of the optimizer in them; ``actual``: the wrapped
    optimizer, whose ``t`` and ``epoch`` are loaded).  On as many ranks as
    wrote it, the saved owners; on another number, owners assigned anew.
    Returns (owners, None), or (None, what is wrong); raises if a file is
    missing or damaged."""
    from chainer.serializers import NpzDeserializer
    if path is None:
        raise ValueError('load_shards needs path= (the key prefix of the '
                         'optimizer in the files): no snapshot of it '
                         'was loaded yet')
    comm = communicator
    opened, metas = {}, {}

    def share(r):
        if r not in opened:
            f = shares[r]
            opened[r] = numpy.load(f) if isinstance(f, (str, bytes)) or \
                hasattr(f, '__fspath__') else f
        return opened[r]

    def meta(r):
        if r not in metas:
            f, key = share(r), path + SHARD_KEY + '/'
            if key + 'size' not in f:
                raise ValueError('share %d holds no sharded optimizer '
                                 'state under %r' % (r, path))
            metas[r] = (int(f[key + 'size']), int(f[key + 'rank']),
                        [str(n) for n in f[key + 'names']],
                        [int(o) for o in f[key + 'owners']])
        return metas[r]

    try:
        size = len(shares)
        for r in range(size):
            s, rank, names, owner_list = meta(r)
            if (s, rank) != (size, r):
                return None, ('share %d holds rank %d\'s share of %d ranks, '
                              'not rank %d\'s of %d' % (r, rank, s, r, size))
            if (names, owner_list) != meta(0)[2:]:
                return None, ('shares 0 and %d were written by different '
                              'shardings (their owners differ)' % r)
        names, owner_list = meta(0)[2:]
        have = sorted(n for n, p in params.items() if p.array is not None)
        if have != sorted(names):
            return None, ('the snapshot\'s parameters are not the model\'s '
                          '(only in the snapshot: %s; only in the model or '
                          'without data: %s)'
                          % (sorted(set(names) - set(have))[:3],
                             sorted(set(params) - set(names))[:3]))
        saved = dict(zip(names, owner_list))
        if size == comm.size:
            owners = saved
        else:
            owners = assign_owners(
                [(n, params[n].array.nbytes) for n in have], comm.size)
        first = NpzDeserializer(share(0), path=path)
        actual.t = first('t', actual.t)
        actual.epoch = first('epoch', actual.epoch)
        for name in sorted(params):
            rule = getattr(params[name], 'update_rule', None)
            if rule is None:
                continue
            if owners.get(name) != comm.rank:
                # Only owners hold state (a rule that held some under
                # another ownership would be stale).  Chainer has no
                # public reset: _state is UpdateRule's own attribute.
                rule._state = None
                continue
            rule.serialize(NpzDeserializer(
                share(saved[name]), path=path)[name])
    finally:
        for r, f in opened.items():
            if f is not shares[r] and hasattr(f, 'close'):
                f.close()
    return owners, None
