"""The multi-node optimizer: averages gradients, then lets the wrapped
Chainer optimizer update.  Uses only the communicator's public API."""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any

import chainer
import numpy

from mnopt.arrays import named_grads

if TYPE_CHECKING:
    from mnopt.communicators.base import CommunicatorBase


_LOADED = object()  # _param_set after a snapshot was loaded

# What an update does, agreed by every rank (_MultiNodeOptimizer._next_step).
_BROADCAST = 'broadcast'   # rank 0's parameters to all; nothing applied
_RESUME = 'resume'         # after a load: _make_replicas_agree, then as
#                            _AVERAGE if the parameters already agreed
_AVERAGE = 'average'       # the mean gradient applied


def _host(array):
    """``array`` as a numpy array (a copy only when it lives elsewhere)."""
    return numpy.ascontiguousarray(chainer.backend.CpuDevice().send(array))


def _digest(named_arrays):
    """A short digest of ``[(name, array), ...]``: names, dtypes, shapes
    and bytes.  Equal digests on two ranks mean equal values, bit for
    bit."""
    h = hashlib.blake2b(digest_size=16)
    for name, array in named_arrays:
        host = _host(array)
        h.update(repr((name, host.dtype.str, host.shape)).encode())
        # An object array's bytes are pointers: hash what they point to.
        h.update(repr(host.tolist()).encode() if host.dtype.hasobject
                 else host.tobytes())
    return h.hexdigest()


def _state_of(serialize):
    """What ``serialize(serializer)`` writes, as {key: numpy array}."""
    state = {}
    serialize(chainer.serializers.DictionarySerializer(state))
    return state


class _MultiNodeOptimizer(object):
    """ChainerMN's semantics: the first update (and any update after the
    parameter set changed) broadcasts the parameters from rank 0 and applies
    nothing; every other update applies the mean gradient.

    The first update after a snapshot was loaded (on any rank) gives every
    rank rank 0's parameters and optimizer state where they differ, so
    replicas cannot diverge.  It then applies the mean gradient if the
    parameters were the same everywhere (a run resumed from one snapshot
    on every rank continues bit for bit), and nothing if they had to be
    broadcast (some ranks' gradients were of other weights: as after any
    broadcast)."""

    def __init__(self, actual_optimizer, communicator, zero_fill):
        object.__setattr__(self, 'actual_optimizer', actual_optimizer)
        object.__setattr__(self, 'communicator', communicator)
        object.__setattr__(self, 'zero_fill', zero_fill)
        object.__setattr__(self, '_param_set', None)
        #: Seconds the caller has spent blocked in gradient averaging.
        object.__setattr__(self, 'communication_time', 0.0)

    def _blocked(self, fn, *args):
        """Run ``fn`` and add its duration to ``communication_time``."""
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            object.__setattr__(self, 'communication_time',
                               self.communication_time
                               + time.perf_counter() - start)

    def setup(self, link):
        self.actual_optimizer.setup(link)
        # A new target: its first update broadcasts, as ChainerMN's does.
        object.__setattr__(self, '_param_set', None)
        return self

    def _backward(self, lossfun, args, kwds):
        target = self.target
        loss = lossfun(*args, **kwds)
        if getattr(self.actual_optimizer, '_use_cleargrads', True):
            target.cleargrads()
        else:
            target.zerograds()
        loss.backward(loss_scale=self.actual_optimizer._loss_scale)

    def _current_param_set(self):
        return [(name, p.array is not None)
                for name, p in sorted(self.target.namedparams())]

    def serialize(self, serializer):
        """The wrapped optimizer's state (with its target).  After a load
        the next update makes the replicas agree (see the class): a
        snapshot loaded on every rank resumes bit for bit, one loaded on
        rank 0 alone (model, optimizer or both) is given to every rank.

        Also this rank's part of the communicator's compression state
        (``serialize_compression``; with ``compression='sign'``, its
        error-feedback residuals), apart from ``_serialize_state``: it
        differs from rank to rank, so it is not part of the state the
        replicas agree on."""
        self._serialize_state(serializer)   # waits for double buffering
        self.communicator.serialize_compression(
            serializer['mnopt_compression'], shared=False)
        if isinstance(serializer, chainer.serializer.Deserializer):
            # Chainer's updater loads the optimizer before the model, so the
            # parameters may not have their data yet: the next update takes
            # whatever set it finds as the current one.
            object.__setattr__(self, '_param_set', _LOADED)

    def _serialize_state(self, serializer):
        """What a snapshot of this optimizer holds, the same on every
        rank: the wrapped optimizer's state and the communicator's shared
        compression state (with ``compression='sign'``, its averaging
        counter, which drives warm-up and the votes' coin)."""
        self.actual_optimizer.serialize(serializer)
        self.communicator.serialize_compression(
            serializer['mnopt_compression'], local=False)

    def _next_step(self):
        """What this update does (_BROADCAST, _RESUME or _AVERAGE), agreed
        by every rank: _RESUME if any rank loaded a snapshot since its last
        update, else _BROADCAST on the first update and whenever parameters
        appeared, disappeared or got their data since the previous one.

        Ranks must agree: one that re-broadcasts while the others average
        would hang the job, so a parameter set that changed on some ranks
        only is an error on every rank.
        """
        loaded = self._param_set is _LOADED
        current = self._current_param_set()
        changed = not loaded and current != self._param_set
        object.__setattr__(self, '_param_set', current)
        votes = self.communicator.everyone(
            (loaded, changed), 'the multi-node optimizer\'s next step')
        if any(v_loaded for v_loaded, _ in votes):
            return _RESUME
        if any(v_changed != changed for _, v_changed in votes):
            raise RuntimeError(
                'the parameter set changed on ranks %s but not on ranks %s; '
                'every rank must add or initialise parameters at the same '
                'update' % ([r for r, (_, c) in enumerate(votes) if c],
                            [r for r, (_, c) in enumerate(votes) if not c]))
        return _BROADCAST if changed else _AVERAGE

    def _named_params(self):
        return [(n, p.array) for n, p in sorted(self.target.namedparams())
                if p.array is not None]

    def _make_replicas_agree(self):
        """Give every rank rank 0's parameters and optimizer state where
        they differ (a digest of each, compared across ranks): nothing
        moves when every rank loaded the same snapshot.  True if the
        parameters were already the same on every rank."""
        comm = self.communicator
        state = _state_of(self._serialize_state)
        mine = (_digest(self._named_params()), _digest(sorted(state.items())))
        digests = comm.everyone(mine, 'the digests of the replicas')
        same_params = all(d[0] == digests[0][0] for d in digests)
        if not same_params:
            comm.bcast_data(self.target)
        if all(d[1] == digests[0][1] for d in digests):
            return same_params
        state = comm.bcast_obj(state if comm.rank == 0 else None)
        problem = None
        if comm.rank != 0:
            problem = self._load_state(state, digests[0][1])
        problems = comm.everyone(problem, 'loading rank 0\'s optimizer '
                                 'state')
        bad = ['rank %d: %s' % (r, p) for r, p in enumerate(problems) if p]
        if bad:
            raise RuntimeError(
                "could not give every rank rank 0's optimizer state after "
                'a snapshot was loaded (%s)' % '; '.join(bad))
        return same_params

    def _load_state(self, state, expected):
        """Load rank 0's ``state``; None if this rank's state then has the
        ``expected`` digest, else what went wrong."""
        try:
            # Not strict: a key rank 0 lacks is reported by the digest.
            self._serialize_state(chainer.serializers.NpzDeserializer(
                state, strict=False))
        except Exception as e:
            return '%s: %s' % (type(e).__name__, e)
        if _digest(sorted(_state_of(self._serialize_state).items())) \
                != expected:
            return ('its optimizer state still differs from rank 0\'s '
                    '(entries rank 0 does not have)')
        return None

    def update(self, lossfun=None, *args, **kwds):
        if lossfun is not None:
            self._backward(lossfun, args, kwds)
        step = self._next_step()
        if step is _BROADCAST:
            self.communicator.bcast_data(self.target)
            return
        if step is _RESUME and not self._make_replicas_agree():
            return
        self._blocked(self.communicator.multi_node_mean_grad, self.target,
                      self.zero_fill)
        self.actual_optimizer.update(None, *args, **kwds)

    def __getattr__(self, name):
        return getattr(self.actual_optimizer, name)

    def __setattr__(self, name, value):
        setattr(self.actual_optimizer, name, value)


class _DoubleBufferingOptimizer(_MultiNodeOptimizer):
    """Update k applies the mean of iteration k-1's gradients while
    iteration k's are averaged in the background (one step stale).

    Only the gradient arrays are double buffered: after backward, each
    parameter's fresh gradient is swapped with its shadow (which holds the
    finished mean of the previous iteration), and the shadows are averaged
    asynchronously.  Parameters and persistent values are never copied.
    """

    def __init__(self, actual_optimizer, communicator, zero_fill):
        super(_DoubleBufferingOptimizer, self).__init__(
            actual_optimizer, communicator, zero_fill)
        object.__setattr__(self, 'communicated_target', {})
        object.__setattr__(self, 'needs_update', False)
        object.__setattr__(self, '_handle', None)

    def wait(self):
        """Block until the averaging in flight ends (re-raising its error)."""
        handle = self._handle
        object.__setattr__(self, '_handle', None)
        if handle is not None:
            self._blocked(handle.wait)

    def _serialize_state(self, serializer):
        """Also the averaged gradients of the last iteration, which the
        next update applies: a resumed run continues exactly where the
        snapshot left off.  They are means, the same on every rank, so a
        snapshot resumes on any number of ranks.

        A snapshot without them (a plain multi-node optimizer's, or
        ChainerMN's) loads too: nothing is pending (``needs_update``
        False), so the next update averages its gradients and applies
        nothing, as after a broadcast; the pipeline then runs one step
        stale again.  A plain optimizer ignores them."""
        self.wait()
        super(_DoubleBufferingOptimizer, self)._serialize_state(serializer)
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        # Absent from the snapshot: False (a strict deserializer's KeyError
        # means the same).
        try:
            needs_update = bool(serializer(
                'mnopt_needs_update', False if loading else
                self.needs_update))
        except KeyError:
            needs_update = False
        names = numpy.array(sorted(self.communicated_target)
                            if self.needs_update else [], dtype=str)
        if loading:
            names = serializer('mnopt_averaged_names', None) \
                if needs_update else []
        else:
            serializer('mnopt_averaged_names', names)
        # '/' would nest the keys; parameter names start with it.
        grads = serializer['mnopt_averaged_grads']
        if not loading:
            for name in names:
                grads(name.replace('/', '|'), self.communicated_target[name])
            return
        params = dict(self.target.namedparams())
        loaded = {}
        for name in (str(n) for n in names):
            xp = chainer.backend.get_array_module(params[name].array)
            loaded[name] = xp.asarray(grads(name.replace('/', '|'), None))
        object.__setattr__(self, 'communicated_target', loaded)
        object.__setattr__(self, 'needs_update', needs_update)

    def update(self, lossfun=None, *args, **kwds):
        if lossfun is not None:
            self._backward(lossfun, args, kwds)
        step = self._next_step()
        self.wait()
        if step is _BROADCAST:
            self.communicator.bcast_data(self.target)
            object.__setattr__(self, 'communicated_target', {})
            object.__setattr__(self, 'needs_update', False)
            return
        if step is _RESUME and not self._make_replicas_agree():
            return   # what was pending (now rank 0's) applies next update
        params = dict(self.target.namedparams())
        shadows = self.communicated_target
        fresh = named_grads(self.target, self.zero_fill)
        for name, grad in fresh:
            # Each parameter's gradient becomes the mean this update
            # applies; where nothing is applied yet, zeros (never None).
            param = params[name]
            shadow = shadows.get(name)
            if shadow is None:
                with chainer.using_device(param.device):
                    shadow = param.device.xp.zeros_like(grad)
            param.grad = shadow
        object.__setattr__(self, 'communicated_target', dict(fresh))
        object.__setattr__(self, '_handle', self._blocked(
            self.communicator.mean_grads_async, fresh))
        if self.needs_update:
            self.actual_optimizer.update(None, *args, **kwds)
        else:
            object.__setattr__(self, 'needs_update', True)


class _OverlapOptimizer(_MultiNodeOptimizer):
    """Averages gradients during backward, bucket by bucket as they become
    final (mnopt/overlap.py), and updates with the exact mean: the same
    parameters as without overlap.  Needs ``update(lossfun, *args)`` (as
    Chainer's updaters call it); ``update()`` alone averages after the
    fact, as without overlap."""

    def __init__(self, actual_optimizer, communicator, zero_fill):
        super(_OverlapOptimizer, self).__init__(
            actual_optimizer, communicator, zero_fill)
        object.__setattr__(self, '_overlap', None)

    def setup(self, link):
        super(_OverlapOptimizer, self).setup(link)
        from mnopt import overlap
        object.__setattr__(self, '_overlap', overlap.Overlap(
            self.communicator, link, self.zero_fill))
        return self

    @property
    def overlap_stats(self):
        """{'buckets': n, 'during_backward': k}: of the last update's n
        buckets, k were handed to the communicator during backward."""
        return dict(self._overlap.stats)

    def serialize(self, serializer):
        """With ``compression='sign'`` also the buckets (the plan): a vote
        depends on them (each bucket is a layout of its own, with its own
        residuals and its own turn of the counter), so a resumed run keeps
        them to continue bit for bit.  Every rank must then load the same
        snapshot (a rank that loaded none would average other buckets:
        an error on every rank).  Without compression, or from a snapshot
        without them, the plan is made again, as after a broadcast."""
        super(_OverlapOptimizer, self).serialize(serializer)
        sign = self.communicator.compression == 'sign'
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        if not loading:
            if sign:
                plan = self._overlap.plan or []
                serializer('mnopt_plan_names', numpy.array(
                    [n for names in plan for n in names], dtype=str))
                serializer('mnopt_plan_sizes', numpy.array(
                    [len(names) for names in plan], numpy.int64))
            return
        self._overlap.forget_plan()
        try:
            names = serializer('mnopt_plan_names', None) if sign else None
            sizes = serializer('mnopt_plan_sizes', None) if sign else None
        except KeyError:
            names = sizes = None
        if names is None or sizes is None or not len(sizes):
            return
        names, plan = [str(n) for n in names], []
        for size in (int(s) for s in sizes):
            plan.append(names[:size])
            names = names[size:]
        if not names and set(n for b in plan for n in b) <= set(
                n for n, _ in self.target.namedparams()):
            self._overlap.plan = plan

    def update(self, lossfun=None, *args, **kwds):
        if lossfun is None:
            return super(_OverlapOptimizer, self).update(None, *args, **kwds)
        overlap = self._overlap
        # Warm-up (``warmup_steps``) counts iterations, not buckets: every
        # averaging of this update is of iteration t.
        overlap.forward_backward(lossfun, args, kwds,
                                 self.actual_optimizer._loss_scale,
                                 self.actual_optimizer.t)
        handles = overlap.finish()
        step = self._next_step()
        for handle in handles:
            self._blocked(handle.wait)
        if step is _BROADCAST:
            overlap.forget_plan()
            self.communicator.bcast_data(self.target)
            return
        if step is _RESUME and not self._make_replicas_agree():
            return
        overlap.adopt()
        if overlap.plan is None:
            overlap.make_plan()
        self.actual_optimizer.update(None, *args, **kwds)


def _check_actual_optimizer(actual_optimizer):
    """A clear error now for what would fail (or average twice) later.
    Every rank passes the same kind of argument, so each raises alike
    before any collective."""
    if isinstance(actual_optimizer, _MultiNodeOptimizer):
        # Its update would average the already averaged gradients again
        # (and its first update, a broadcast, would apply nothing).
        raise TypeError(
            'create_multi_node_optimizer got an optimizer it already '
            'wrapped (%s around %s): pass the Chainer optimizer itself, '
            'once' % (type(actual_optimizer).__name__,
                      type(actual_optimizer.actual_optimizer).__name__))
    if isinstance(actual_optimizer, type) and \
            issubclass(actual_optimizer, chainer.Optimizer):
        raise TypeError(
            'create_multi_node_optimizer takes an optimizer instance, not '
            'the class %s: pass %s(...)' % (
                actual_optimizer.__name__, actual_optimizer.__name__))
    if not isinstance(actual_optimizer, chainer.Optimizer):
        raise TypeError(
            'create_multi_node_optimizer takes a Chainer optimizer '
            '(an instance of chainer.Optimizer, e.g. '
            'chainer.optimizers.MomentumSGD()); got %s' % (
                'None' if actual_optimizer is None else
                'a %s object' % type(actual_optimizer).__name__))


def create_multi_node_optimizer(actual_optimizer: chainer.Optimizer,
                                communicator: CommunicatorBase,
                                double_buffering: bool = False,
                                zero_fill: bool = True, overlap: bool = False,
                                shard_state: bool = False
                                ) -> Any:  # acts as actual_optimizer
    """Wrap a Chainer optimizer so it averages gradients over all ranks.

    Args:
        actual_optimizer: a Chainer optimizer (e.g. MomentumSGD).
        communicator: from ``mnopt.create_communicator`` (any kind).
        double_buffering: overlap the averaging of iteration k's gradients
            with iteration k+1's forward and backward; updates then use
            gradients one iteration old.
        zero_fill: treat parameters without a gradient (unused this
            iteration) as zero gradients, so every rank reduces the same set.
        overlap: average gradients during ``update(lossfun, ...)``'s
            backward, bucket by bucket (``bucket_bytes`` of the
            communicator) as they become final, hiding communication behind
            the rest of backward with no staleness: the parameters are those
            of the synchronous optimizer, bit for bit.
        shard_state: ZeRO stage 1 (mnopt/zero.py, docs/zero.md): each rank
            owns a share of the parameters (whole arrays, balanced by
            bytes), keeps the optimizer state (Adam's m and v, momentum...)
            of its share only and updates only it; the mean gradients reach
            their owners through one reduce-scatter and the updated
            parameters come back through one all-gather.  Optimizers whose
            update is per parameter, per-parameter hooks and
            GradientClipping; a snapshot holds each rank's own share.
            With ``overlap=True``, ZeRO stage 2: the gradients are
            sharded too, each bucket reduce-scattered to its owners
            during backward and the other ranks' gradients freed then.
            Not with double_buffering, the reduction_server
            communicator or compression='sign'.
    """
    _check_actual_optimizer(actual_optimizer)
    if shard_state:
        if double_buffering:
            raise ValueError('shard_state does not combine with '
                             'double_buffering: the owners update with '
                             'this iteration\'s mean (overlap=True hides '
                             'the reduce-scatter behind backward instead)')
        from mnopt import zero
        return zero.create(actual_optimizer, communicator, zero_fill,
                           grads=overlap)
    if double_buffering and overlap:
        raise ValueError('double_buffering and overlap exclude each other: '
                         'double buffering applies last iteration\'s mean, '
                         'overlap this one\'s')
    cls = _DoubleBufferingOptimizer if double_buffering else \
        _OverlapOptimizer if overlap else _MultiNodeOptimizer
    return cls(actual_optimizer, communicator, zero_fill)


class _SignumRule(chainer.optimizer.UpdateRule):

    def init_state(self, param):
        xp = chainer.backend.get_array_module(param.data)
        with chainer.using_device(param.device):
            self.state['m'] = xp.zeros_like(param.data)

    def update_core(self, param):
        grad = param.grad
        if grad is None:
            return
        hp = self.hyperparam
        m = self.state['m']
        # m <- beta m + (1 - beta) g;  w <- w - lr sign(m)
        m *= hp.momentum
        m += (1 - hp.momentum) * grad
        xp = chainer.backend.get_array_module(param.data)
        param.data -= hp.lr * xp.sign(m).astype(param.data.dtype, copy=False)


class Signum(chainer.optimizer.GradientMethod):
    """Signum (Bernstein et al., 2018): momentum, then a step of ``lr`` in
    the direction of its sign: ``m = beta m + (1 - beta) g; w -= lr sign(m)``.

    Made for sign compression (``create_communicator(...,
    compression='sign')``): the gradients it sees are the voted signs times
    a scale, which it ignores; the momentum smooths the votes from step to
    step.  ``momentum=0`` is plain signSGD on the vote.  Weight decay goes
    through Chainer's hooks (``WeightDecay``), as for any optimizer.
    """

    def __init__(self, lr=1e-3, momentum=0.9):
        super(Signum, self).__init__()
        if not 0 <= momentum < 1:
            raise ValueError('momentum must be in [0, 1), not %r' % momentum)
        self.hyperparam.lr = lr
        self.hyperparam.momentum = momentum

    lr = chainer.optimizer.HyperparameterProxy('lr')
    momentum = chainer.optimizer.HyperparameterProxy('momentum')

    def create_update_rule(self):
        return _SignumRule(self.hyperparam)
