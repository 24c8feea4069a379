"""Sharded optimizer state (ZeRO stage 1): ``create_multi_node_optimizer(
opt, comm, shard_state=True)``.

Every parameter has one owner rank.  Each update:

1. the mean gradients reach their owners only: one reduce-scatter of the
   packed gradient buffer laid out by owner (``comm.reduce_scatter_mean``);
2. each rank runs the wrapped optimizer's hooks and update rules on the
   parameters it owns, so only the owner's update rule ever holds state
   (Adam's m and v, momentum...); the other parameters' gradients are
   dropped (None) once packed: they are not means, and their memory is
   free until the next backward;
3. the updated parameters come back to every rank: one all-gather of the
   flat parameter buffer (``comm.allgather_params``), bytes as the owner
   has them, so the replicas stay identical.

Ownership: whole parameters, balanced by bytes (the largest first, each to
the rank with the fewest bytes so far; ties by name, then lowest rank),
and sticky: a parameter keeps its owner (where its state lives) when
parameters appear later.  docs/zero.md has the design and the numbers.

Stage 2 (``shard_state=True, overlap=True``: ShardedGradsOptimizer): step
1 happens during backward instead, bucket by bucket as overlap's nodes
find the gradients final (``comm.reduce_scatter_mean_async``), and each
bucket's gradients of other ranks' parameters are freed once it is
reduced, so backward holds this rank's gradients and a few buckets, not
every gradient.
"""

import chainer
import numpy
from chainer.optimizer_hooks import GradientClipping
from mpi4py import MPI

from mnopt import overlap
from mnopt.arrays import named_grads
from mnopt.optimizers import _AVERAGE, _BROADCAST, _LOADED, _RESUME
from mnopt.optimizers import _MultiNodeOptimizer, _digest

#: Serializer group holding a shard's metadata in snapshots.
SHARD_KEY = 'mnopt_shard'


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


def _optimizer_hooks(optimizer, timing):
    """The optimizer's hooks of ``timing`` as (name, hook), in the order
    Chainer calls them.

    Chainer 7 keeps them in ``optimizer._hookable`` and has no public
    accessor; they are only read here, never changed."""
    hookable = optimizer._hookable
    return list((hookable._pre_update_hooks if timing == 'pre'
                 else hookable._post_update_hooks).items())


def optimizer_problem(optimizer):
    """Why ``optimizer`` cannot have its state sharded (a sentence), or
    None: its update must be Chainer's per-parameter one."""
    if not isinstance(optimizer, chainer.optimizer.GradientMethod) or \
            type(optimizer).update is not \
            chainer.optimizer.GradientMethod.update:
        return ('shard_state needs an optimizer whose update is per '
                'parameter (a chainer.GradientMethod that keeps its '
                'update(), as SGD, MomentumSGD, Adam, AdaGrad, RMSprop do); '
                '%s is not one' % type(optimizer).__name__)
    if getattr(optimizer, '_loss_scaling_is_dynamic', False):
        return ('shard_state does not support dynamic loss scaling: it '
                'decides from every gradient whether to skip an update; '
                'use a fixed loss_scaling(scale=...)')
    if optimizer.target is None:
        return None
    for timing in ('pre', 'post'):
        for name, hook in _optimizer_hooks(optimizer, timing):
            if getattr(hook, 'call_for_each_param', False):
                continue
            if type(hook) is GradientClipping and timing == 'pre':
                continue
            return ('shard_state runs per-parameter hooks (WeightDecay, '
                    'Lasso, GradientHardClipping...) and GradientClipping; '
                    'hook %r (%s) looks at every parameter at once and '
                    'would see only this rank\'s share'
                    % (name, type(hook).__name__))
    return None


def _reallocate_cleared_grads(params):
    """GradientMethod.reallocate_cleared_grads on ``params`` only (the
    owned ones: the others' gradients stay dropped): zeros where a hook
    cleared a gradient."""
    for param in params:
        if param.array is not None and param.grad is None:
            with chainer.using_device(param.device):
                param.grad = param.device.xp.zeros_like(param.array)


class ShardedStateOptimizer(_MultiNodeOptimizer):
    """ChainerMN's multi-node optimizer semantics (the first update, and
    any after the parameter set changed, broadcasts rank 0's parameters and
    applies nothing), with the optimizer state sharded (see the module).

    A snapshot of it holds this rank's share only (``mnopt_shard/size``,
    ``/rank``, ``/names``, ``/owners`` say whose): every rank saves its own
    and loads its own, on the same number of ranks; on another number,
    every rank re-shards from all the shares (``load_shards``), else the
    next update is an error on every rank.  A snapshot of an unsharded
    optimizer loads on any number of ranks, each rank keeping its share of
    it."""

    def __init__(self, actual_optimizer, communicator, zero_fill):
        super(ShardedStateOptimizer, self).__init__(
            actual_optimizer, communicator, zero_fill)
        object.__setattr__(self, 'owners', {})  # name -> rank
        # After a load: (owners from the snapshot, problem or None).
        object.__setattr__(self, '_loaded_share', None)
        # After a load of a sharded snapshot: (its size, its rank), and the
        # key prefix the optimizer was loaded under (load_shards' default).
        object.__setattr__(self, '_loaded_shape', None)
        object.__setattr__(self, '_loaded_path', None)

    def setup(self, link):
        super(ShardedStateOptimizer, self).setup(link)
        object.__setattr__(self, 'owners', {})
        return self

    # ------------------------------------------------------------ plan
    def _plan(self):
        """(names laid out by owner, arrays per rank) for the parameters
        with data; new parameters get owners (``assign_owners``)."""
        params = [(n, p.array.nbytes) for n, p in
                  sorted(self.target.namedparams()) if p.array is not None]
        size = self.communicator.size
        owners = assign_owners(params, size, self.owners)
        object.__setattr__(self, 'owners', owners)
        return layout_by_owner(owners, size)

    def owned_names(self):
        """The names of the parameters this rank updates."""
        rank = self.communicator.rank
        return sorted(n for n, r in self.owners.items() if r == rank)

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
    def _next_step(self):
        """As the unsharded optimizer's, plus: every rank's problems (an
        unsupported hook, a snapshot of another sharding) are raised on
        every rank, and a snapshot must be loaded on every rank or on
        none."""
        loaded = self._param_set is _LOADED
        current = self._current_param_set()
        changed = not loaded and current != self._param_set
        object.__setattr__(self, '_param_set', current)
        problem = optimizer_problem(self.actual_optimizer)
        if loaded and problem is None and self._loaded_share is not None:
            problem = self._loaded_share[1]
        votes = self.communicator.everyone(
            (loaded, changed, problem), 'the sharded optimizer\'s next step')
        bad = ['rank %d: %s' % (r, p) for r, (_, _, p) in enumerate(votes)
               if p]
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
            return _RESUME
        if any(v[1] != changed for v in votes):
            raise RuntimeError(
                'the parameter set changed on ranks %s but not on ranks %s; '
                'every rank must add or initialise parameters at the same '
                'update' % ([r for r, v in enumerate(votes) if v[1]],
                            [r for r, v in enumerate(votes) if not v[1]]))
        return _BROADCAST if changed else _AVERAGE

    def _make_replicas_agree(self):
        """After every rank loaded its share: the owners from the
        snapshots (the same on every rank, checked); rank 0's parameters
        where they differ.  True if they were the same everywhere."""
        comm = self.communicator
        owners = self._loaded_share[0] if self._loaded_share else {}
        mine = (_digest(self._named_params()),
                repr(sorted(owners.items())))
        digests = comm.everyone(mine, 'the digests of the replicas')
        if any(d[1] != digests[0][1] for d in digests):
            raise RuntimeError(
                'the loaded snapshots were written by different shardings '
                '(their parameter owners differ): load every rank\'s share '
                'of one snapshot')
        object.__setattr__(self, 'owners', owners)
        object.__setattr__(self, '_loaded_share', None)
        same = all(d[0] == digests[0][0] for d in digests)
        if not same:
            comm.bcast_data(self.target)
        return same

    def update(self, lossfun=None, *args, **kwds):
        if lossfun is not None:
            self._backward(lossfun, args, kwds)
        step = self._next_step()
        comm = self.communicator
        if step is _BROADCAST:
            comm.bcast_data(self.target)
            self._plan()
            return
        if step is _RESUME and not self._make_replicas_agree():
            self._plan()
            return
        order, per_rank = self._plan()
        params = dict(self.target.namedparams())
        # Every parameter with data takes part (zeros where it has no
        # gradient): its owner must receive its mean.
        grads = dict(named_grads(self.target, True))
        self._blocked(comm.reduce_scatter_mean,
                      [(n, grads[n]) for n in order], per_rank)
        del grads
        # The other ranks' gradients were packed and are not means: drop
        # them (their memory is free until the next backward, and nobody
        # reads a gradient that is not the mean).
        for name in order:
            if self.owners[name] != comm.rank:
                params[name].cleargrad()
        self._update_owned()
        self._blocked(comm.allgather_params,
                      [(n, params[n].array) for n in order], per_rank)

    def _update_owned(self):
        """Chainer's GradientMethod.update after the backward, on this
        rank's parameters only."""
        actual = self.actual_optimizer
        rank = self.communicator.rank
        owned = [p for n, p in self.target.namedparams()
                 if self.owners.get(n) == rank]
        _reallocate_cleared_grads(owned)
        self._call_hooks('pre', owned)
        actual.t += 1
        for param in owned:
            param.update()
        _reallocate_cleared_grads(owned)
        self._call_hooks('post', owned)

    def _call_hooks(self, timing, owned):
        actual = self.actual_optimizer
        for _, hook in _optimizer_hooks(actual, timing):
            if getattr(hook, 'call_for_each_param', False):
                for param in owned:
                    hook(param.update_rule, param)
            else:   # GradientClipping (optimizer_problem refuses others)
                self._clip_by_global_norm(hook.threshold, owned)
            _reallocate_cleared_grads(owned)

    def _clip_by_global_norm(self, threshold, owned):
        """GradientClipping with the norm of every mean gradient: each
        parameter's squared norm comes from its owner (one small
        allreduce, each entry from one rank: exact), and they are summed
        in Chainer's order and dtype, so the rate is the unsharded one,
        bit for bit.  The owners then scale their gradients."""
        params = [(n, p) for n, p in self.target.namedparams()
                  if p.array is not None]
        rank = self.communicator.rank
        squares = numpy.zeros(len(params), numpy.float64)
        dtypes = []
        for k, (name, param) in enumerate(params):
            dtypes.append(param.grad.dtype if param.grad is not None
                          else param.array.dtype)
            if self.owners.get(name) == rank:
                g = param.grad.ravel()
                squares[k] = float(g.dot(g))
        squares = numpy.asarray(
            chainer.backend.CpuDevice().send(
                self.communicator.allreduce(squares)))
        # GradientClipping: sum(dots), each dot in its gradient's dtype.
        sqnorm = sum(numpy.dtype(d).type(s) for d, s in zip(dtypes, squares))
        rate = threshold / numpy.sqrt(sqnorm)
        if rate >= 1:
            return
        for param in owned:
            grad = param.grad
            with chainer.using_device(param.device):
                grad *= rate

    # ------------------------------------------------------------ snapshots
    def _serialize_state(self, serializer):
        """This rank's share: the optimizer's ``t`` and ``epoch``, the
        update rules of the parameters it owns, and whose share it is."""
        actual = self.actual_optimizer
        comm = self.communicator
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        actual.t = serializer('t', actual.t)
        actual.epoch = serializer('epoch', actual.epoch)
        meta = serializer[SHARD_KEY]
        params = dict(self.target.namedparams())
        if not loading:
            names = sorted(self.owners)
            meta('size', comm.size)
            meta('rank', comm.rank)
            meta('names', numpy.array(names, dtype=str))
            meta('owners', numpy.array([self.owners[n] for n in names],
                                       dtype=numpy.int64))
            for name in self.owned_names():
                rule = getattr(params[name], 'update_rule', None)
                if rule is not None:
                    rule.serialize(serializer[name])
            return
        try:
            size = meta('size', None)
        except KeyError:   # strict: an unsharded optimizer's snapshot
            size = None
        if size is None:   # (not strict: the key's absence reads as None)
            object.__setattr__(self, '_loaded_shape', None)
            self._load_unsharded(serializer, params)
            return
        size = int(size)
        rank = int(meta('rank', None))
        names = [str(n) for n in meta('names', None)]
        owner_list = [int(o) for o in meta('owners', None)]
        object.__setattr__(self, '_loaded_path', getattr(serializer, 'path',
                                                         None))
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
        object.__setattr__(self, '_loaded_share', (owners, problem))
        object.__setattr__(self, '_loaded_shape', (size, rank))

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
        ``updater/optimizer:main/``).  On as many ranks as wrote it, this
        rank loads its own share; on another number, the owners are
        assigned anew for this number of ranks (as a fresh run's) and this
        rank loads, for each parameter it now owns, that parameter's
        update rule (``t`` and state: Adam's m and v...) from the share of
        the rank that owned it.  The per-parameter state is moved whole,
        never recomputed, so it is the saved state bit for bit.

        Every parameter must be initialised.  No communication: each rank
        reads only the files of its parameters' previous owners, so every
        rank must see them (a shared directory).  Returns None, or what is
        wrong (a share missing, of another snapshot...), which the next
        update also raises on every rank."""
        problem = None
        try:
            problem = self._load_shards(shares, path)
        except Exception as e:   # a file missing or damaged
            problem = '%s: %s' % (type(e).__name__, e)
        if problem is not None:
            object.__setattr__(self, '_loaded_share',
                               ({}, 'cannot re-shard: %s' % problem))
        object.__setattr__(self, '_param_set', _LOADED)
        return problem

    def _load_shards(self, shares, path):
        from chainer.serializers import NpzDeserializer
        path = self._loaded_path if path is None else path
        if path is None:
            raise ValueError('load_shards needs path= (the key prefix of the '
                             'optimizer in the files): no snapshot of it '
                             'was loaded yet')
        comm = self.communicator
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
                    return ('share %d holds rank %d\'s share of %d ranks, '
                            'not rank %d\'s of %d' % (r, rank, s, r, size))
                if (names, owner_list) != meta(0)[2:]:
                    return ('shares 0 and %d were written by different '
                            'shardings (their owners differ)' % r)
            names, owner_list = meta(0)[2:]
            params = dict(self.target.namedparams())
            have = sorted(n for n, p in params.items() if p.array is not None)
            if have != sorted(names):
                return ('the snapshot\'s parameters are not the model\'s '
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
            actual = self.actual_optimizer
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
        object.__setattr__(self, '_loaded_share', (owners, None))
        object.__setattr__(self, '_loaded_shape', (comm.size, comm.rank))
        return None

    def _load_unsharded(self, serializer, params):
        """A snapshot of an unsharded optimizer (every rank loads the same
        one, on any number of ranks): the owners are assigned now, and
        each rank loads the update rules of its share only."""
        missing = sorted(n for n, p in params.items() if p.array is None)
        if missing:
            object.__setattr__(self, '_loaded_share', ({}, (
                'loading an unsharded snapshot needs every parameter '
                'initialised (it decides who owns what); %s has no data '
                'yet' % missing[0])))
            return
        owners = assign_owners(
            [(n, p.array.nbytes) for n, p in sorted(params.items())],
            self.communicator.size, self.owners)
        rank = self.communicator.rank
        for name in sorted(owners):
            rule = getattr(params[name], 'update_rule', None)
            if owners[name] == rank and rule is not None:
                rule.serialize(serializer[name])
        object.__setattr__(self, '_loaded_share', (owners, None))


class _ShardedOverlap(overlap.Overlap):
    """Overlap's machinery (mnopt/overlap.py) for stage 2: a bucket is
    reduce-scattered to its parameters' owners as soon as backward has
    finished every gradient in it, and the gradients of the other ranks'
    parameters are let go as soon as that is done.

    The node of a planned parameter takes its gradient (a copy, as
    overlap's: Chainer may share the array it passes) and gives the
    parameter none, so Chainer drops its own array at once instead of
    holding every parameter's gradient until backward ends.  A bucket
    holds its arrays laid out by owner (rank 0's, then rank 1's...: plan
    order within each) and goes to ``reduce_scatter_mean_async``; the
    copies of other ranks' parameters are referenced by that job only,
    so they are freed when its reduce-scatter ends."""

    #: Buckets in flight at most: launching one more first waits for the
    #: oldest (whose other ranks' gradients are then freed), so that a
    #: backward faster than the network holds a few buckets' copies, not
    #: every gradient.
    max_in_flight = 2

    def __init__(self, communicator, target, owners):
        super(_ShardedOverlap, self).__init__(communicator, target, True)
        self._owners = owners   # () -> {name: rank}

    def _reset(self):
        super(_ShardedOverlap, self)._reset()
        self.oldest = 0      # handles before it have been waited for
        self.seen = {}       # planning: name -> the array its node got
        self.fired = set()   # names whose node took the gradient
        self.extra = set()   # of those, also used outside their link
        self.vouched = set()

    def _ready(self, name, grad):
        if self.wraps.get(name) != 1:
            return None
        if self.plan is None:
            self.seen[name] = grad   # Chainer holds it anyway
            return None
        if name not in self._bucket_of:
            return None
        self.early[name] = grad.copy()
        self.fired.add(name)
        b = self._bucket_of[name]
        self.remaining[b] -= 1
        while (self.next_bucket < len(self.plan)
               and self.remaining[self.next_bucket] == 0):
            self._launch(self.next_bucket, {})
        return False   # the parameter gets no gradient from Chainer

    def _scatter(self, named):
        """Queue the reduce-scatter of ``named`` laid out by owner."""
        owners, size = self._owners(), self.comm.size
        named = sorted(named, key=lambda x: owners[x[0]])   # stable
        per_rank = [0] * size
        for name, _ in named:
            per_rank[owners[name]] += 1
        while len(self.handles) - self.oldest >= self.max_in_flight:
            self.handles[self.oldest].wait()
            self.oldest += 1
        self.handles.append(self.comm.reduce_scatter_mean_async(
            named, per_rank))

    def _launch(self, b, params):
        owners, rank = self._owners(), self.comm.rank
        named = []
        for name in self.plan[b]:
            if name in self.early:
                grad = self.early[name] if owners[name] == rank \
                    else self.early.pop(name)   # the job's alone
            else:   # unused by its link this time: zeros, or what
                grad = self._grad(params[name])   # a use outside gave
            if grad is not None:
                named.append((name, grad))
        self._scatter(named)
        self.next_bucket += 1

    def finish(self):
        """Queue the buckets backward did not finish, then one
        reduce-scatter of the rest: the parameters outside the plan, and
        the gradients that planned parameters got from a use outside
        their link (added to the mean in ``adopt``).  Returns the
        handles."""
        params = self._params()
        covered = self._launch_remaining(params)
        if self.plan is None:
            # Planning: a node vouches for a parameter whose final
            # gradient is the array it received.
            self.vouched = {n for n, g in self.seen.items()
                            if params[n].grad is g}
            self.seen = {}
        self.stats['buckets'] = 0 if self.plan is None else len(self.plan)
        self.extra = {n for n in self.fired if params[n].grad is not None}
        rest = [n for n in sorted(params) if params[n].array is not None
                and (n not in covered or n in self.extra)]
        self._scatter([(n, g) for n, g in ((n, self._grad(params[n]))
                                           for n in rest) if g is not None])
        return self.handles

    def adopt(self):
        """Once every handle is done: this rank's parameters get their
        means, the others' gradients are dropped."""
        owners, rank = self._owners(), self.comm.rank
        for name, param in self._params().items():
            if owners.get(name) != rank:
                param.grad = None
                continue
            mean = self.early.get(name)
            if mean is not None:
                if name in self.extra:   # mean of the link's + the rest's
                    mean += param.grad
                param.grad = mean
        self.early, self.fired, self.extra = {}, set(), set()

    def make_plan(self):
        """From the planning iteration: parameters its nodes vouched for,
        in forward order."""
        params = self._params()
        self._set_plan([(n, params[n].array.nbytes)
                        for n, k in self.wraps.items()
                        if k == 1 and n in self.vouched])
        self.vouched = set()


class ShardedGradsOptimizer(ShardedStateOptimizer):
    """ZeRO stage 2 (``shard_state=True, overlap=True``): the optimizer
    state and the gradients are sharded.  During ``update(lossfun, ...)``'s
    backward each bucket of gradients goes to its parameters' owners in a
    reduce-scatter as soon as backward has finished it, and the other
    ranks' gradients are freed then, so a rank holds its own gradients
    and the buckets in flight rather than every gradient.  The owners
    then update and the parameters are all-gathered, as in stage 1
    (``ShardedStateOptimizer``, whose snapshots, hooks and checks it
    keeps).  ``update()`` without a loss function is stage 1's.

    The first update broadcasts; the next one (the planning iteration)
    reduce-scatters after backward, as stage 1, and makes the plan of
    buckets (checked the same on every rank); from the third on, buckets
    leave during backward."""

    def __init__(self, actual_optimizer, communicator, zero_fill):
        super(ShardedGradsOptimizer, self).__init__(
            actual_optimizer, communicator, zero_fill)
        object.__setattr__(self, '_overlap', None)

    def setup(self, link):
        super(ShardedGradsOptimizer, self).setup(link)
        object.__setattr__(self, '_overlap', _ShardedOverlap(
            self.communicator, link, lambda: self.owners))
        return self

    @property
    def overlap_stats(self):
        """{'buckets': n, 'during_backward': k}: of the last update's n
        buckets, k were reduce-scattered during backward."""
        return dict(self._overlap.stats)

    def _wait_all(self, handles, quiet=False):
        """Wait for every handle; then raise the first error unless
        ``quiet``."""
        first = None
        for handle in handles:
            try:
                self._blocked(handle.wait)
            except Exception as e:
                first = first or e
        if first is not None and not quiet:
            raise first

    def update(self, lossfun=None, *args, **kwds):
        if lossfun is None:
            return super(ShardedGradsOptimizer, self).update(
                None, *args, **kwds)
        loaded = self._loaded_share
        if loaded is not None and loaded[1] is None and loaded[0]:
            # The snapshot's owners (checked the same on every rank at
            # this update), before any bucket leaves for its owner.
            object.__setattr__(self, 'owners', dict(loaded[0]))
        ov, actual, comm = self._overlap, self.actual_optimizer, \
            self.communicator
        try:
            ov.forward_backward(lossfun, args, kwds, actual._loss_scale,
                                actual.t)
            order, per_rank = self._plan()   # owners of new parameters
            used = dict(self.owners)
            handles = ov.finish()
        except Exception:
            # A bucket's error (every rank has it) or the loss's: nothing
            # is left running.
            self._wait_all(ov.handles, quiet=True)
            raise
        try:
            step = self._next_step()
        except Exception:
            # Every rank raises this; what is in flight fails or ends
            # alike: wait for it, so that nothing is left running.
            self._wait_all(handles, quiet=True)
            raise
        self._wait_all(handles)
        ov.adopt()
        if step is _BROADCAST:
            ov.forget_plan()
            comm.bcast_data(self.target)
            self._plan()
            return
        if step is _RESUME and (not self._make_replicas_agree() or any(
                self.owners.get(n) != r for n, r in used.items())):
            # Other weights' gradients, or sent to other owners than the
            # snapshot's: nothing applied (as after a broadcast).
            ov.forget_plan()
            self._plan()
            for name, param in self.target.namedparams():
                if self.owners.get(name) != comm.rank:
                    param.cleargrad()
            return
        if ov.plan is None:
            ov.make_plan()
        self._update_owned()
        params = dict(self.target.namedparams())
        self._blocked(comm.allgather_params,
                      [(n, params[n].array) for n in order], per_rank)


def sharded_optimizers(target):
    """The sharded optimizers in ``target``: a trainer, an updater, or an
    optimizer itself."""
    if isinstance(target, ShardedStateOptimizer):
        return [target]
    updater = getattr(target, 'updater', target)
    optimizers = getattr(updater, 'get_all_optimizers', None)
    if optimizers is None:
        return []
    return [o for _, o in sorted(optimizers().items())
            if isinstance(o, ShardedStateOptimizer)]


def load_shards_of(target, share_file):
    """After every rank loaded ``target`` (a trainer, updater or optimizer)
    from a snapshot file of its own: each sharded optimizer in it that
    cannot resume from the share it loaded (another number of ranks wrote
    the snapshot) re-shards from every rank's file, ``share_file(r)`` for
    rank r of the ranks that wrote it (``load_shards``).  Returns the
    problems, [] if none (the next update raises them on every rank)."""
    problems = []
    for optimizer in sharded_optimizers(target):
        size = optimizer.needs_shards()
        if size is not None:
            problem = optimizer.load_shards(
                [share_file(r) for r in range(size)])
            if problem is not None:
                problems.append(problem)
    return problems


def create(actual_optimizer, communicator, zero_fill, grads=False):
    """The sharded optimizer (``grads``: stage 2, the gradients sharded
    too), or a ValueError saying why it cannot be."""
    problem = communicator.sharding_problem() or \
        optimizer_problem(actual_optimizer)
    if problem is None and grads and \
            MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        problem = ('shard_state with overlap reduce-scatters gradients on '
                   'a background thread during backward, which needs '
                   'MPI_THREAD_MULTIPLE; this MPI was initialised with a '
                   'lower thread level')
    if problem is not None:
        raise ValueError(problem)
    cls = ShardedGradsOptimizer if grads else ShardedStateOptimizer
    return cls(actual_optimizer, communicator, zero_fill)
