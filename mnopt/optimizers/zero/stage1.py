"""ZeRO stage 1 (``shard_state=True``): the multi-node step with the
optimizer state sharded; each rank updates its pieces of the parameters
(an equal share of their elements: partition.py)."""

import chainer

from mnopt.common.arrays import named_grads
from mnopt.optimizers.hook_agreement import check_hooks_agree, hook_settings
from mnopt.optimizers.local_steps_mark import not_local_steps
from mnopt.optimizers.protocol import AVERAGE, BROADCAST, RESUME
from mnopt.optimizers.protocol import MultiNodeOptimizer, digest, stepped
from mnopt.optimizers.zero import snapshots
from mnopt.optimizers.zero.owned_update import PieceUpdate
from mnopt.optimizers.zero.owned_update import optimizer_problem
from mnopt.optimizers.zero.owned_update import update_pieces
from mnopt.optimizers.zero.partition import by_rank, holders, partition
from mnopt.optimizers.zero.partition import piece_label


def flat_grads(target):
    """{name: the flat (C-contiguous) gradient} of every parameter with
    data (zeros where it has none), each a view of ``param.grad``."""
    out = {}
    for name, grad in named_grads(target, True):
        out[name] = grad
    params = dict(target.namedparams())
    for name, grad in out.items():
        if not grad.flags.c_contiguous:
            grad = params[name].grad = grad.copy()   # C order
        out[name] = grad.reshape(-1)
    return out


def flat_array(param):
    """``param.array`` flat, a view (the array made C-contiguous first)."""
    if not param.array.flags.c_contiguous:
        param.array = param.array.copy()
    return param.array.reshape(-1)


class ShardedStateOptimizer(MultiNodeOptimizer):
    """ChainerMN's multi-node optimizer semantics (the first update, and
    any after the parameter set changed, broadcasts rank 0's parameters and
    applies nothing), with the optimizer state sharded (see
    mnopt/optimizers/zero/__init__.py).

    A snapshot of it holds this rank's share only (``mnopt_shard/size``,
    ``/rank``, ``/names``, ``/lo``, ``/hi``, ``/ranks`` say whose): every
    rank saves its own and loads its own, on the same number of ranks; on
    another number, every rank re-shards from all the shares
    (``load_shards``), else the next update is an error on every rank.  A snapshot of an unsharded
    optimizer loads on any number of ranks, each rank keeping its share of
    it."""

    def __init__(self, actual_optimizer, communicator, zero_fill):
        super(ShardedStateOptimizer, self).__init__(
            actual_optimizer, communicator, zero_fill)
        # From now on the communicator refuses a comm hook, which the
        # sharded collectives would never call.
        communicator.add_sharded_optimizer(self)
        object.__setattr__(self, '_pieces', [])   # partition.Piece's
        # {Piece: PieceUpdate} of this rank's pieces, kept across steps.
        object.__setattr__(self, '_piece_updates', {})
        # After a load: (pieces from the snapshot, problem or None).
        object.__setattr__(self, '_loaded_share', None)
        # After a load of a sharded snapshot: (its size, its rank), and the
        # key prefix the optimizer was loaded under (load_shards' default).
        object.__setattr__(self, '_loaded_shape', None)
        object.__setattr__(self, '_loaded_path', None)
        # The id of the write the loaded share(s) came from (None: an
        # unsharded snapshot, or a share written before writes had ids).
        object.__setattr__(self, '_loaded_write', None)

    def setup(self, link):
        super(ShardedStateOptimizer, self).setup(link)
        object.__setattr__(self, '_pieces', [])
        object.__setattr__(self, '_piece_updates', {})
        return self

    # ------------------------------------------------------------ plan
    @property
    def pieces(self):
        """The partition: ``[Piece(name, lo, hi, rank), ...]``, rank
        ``rank`` holding elements lo:hi of parameter ``name`` (flat).
        After a load, the loaded one ([] where this rank cannot resume
        from what it loaded: ``needs_shards``)."""
        loaded = self._loaded_share
        if loaded is not None:
            return list(loaded[0]) if loaded[1] is None else []
        return list(self._pieces)

    @property
    def owners(self):
        """{name: the ranks holding a piece of it} (of ``pieces``)."""
        return holders(self.pieces)

    def _plan(self):
        """(pieces laid out by rank, pieces per rank) for the parameters
        with data; new parameters are cut among the ranks
        (``partition``)."""
        specs = [(n, p.array.size, p.array.dtype.name) for n, p in
                 sorted(self.target.namedparams()) if p.array is not None]
        size = self.communicator.size
        object.__setattr__(self, '_pieces',
                           partition(specs, size, self._pieces))
        return by_rank(self._pieces, size)

    def owned_names(self):
        """The names of the parameters this rank holds a piece of."""
        rank = self.communicator.rank
        return sorted({p.name for p in self._pieces if p.rank == rank})

    def state_nbytes(self):
        """Bytes of optimizer state this rank holds (every update rule's
        state arrays)."""
        total = 0
        for param in self.target.params():
            rule = getattr(param, 'update_rule', None)
            state = None if rule is None else rule.state
            for value in (state or {}).values():
                total += getattr(value, 'nbytes', 0)
        return total

    # ------------------------------------------------------------ steps
    def _agree_step(self, pending):
        """``(step, whether any rank is pending)`` in the step's one
        exchange, as the unsharded optimizer's (``_next_step`` is the step
        alone; stage 2's ``pending``: gradients left to reduce-scatter
        after backward), plus: every rank's problems (an unsupported
        hook, a snapshot of another sharding) are raised on every rank,
        and a snapshot must be loaded on every rank or on none."""
        loaded, changed = self._take_param_set()
        problem = optimizer_problem(self.actual_optimizer)
        if loaded and problem is None and self._loaded_share is not None:
            problem = self._loaded_share[1]
        votes = self.communicator.everyone(
            (loaded, changed, problem, bool(pending), self._take_resumed(),
             hook_settings(self.actual_optimizer)),
            'the sharded optimizer\'s next step')
        self._check_resumed([v[4] for v in votes])
        check_hooks_agree([v[5] for v in votes])
        anyone_pending = any(v[3] for v in votes)
        bad = ['rank %d: %s' % (r, v[2]) for r, v in enumerate(votes)
               if v[2]]
        if bad:
            raise ValueError('sharded optimizer: %s' % '; '.join(bad))
        if any(v[0] for v in votes):
            if not all(v[0] for v in votes):
                raise RuntimeError(
                    'a sharded optimizer\'s snapshot holds one rank\'s share '
                    'of the state: every rank must load its own (ranks %s '
                    'loaded one, ranks %s did not)'
                    % ([r for r, v in enumerate(votes) if v[0]],
                       [r for r, v in enumerate(votes) if not v[0]]))
            return RESUME, anyone_pending
        if any(v[1] != changed for v in votes):
            raise RuntimeError(
                'the parameter set changed on ranks %s but not on ranks %s; '
                'every rank must add or initialise parameters at the same '
                'update' % ([r for r, v in enumerate(votes) if v[1]],
                            [r for r, v in enumerate(votes) if not v[1]]))
        return BROADCAST if changed else AVERAGE, anyone_pending

    def _make_replicas_agree(self):
        """After every rank loaded its share: the owners from the
        snapshots (the same on every rank, checked); rank 0's parameters
        where they differ.  True if they were the same everywhere."""
        comm = self.communicator
        pieces = self._loaded_share[0] if self._loaded_share else []
        mine = (digest(self._named_params()), repr(pieces),
                self._loaded_write)
        digests = comm.everyone(mine, 'the digests of the replicas')
        mixed = snapshots.mixed_writes(
            [d[2] for d in digests], ['rank %d' % r for r in
                                      range(len(digests))])
        if mixed is not None:
            raise RuntimeError('sharded optimizer: %s' % mixed)
        if any(d[1] != digests[0][1] for d in digests):
            raise RuntimeError(
                'the loaded snapshots were written by different shardings '
                '(their partitions differ): load every rank\'s share '
                'of one snapshot')
        object.__setattr__(self, '_pieces', list(pieces))
        object.__setattr__(self, '_loaded_share', None)
        same = all(d[0] == digests[0][0] for d in digests)
        if not same:
            comm.bcast_data(self.target)
        return same

    @stepped
    def update(self, lossfun=None, *args, **kwds):
        if lossfun is not None:
            self._backward(lossfun, args, kwds)
        step = self._next_step()
        comm = self.communicator
        if step is BROADCAST:
            comm.bcast_data(self.target)
            self._plan()
            return
        if step is RESUME and not self._make_replicas_agree():
            self._plan()
            return
        order, per_rank = self._plan()
        params = dict(self.target.namedparams())
        # Every parameter with data takes part (zeros where it has no
        # gradient): its pieces' ranks must receive their means.
        flat = flat_grads(self.target)
        self._blocked(comm.reduce_scatter_mean,
                      [(piece_label(p), flat[p.name][p.lo:p.hi])
                       for p in order], per_rank)
        mine = self.take_own_means(params, flat)
        del flat
        self._update_pieces(mine)
        self._allgather(params, order, per_rank)

    def take_own_means(self, params, flat):
        """{name: this rank's piece's mean gradient, flat} from ``flat``
        (name: flat gradient).  A parameter this rank holds whole keeps
        its gradient (the mean); the others' are dropped: what is left of
        them is not a mean (their memory is free until the next
        backward), and a piece's mean is copied out of it."""
        rank, mine = self.communicator.rank, {}
        for p in self._pieces:
            if p.rank == rank:
                whole = p.lo == 0 and p.hi == flat[p.name].size
                mine[p.name] = flat[p.name] if whole else \
                    flat[p.name][p.lo:p.hi].copy()
        for name in flat:
            whole = name in mine and mine[name].size == flat[name].size
            if not whole:
                params[name].cleargrad()
        return mine

    def _allgather(self, params, order, per_rank):
        """Every rank's pieces of the parameters to every rank."""
        arrays = {}
        for p in order:
            if p.name not in arrays:
                arrays[p.name] = flat_array(params[p.name])
        self._blocked(self.communicator.allgather_params,
                      [(piece_label(p), arrays[p.name][p.lo:p.hi])
                       for p in order], per_rank)

    def _update_pieces(self, means):
        """Chainer's GradientMethod.update after the backward, on this
        rank's pieces only (``means``: {name: the piece's mean gradient};
        mnopt/optimizers/zero/owned_update.py)."""
        pieces = self._piece_updates_for_step()
        for p in pieces:
            p.take(means[p.piece.name])
        try:
            with self._timeline().span('update', 'compute'):
                update_pieces(self.actual_optimizer, self.communicator,
                              self.target, pieces)
        finally:
            for p in pieces:
                p.release()

    def _piece_updates_for_step(self):
        """This rank's PieceUpdate's, partition order: those of the last
        step where they still view their parameter's piece, new ones
        for the others (a new partition, a parameter's new array)."""
        params = dict(self.target.namedparams())
        rank = self.communicator.rank
        kept, pieces = self._piece_updates, []
        for piece in self._pieces:
            if piece.rank != rank:
                continue
            param = params[piece.name]
            update = kept.get(piece)
            if update is None or not update.fits(param, piece):
                update = PieceUpdate(param, piece)
            pieces.append(update)
        object.__setattr__(self, '_piece_updates',
                           {p.piece: p for p in pieces})
        return pieces

    # ------------------------------------------------------------ snapshots
    def _serialize_state(self, serializer):
        """This rank's share: the optimizer's ``t`` and ``epoch``, the
        update rules of the parameters it owns, and whose share it is
        (mnopt/optimizers/zero/snapshots.py)."""
        actual = self.actual_optimizer
        comm = self.communicator
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        actual.t = serializer('t', actual.t)
        actual.epoch = serializer('epoch', actual.epoch)
        params = dict(self.target.namedparams())
        if not loading:
            snapshots.write_share(serializer, comm, self._pieces, params,
                                  actual.t)
            return
        meta = snapshots.read_meta(not_local_steps(serializer), {
            n: p.array.size for n, p in params.items()
            if p.array is not None})
        object.__setattr__(self, '_loaded_write',
                           None if meta is None else meta[4])
        if meta is None:   # an unsharded optimizer's snapshot
            object.__setattr__(self, '_loaded_shape', None)
            object.__setattr__(self, '_loaded_share',
                               snapshots.load_unsharded(serializer, comm,
                                                        params, self._pieces))
            return
        object.__setattr__(self, '_loaded_path', getattr(serializer, 'path',
                                                         None))
        object.__setattr__(self, '_loaded_share', snapshots.load_share(
            serializer, meta, comm, params))
        object.__setattr__(self, '_loaded_shape', (meta[0], meta[1]))

    def needs_shards(self):
        """The number of ranks whose shares the last loaded snapshot was
        written by, where this rank cannot resume from the share it loaded
        (another rank's, or another number of ranks): every share must then
        be given to ``load_shards``.  None otherwise."""
        shape = self._loaded_shape
        if self._loaded_share is None or shape is None or \
                self._loaded_share[1] is None:
            return None
        return shape[0]

    def load_shards(self, shares, path=None):
        """Re-shard a sharded snapshot: ``shares`` are every rank's files
        of it (paths of .npz files, or mappings as ``numpy.load`` gives),
        rank 0's first; ``path`` the key prefix of the optimizer in them
        (default: the one it was last loaded under, e.g.
        ``updater/optimizer:main/``).  On as many ranks as wrote it, the
        saved partition; on another number (or a snapshot of
        whole-parameter ownership), a fresh partition for this number of
        ranks, and this rank joins, for each of its pieces, the update
        rule's ``t`` and state (Adam's m and v...) from the saved pieces
        that overlap it: cut and joined element by element, never
        recomputed, so it is the saved state bit for bit.

        Every parameter must be initialised.  No communication: each rank
        reads only the files holding elements of its pieces, so every
        rank must see them (a shared directory).  Returns None, or what is
        wrong (a share missing, of another snapshot...), which the next
        update also raises on every rank."""
        comm = self.communicator
        problem = None
        try:
            pieces, problem, write = snapshots.reshard(
                shares, self._loaded_path if path is None else path, comm,
                dict(self.target.namedparams()), self.actual_optimizer)
        except Exception as e:   # a file missing or damaged
            problem = '%s: %s' % (type(e).__name__, e)
        if problem is None:
            object.__setattr__(self, '_loaded_share', (pieces, None))
            object.__setattr__(self, '_loaded_shape', (comm.size, comm.rank))
            object.__setattr__(self, '_loaded_write', write)
        else:
            object.__setattr__(self, '_loaded_share',
                               ([], 'cannot re-shard: %s' % problem))
        self._mark_loaded()
        return problem
