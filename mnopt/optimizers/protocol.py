"""The multi-node step protocol every variant follows, and the plain
multi-node optimizer: average the gradients, then let the wrapped Chainer
optimizer update.  Uses only the communicator's public API."""

import functools
import hashlib
import time

import chainer
import numpy

from mnopt.timeline import recorder as timelines
from mnopt.optimizers import uneven
from mnopt.optimizers.hook_agreement import check_hooks_agree, hook_settings
from mnopt.optimizers.accumulation import Accumulation
from mnopt.optimizers.local_steps_mark import not_local_steps, read
from mnopt.optimizers.shares import not_a_share

LOADED = object()  # _param_set after a snapshot was loaded

# What an update does, agreed by every rank (MultiNodeOptimizer._next_step).
BROADCAST = 'broadcast'   # rank 0's parameters to all; nothing applied
RESUME = 'resume'  # after a load: _make_replicas_agree, then AVERAGE's
AVERAGE = 'average'       # the mean gradient applied
UPDATES_KEY = 'mnopt_updates'   # a snapshot's count of update() calls


def host(array):
    """``array`` as a numpy array (a copy only when it lives elsewhere)."""
    return numpy.ascontiguousarray(chainer.backend.CpuDevice().send(array))


def digest(named_arrays):
    """A short digest of ``[(name, array), ...]`` (names, dtypes, shapes,
    bytes): equal digests on two ranks mean equal values, bit for bit."""
    h = hashlib.blake2b(digest_size=16)
    for name, array in named_arrays:
        host_array = host(array)
        h.update(repr((name, host_array.dtype.str,
                       host_array.shape)).encode())
        # An object array's bytes are pointers: hash what they point to.
        h.update(repr(host_array.tolist()).encode()
                 if host_array.dtype.hasobject else host_array.tobytes())
    return h.hexdigest()


def stepped(update):
    """``update`` recorded as one 'step' in the communicator's timeline
    (once: an update that calls another's records one step), after the
    accumulation's count: a micro-step (``accumulation_steps``) only
    accumulates, here, whatever the variant."""
    @functools.wraps(update)
    def recorded(self, lossfun=None, *args, **kwds):
        if self.actual_optimizer.target is None:
            # Before any collective: every rank that skipped setup says so.
            raise RuntimeError(
                'the multi-node optimizer has no model yet: call '
                'optimizer.setup(model) first (as with any Chainer '
                'optimizer), then optimizer.update(...)')
        if self.__dict__.get('_in_step'):
            return update(self, lossfun, *args, **kwds)
        object.__setattr__(self, '_in_step', True)
        try:
            tl, number = self._timeline(), self._updates
            object.__setattr__(self, '_updates', number + 1)
            with tl.span('step', 'compute',
                         step=tl.begin_step(self, 'optimizer', number)):
                if self._micro_step(lossfun, args, kwds):
                    return None
                return update(self, lossfun, *args, **kwds)
        finally:
            object.__setattr__(self, '_in_step', False)
    return recorded


def state_of(serialize):
    """What ``serialize(serializer)`` writes, as {key: numpy array}."""
    state = {}
    serialize(chainer.serializers.DictionarySerializer(state))
    return state


class StatesMayBeAbsent(chainer.serializer.Deserializer):
    """A deserializer where an entry read without a value of its own (an
    update rule's state: MomentumSGD's ``v``) may be absent and reads as
    None: Chainer then leaves that state to be made at its first update,
    as a non-strict deserializer would.  A snapshot written before the
    first update applied anything (the broadcast's, or one within the
    first ``accumulation_steps`` calls) holds no state, and loads."""

    def __init__(self, serializer):
        self.serializer = serializer

    def __getitem__(self, key):
        return StatesMayBeAbsent(self.serializer[key])

    def __call__(self, key, value):
        if value is not None:
            return self.serializer(key, value)
        try:
            return self.serializer(key, value)
        except KeyError:
            return None


class MultiNodeOptimizer(object):
    """ChainerMN's semantics: the first update (and any update after the
    parameter set changed) broadcasts the parameters from rank 0 and applies
    nothing; every other update applies the mean gradient.

    The first update after a snapshot was loaded (on any rank) gives every
    rank rank 0's parameters and optimizer state where they differ, so
    replicas cannot diverge.  It then applies the mean gradient if the
    parameters were the same everywhere (a run resumed from one snapshot
    on every rank continues bit for bit), and nothing if they had to be
    broadcast (some ranks' gradients were of other weights: as after any
    broadcast).

    Without ``double_buffering`` or ``overlap`` this is the optimizer
    ``create_multi_node_optimizer`` returns.  Its variants (double
    buffering, overlap, the sharded ones) extend it by overriding the
    steps ``update``, ``_next_step``, ``_make_replicas_agree`` and
    ``_serialize_state``.  Those and its helpers are underscored because
    the wrapper passes every other attribute through to the wrapped
    optimizer (``__getattr__``, ``__setattr__``): a public name here would
    hide the wrapped optimizer's attribute of that name."""

    def __init__(self, actual_optimizer, communicator, zero_fill):
        object.__setattr__(self, 'actual_optimizer', actual_optimizer)
        object.__setattr__(self, 'communicator', communicator)
        object.__setattr__(self, 'zero_fill', zero_fill)
        object.__setattr__(self, '_param_set', None)
        #: Seconds the caller has spent blocked in gradient averaging.
        object.__setattr__(self, 'communication_time', 0.0)
        object.__setattr__(self, '_accumulation', Accumulation(1))
        object.__setattr__(self, '_updates', 0)   # the window's step

    def _accumulate_over(self, steps):
        """Average once per ``steps`` calls of ``update``
        (mnopt/optimizers/accumulation.py)."""
        object.__setattr__(self, '_accumulation', Accumulation(steps))

    def _micro_step(self, lossfun, args, kwds):
        """True where this call only accumulates (its backward, if it has
        a loss function, added to the gradients).  On the K-th call
        without a loss function, the user's K backward passes are
        divided by K here; with one, ``_backward`` (or the overlapped
        variants' ``take_sums``) ends the count."""
        acc = self._accumulation
        if acc.micro_step(self.target, computed=lossfun is None):
            if lossfun is not None:
                self._backward(lossfun, args, kwds, clear=acc.done == 1)
            return True
        if lossfun is None and acc.end():
            acc.divide(self.target)
        return False

    def _blocked(self, fn, *args):
        """Run ``fn`` and add its duration to ``communication_time``."""
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            object.__setattr__(self, 'communication_time',
                               self.communication_time
                               + time.perf_counter() - start)

    def _timeline(self):
        """The communicator's timeline (mnopt/timeline/recorder.py; NULL when
        off or for a communicator without one)."""
        return getattr(self.communicator, 'timeline', timelines.NULL)

    def _apply(self, *args, **kwds):
        """The wrapped optimizer's update (of the gradients in place):
        'update' in the timeline."""
        with self._timeline().span('update', 'compute'):
            self.actual_optimizer.update(None, *args, **kwds)

    def setup(self, link):
        self.actual_optimizer.setup(link)
        # A new target: its first update broadcasts, as ChainerMN's does.
        object.__setattr__(self, '_param_set', None)
        return self

    def _backward(self, lossfun, args, kwds, clear=None):
        """Forward and backward; the gradients cleared first unless they
        hold earlier micro-steps' sum (``clear``: a micro-step's say; by
        default the K-th call's, which then divides the sum by K)."""
        target = self.target
        tl = self._timeline()
        summed = 0 if clear is not None else self._accumulation.end()
        with tl.span('forward', 'compute'):
            loss = lossfun(*args, **kwds)
        if clear is False or summed:
            pass   # the gradients hold the update's earlier micro-steps
        elif getattr(self.actual_optimizer, '_use_cleargrads', True):
            target.cleargrads()
        else:
            target.zerograds()
        with tl.span('backward', 'compute'):
            loss.backward(loss_scale=self.actual_optimizer._loss_scale)
        if summed:
            self._accumulation.divide(target)

    def serialize(self, serializer):
        """The wrapped optimizer's state (with its target).  After a load
        the next update makes the replicas agree (see the class): a
        snapshot loaded on every rank resumes bit for bit, one loaded on
        rank 0 alone (model, optimizer or both) is given to every rank.

        Also this rank's part of the compression state (error-feedback
        residuals, PowerSGD's factors), apart from ``_serialize_state``:
        it differs from rank to rank, not agreed on by the replicas."""
        self._serialize_state(serializer)   # waits for double buffering
        self.communicator.serialize_compression(
            serializer['mnopt_compression'], shared=False)
        # This rank's micro-steps: its own, as the residuals above (read
        # at K=1 too, to say that another K's partial sums are dropped).
        self._accumulation.serialize(serializer, self.target,
                                     self.communicator)
        self._serialize_updates(serializer)
        if isinstance(serializer, chainer.serializer.Deserializer):
            # Chainer's updater loads the optimizer before the model, so the
            # parameters may not have their data yet: the next update takes
            # whatever set it finds as the current one.
            self._mark_loaded()

    def _serialize_updates(self, serializer):
        """The update() calls over the job (the timeline window's steps);
        a snapshot without them (older, ChainerMN's): t·K + micro-steps."""
        if not isinstance(serializer, chainer.serializer.Deserializer):
            return serializer(UPDATES_KEY, numpy.int64(self._updates))
        count = read(serializer, UPDATES_KEY)   # None where absent
        acc = self._accumulation
        object.__setattr__(self, '_updates', int(count) if count is not None
                           else self.actual_optimizer.t * acc.steps
                           + (acc.loaded or (0,))[0])

    def _mark_loaded(self):
        """A snapshot was loaded: the next update is RESUME."""
        object.__setattr__(self, '_param_set', LOADED)

    def _of_my_mode(self, deserializer):
        """``deserializer``, refused where written by another mode."""
        return not_local_steps(not_a_share(deserializer))

    def _serialize_state(self, serializer):
        """What a snapshot holds, the same on every rank: the wrapped
        optimizer's state (refused where ``_of_my_mode`` says so), the
        communicator's shared compression state (with a compression, its
        averaging counter, warm-up's and the votes' coin, 'auto''s)."""
        self.actual_optimizer.serialize(StatesMayBeAbsent(self._of_my_mode(
            serializer)) if isinstance(
                serializer, chainer.serializer.Deserializer) else serializer)
        self.communicator.serialize_compression(
            serializer['mnopt_compression'], local=False)

    def _next_step(self):
        """What this update does (BROADCAST, RESUME or AVERAGE), agreed
        by every rank: RESUME if any rank loaded a snapshot since its last
        update, else BROADCAST on the first update and whenever parameters
        appeared, disappeared or got their data since the previous one.

        Ranks must agree: one that re-broadcasts while the others average
        would hang the job, so a parameter set that changed on some ranks
        only is an error on every rank.
        """
        return self._agree_step(False)[0]

    def _agree_step(self, pending):
        """``(_next_step's step, whether any rank is pending)``, in the
        step's one exchange: ``pending`` is this rank's say on something
        every rank must then do alike (overlap: gradients left to average
        after backward), so that none is done where no rank needs it."""
        loaded, changed = self._take_param_set()
        # Inside mnopt.join: whether this rank still has data
        # (mnopt/optimizers/uneven.py), heard by every rank alike.
        joined = self.__dict__.get('_uneven')
        votes = self.communicator.everyone(
            (loaded, changed, bool(pending), self._take_resumed(),
             uneven.say(joined), self._compared()),
            'the multi-node optimizer\'s next step')
        check_hooks_agree([v[5] for v in votes])
        self._check_resumed([v[3] for v in votes])
        uneven.hear(joined, [v[4] for v in votes])
        anyone_pending = any(v[2] for v in votes)
        if any(v[0] for v in votes):
            return RESUME, anyone_pending
        if any(v[1] != changed for v in votes):
            raise RuntimeError(
                'the parameter set changed on ranks %s but not on ranks %s; '
                'every rank must add or initialise parameters at the same '
                'update' % ([r for r, v in enumerate(votes) if v[1]],
                            [r for r, v in enumerate(votes) if not v[1]]))
        return BROADCAST if changed else AVERAGE, anyone_pending

    def _compared(self):
        """What each step's exchange compares across ranks: the hooks."""
        return hook_settings(self.actual_optimizer)

    def _take_resumed(self):
        """The micro-steps a snapshot restored here since the last update."""
        resumed, self._accumulation.resumed = self._accumulation.resumed, 0
        return resumed

    def _check_resumed(self, resumed):
        """Every rank restored as many micro-steps (``resumed``: each
        rank's ``_take_resumed``), or an error on every rank: the ranks
        would average sums of different numbers of batches."""
        if any(r != resumed[0] for r in resumed):
            raise RuntimeError(
                'a snapshot taken in the middle of a gradient accumulation '
                '(accumulation_steps=%d) restored %s micro-steps on ranks '
                '0..%d: load the same snapshot on every rank (multi_node_'
                'snapshot\'s autoload does), or take snapshots right after '
                'an update' % (self._accumulation.steps, resumed,
                               len(resumed) - 1))

    def _take_param_set(self):
        """(whether a snapshot was loaded since the last update, whether
        the parameter set changed since then), this rank's; the current
        set becomes the last one."""
        loaded = self._param_set is LOADED
        current = [(name, p.array is not None)
                   for name, p in sorted(self.target.namedparams())]
        changed = not loaded and current != self._param_set
        object.__setattr__(self, '_param_set', current)
        return loaded, changed

    def _named_params(self):
        return [(n, p.array) for n, p in sorted(self.target.namedparams())
                if p.array is not None]

    def _make_replicas_agree(self):
        """Give every rank rank 0's parameters and optimizer state where
        they differ (a digest of each, compared across ranks): nothing
        moves when every rank loaded the same snapshot.  True if the
        parameters were already the same on every rank."""
        comm = self.communicator
        state = state_of(self._serialize_state)
        mine = (digest(self._named_params()), digest(sorted(state.items())),
                self._updates)
        digests = comm.everyone(mine, 'the digests of the replicas')
        # The job's update count too (the timeline window's step).
        object.__setattr__(self, '_updates', digests[0][2])
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
        if digest(sorted(state_of(self._serialize_state).items())) \
                != expected:
            return ('its optimizer state still differs from rank 0\'s '
                    '(entries rank 0 does not have)')
        return None

    @stepped
    def update(self, lossfun=None, *args, **kwds):
        if lossfun is not None:
            self._backward(lossfun, args, kwds)
        step = self._next_step()
        if step is BROADCAST:
            self.communicator.bcast_data(self.target)
            return
        if step is RESUME and not self._make_replicas_agree():
            return
        self._blocked(self.communicator.multi_node_mean_grad, self.target,
                      self.zero_fill)
        # The mean over the ranks that still have data (mnopt.join).
        uneven.rescale(self.__dict__.get('_uneven'), self.target,
                       self.communicator.size)
        self._apply(*args, **kwds)

    def __getattr__(self, name):
        return getattr(self.actual_optimizer, name)

    def __setattr__(self, name, value):
        setattr(self.actual_optimizer, name, value)
