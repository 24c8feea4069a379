"""A registered communication hook at work: ``register_comm_hook`` (every
rank the same hook, checked in one agreement), the averaging of a
gradient set through it bucket by bucket, and its state in snapshots.
The types a hook sees are in comm_hooks.py."""

from __future__ import annotations

import ast
import gc
import hashlib
import types
import weakref
from typing import Any, Callable

import numpy

from mnopt.common.arrays import to_host
from mnopt.communicators.comm_hooks import GradBucket, HookCollectives

HOOKS_PAGE = 'docs/hooks.md'


def hook_identity(state, hook):
    """What must be the same on every rank: the hook's qualified name and
    a digest of its code (a changed hook on one rank differs), and the
    state's type."""
    target = getattr(hook, 'func', hook)   # functools.partial
    code = getattr(target, '__code__', None) or getattr(
        getattr(type(target), '__call__', None), '__code__', None)
    digest = _digest(code, hashlib.sha1()).hexdigest()[:12] \
        if code is not None else '-'
    name = getattr(target, '__qualname__', type(target).__qualname__)
    return {'hook': '%s.%s' % (getattr(target, '__module__', '?'), name),
            'hook code': digest, 'state': type(state).__name__}


def _digest(code, sha):
    """``sha`` updated with ``code``'s instructions, names and constants,
    nested functions' code included (never a repr holding an address)."""
    sha.update(code.co_code + repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _digest(const, sha)
        else:
            sha.update(repr(const).encode())
    return sha


def registration_problem(comm, hook):
    """Why ``comm`` cannot take ``hook`` (a ValueError or TypeError), or
    None; the same on every rank where the settings are (they are agreed
    when the communicator is made)."""
    if not callable(hook):
        return TypeError('register_comm_hook(state, hook) takes a function '
                         'hook(state, bucket, comm) -> averaged bucket; got '
                         'a %s as the hook (%s)' % (type(hook).__name__,
                                                    HOOKS_PAGE))
    if comm.compression is not None:
        return ValueError(
            'a comm hook replaces the averaging, compression=%r included: '
            'create the communicator without compression= to register one, '
            'or write the compression as the hook (%s)'
            % (comm.compression, HOOKS_PAGE))
    if comm.allreduce_grad_dtype is not None:
        return ValueError(
            'a comm hook decides what travels on the wire: create the '
            'communicator with allreduce_grad_dtype=None (the hook receives '
            'the gradients in their own dtype; float16 on the wire is '
            'mnopt.communicators.comm_hooks.float16_compress_hook) (%s)'
            % HOOKS_PAGE)
    tuned = [n for n, _ in comm.averaging.tuner.plan]
    if tuned:
        return ValueError(
            "%s='auto' tunes by timing plain averagings, which a comm hook "
            'replaces: pass a number (%s)' % (tuned[0], HOOKS_PAGE))
    if comm.sharded_optimizers() or any(
            g.sharded is not None for g in comm.averaging.groups()):
        # Refused from the sharded optimizer's making on, not only from
        # its first reduce-scatter: before that, the hook would be taken
        # and never called.
        return ValueError(
            'a sharded optimizer (shard_state=True) averages through this '
            "communicator: it reduce-scatters, so a comm hook's "
            'whole-bucket mean would never run.  Register the hook on a '
            'communicator no sharded optimizer uses: make the optimizer '
            'without shard_state, or give the sharded one a communicator '
            'of its own (%s)' % HOOKS_PAGE)
    return None


class RegisteredHook(object):
    """A hook, its state, and how it averages a gradient set."""

    def __init__(self, state, hook):
        self.state, self.hook = state, hook
        #: The gradient sets averaged so far (``bucket.step``'s count) and
        #: the training iteration of the last one (None: not given).
        self.sets, self.last_iteration = 0, None

    def next_set(self, iteration):
        """``bucket.step`` of a gradient set of ``iteration`` (the
        optimizer's update count, or None): one more per set, but the
        pieces of one iteration (overlap's buckets of backward) share
        it, so that it numbers the update alike in every mode."""
        if iteration is None or iteration != self.last_iteration:
            self.sets += 1
        self.last_iteration = iteration
        return self.sets - 1

    def mean(self, pipeline, group, named, xp, step, iteration=None):
        """The mean of ``named`` over ``group`` in place, bucket by bucket
        of ``pipeline.bucket_bytes`` (the pipeline: the communicator),
        each bucket's future waited for after every bucket has started.
        ``step``: the averaging's number (the timeline's); ``iteration``:
        the update these gradients are of, where the caller knows it."""
        number = self.next_set(iteration)
        buffer = group.buffer_for(named, None, xp,
                                  bucket_bytes=pipeline.bucket_bytes,
                                  in_place_min_bytes=None)
        arrays = [a for _, a in named]
        buffer.pack(arrays, 1)
        comm = HookCollectives(group.comm, pipeline.allreduce_algorithm)
        with pipeline._wire_span(step, buffer.nbytes):
            results = [self.hook(self.state, GradBucket(
                buffer.wire[b], i, len(buffer.buckets), number,
                self._pieces(buffer, named, b)), comm)
                for i, b in enumerate(buffer.buckets)]
            for i, (b, result) in enumerate(zip(buffer.buckets, results)):
                buffer.wire[b] = self._averaged(result, buffer.wire[b], i)
        buffer.unpack(arrays)

    @staticmethod
    def _pieces(buffer, named, bucket):
        pieces = []
        offsets = buffer.offsets
        for i, (name, _) in enumerate(named):
            lo, hi = max(bucket.start, offsets[i]), min(bucket.stop,
                                                        offsets[i + 1])
            if lo < hi:
                pieces.append((name, slice(lo - bucket.start,
                                           hi - bucket.start),
                               slice(lo - offsets[i], hi - offsets[i])))
        return pieces

    def _averaged(self, result, bucket, index):
        """A hook's result as the bucket's array, else a TypeError saying
        what a hook returns."""
        for wait in ('wait', 'result'):
            if callable(getattr(result, wait, None)) and \
                    not hasattr(result, 'shape'):
                result = getattr(result, wait)()
                break
        if getattr(result, 'shape', None) != bucket.shape:
            raise TypeError(
                'the comm hook %s returned %s for bucket %d: return the '
                'averaged bucket, an array shaped %s like bucket.buffer(), '
                'or a future of it (%s)' % (
                    getattr(self.hook, '__qualname__', self.hook),
                    'None' if result is None else 'a %s%s' % (
                        type(result).__name__,
                        ' shaped %s' % (result.shape,)
                        if hasattr(result, 'shape') else ''),
                    index, bucket.shape, HOOKS_PAGE))
        return result

    # ----------------------------------------------------------- snapshots
    def serialize(self, serializer, saving):
        """The state in this rank's part of a snapshot: an object with
        Chainer's ``serialize(serializer)``, or a dict of arrays (keys and
        values saved; loaded back in place of what it holds).  Other
        states are not saved.  Also the count behind ``bucket.step``, so
        that a resumed run's hook sees the uninterrupted run's steps."""
        self._serialize_count(serializer['mnopt'], saving)
        state = self.state
        if callable(getattr(state, 'serialize', None)):
            state.serialize(serializer)
        elif isinstance(state, dict):
            _serialize_dict(state, serializer, saving)


    def _serialize_count(self, serializer, saving):
        if saving:
            serializer('sets', numpy.int64(self.sets))
            serializer('last_iteration', numpy.int64(
                -1 if self.last_iteration is None else self.last_iteration))
            return
        try:
            sets = serializer('sets', None)
            last = serializer('last_iteration', None)
        except KeyError:   # a snapshot without it: the count goes on
            return
        if sets is not None and last is not None:
            self.sets = int(sets)
            self.last_iteration = None if int(last) < 0 else int(last)


def _serialize_dict(state, serializer, saving):
    if saving:
        keys = sorted(state, key=repr)
        serializer('n_entries', numpy.int64(len(keys)))
        for i, key in enumerate(keys):
            serializer('key%d' % i, numpy.array(repr(key)))
            serializer('value%d' % i, numpy.asarray(to_host(state[key])))
        return
    try:
        n = serializer('n_entries', None)
    except KeyError:   # a snapshot without a hook's state
        return
    if n is None:
        return
    loaded = {}
    for i in range(int(n)):
        key = str(serializer('key%d' % i, None))
        loaded[key] = numpy.array(serializer('value%d' % i, None))
    for key in list(state):
        if repr(key) in loaded:
            state[key] = _like(state[key], loaded.pop(repr(key)))
    for key, value in loaded.items():
        state[ast.literal_eval(key)] = value


def _like(current, value):
    """``value`` in the array module of ``current`` (numpy or CuPy)."""
    if isinstance(current, numpy.ndarray) or not hasattr(current, 'shape'):
        return value
    import cupy
    return cupy.asarray(value)


class CommHookRegistration(object):
    """``register_comm_hook`` for a communicator (MpiCommunicatorBase),
    and the sharded optimizers that exclude a hook."""

    _sharded_optimizers = None   # a WeakSet, once one is made

    def add_sharded_optimizer(self, optimizer: Any) -> None:
        """``optimizer``, a sharded one (shard_state=True), averages
        through this communicator from now on: while it lives,
        ``register_comm_hook`` is refused (mnopt's sharded optimizers
        call this when they are made)."""
        if self._sharded_optimizers is None:
            self._sharded_optimizers = weakref.WeakSet()
        self._sharded_optimizers.add(optimizer)

    def sharded_optimizers(self) -> list[Any]:
        """The sharded optimizers alive that average through this
        communicator."""
        if self._sharded_optimizers:
            # One the user dropped may wait in a reference cycle (stage 2's
            # overlap holds its optimizer): it no longer counts.
            gc.collect()
        return list(self._sharded_optimizers or ())

    @property
    def comm_hook_registered(self) -> bool:
        """Whether a comm hook averages this communicator's gradients."""
        return self.averaging.comm_hook is not None

    def register_comm_hook(self, state: Any,
                           hook: Callable[..., Any] | None) -> None:
        """Average every gradient set from now on through ``hook(state,
        bucket, comm)`` (DDP's ``register_comm_hook``; docs/hooks.md): a
        bucket at a time, under every optimizer but the sharded one.
        ``hook=None`` takes it away again.  Collective: every rank must
        register the same hook and state type, else a ValueError on every
        rank naming what differs."""
        self.averaging.in_flight.wait()
        problem = None if hook is None else registration_problem(self, hook)
        identity = {} if hook is None or problem is not None \
            else hook_identity(state, hook)
        self.same(identity, 'register_comm_hook (every rank must register '
                  'the same hook)', problem)
        self.averaging.comm_hook = None if hook is None \
            else RegisteredHook(state, hook)
