"""PowerSGD in a communicator (``compression='powersgd'`` and ``'auto'``):
a gradient set's mean as two averagings of the communicator's own, the
state kept per gradient set, and what a snapshot keeps of it.

The arithmetic is mnopt/powersgd.py's.  What travels goes through the
communicator's own averaging (``mean_of``: its packing, wire dtype, sum
and layout check), so the Ps and the Qs are summed by the ring, MPI, NCCL
or the reduction servers alike: first the Ps together with the arrays
left whole (vectors, small matrices), then the Qs.  Both are means, not
sums: Gram-Schmidt does not see the scale of P, and the mean Q gives the
mean gradient directly (``world_size`` 1 in ``reconstruct``).

With ``'auto'`` a ``CompressionGuard`` (compression_guard.py) times the
first averagings of each gradient set both ways and keeps the set
uncompressed where compressing it did not pay.  A set averaged plain
after compressed ones first adds its error-feedback residual to the
gradient, so no compression error is lost.
"""

import time

import numpy

from mnopt import log
from mnopt import powersgd
from mnopt.communicators.compression_guard import CompressionGuard
from mnopt.communicators.compression_guard import COMPRESSED, PLAIN

#: The logger of mnopt.communicators.base, where compression speaks.
logger = log.get('mnopt.communicators.base')

#: What the Ps and Qs of gradient ``name`` are called in the averaging's
#: layout (and its cross-rank check).
P_SUFFIX, Q_SUFFIX = '/powersgd.P', '/powersgd.Q'


class PowerSGDCompression(object):
    """``compression='powersgd'`` (``guarded``: ``'auto'``) for one
    communicator; holds no reference to it.  ``states``: {(label, names):
    powersgd.PowerSGDState}, one per gradient set of each group ('sync',
    'async')."""

    def __init__(self, rank, min_compression_rate, error_feedback,
                 warm_start, guarded=False):
        self.options = {'rank': rank,
                        'min_compression_rate': min_compression_rate,
                        'use_error_feedback': error_feedback,
                        'warm_start': warm_start, 'start_iter': 0}
        self.states = {}
        #: The CompressionGuard of 'auto', else None.
        self.guard = CompressionGuard() if guarded else None
        #: States from a loaded snapshot ({(label, names): their
        #: to_arrays()}), taken by the first averaging of their set.
        self.loaded = {}
        #: (this rank, the rank and size that wrote the snapshot loaded)
        #: when that was another rank's: its residuals were dropped.
        self.foreign = None

    def state_for(self, key, named, xp):
        """The state of gradient set ``key``; a new one (or the loaded
        one) where the set is new or its shapes changed."""
        shapes = [tuple(a.shape) for _, a in named]
        state = self.states.get(key)
        if state is not None and state.shapes == shapes:
            return state
        arrays = self.loaded.pop(key, None)
        state = powersgd.PowerSGDState(shapes, **self.options)
        if arrays is not None:
            loaded = powersgd.PowerSGDState.from_arrays(arrays, xp)
            if loaded.shapes == shapes:
                state = loaded
                self._warn_if_foreign(state)
        if len(self.states) >= 256:   # as a Group's buffers
            self.states.clear()
        self.states[key] = state
        return state

    def mean(self, label, named, xp, mean_of, quickest):
        """The mean of ``named`` ((name, array) pairs, averaged in place)
        over the ranks.  ``mean_of(pairs)``: the communicator's own
        in-place mean; ``quickest(times)``: agreement.quickest over the
        group (the guard's one exchange per gradient set)."""
        key = (label, tuple(n for n, _ in named))
        state = self.state_for(key, named, xp)
        way = COMPRESSED if self.guard is None else self.guard.next(key)
        if way == PLAIN:
            self._flush_errors(state, named)
        start = time.perf_counter()
        if way == PLAIN:
            mean_of(named)
        else:
            self._compressed_mean(state, named, xp, mean_of)
        if self.guard is not None:
            self.guard.record(key, way, time.perf_counter() - start,
                              quickest)

    def _warn_if_foreign(self, state):
        """Said when a state loaded from another rank's snapshot (its
        residuals dropped) is first used: not at the load, which a later
        load of this rank's own file (a snapshot in two parts) replaces."""
        if self.foreign is not None and not state.errors and \
                self.options['use_error_feedback']:
            logger.warning(
                'mnopt: warning: rank %d loaded the snapshot of rank %d of '
                '%d: its PowerSGD residuals restart at zero, so the resumed '
                'run is not the uninterrupted one bit for bit (give each '
                'rank a replica set of its own for an exact resume)',
                *self.foreign)
            self.foreign = None

    @staticmethod
    def _compressed_mean(state, named, xp, mean_of):
        names = [n for n, _ in named]
        grads = [a for _, a in named]
        matrices, ps, plain = powersgd.project(state, grads, xp)
        mean_of([(names[i] + P_SUFFIX, ps[i]) for i in sorted(ps)] +
                [(names[i], plain[i]) for i in sorted(plain)])
        ps, qs = powersgd.reproject(state, matrices, ps, xp)
        if qs:
            mean_of([(names[i] + Q_SUFFIX, qs[i]) for i in sorted(qs)])
        # Written into the gradients where they are contiguous (all of a
        # Chainer model's are), else copied back.
        into = [g if g.flags.c_contiguous else None for g in grads]
        means = powersgd.reconstruct(state, grads, matrices, ps, qs, {}, 1,
                                     xp, out=into)
        for i in matrices:
            if means[i] is not grads[i]:
                grads[i][...] = means[i]

    @staticmethod
    def _flush_errors(state, named):
        """Before a plain averaging: add the residuals to the gradients
        they were left out of, and drop them."""
        for i, error in state.errors.items():
            grad = named[i][1]
            grad += error.reshape(grad.shape).astype(grad.dtype, copy=False)
        state.errors = {}

    # -- snapshots -----------------------------------------------------------

    def save(self, serializer, averaging, rank, size, shared, local):
        """``shared``: the averaging counter and the guard's choices;
        ``local``: every state (its Qs are the same on every rank, its
        residuals this rank's own), with this rank and size."""
        if shared:
            serializer('steps', numpy.int64(averaging.steps))
            if self.guard is not None:
                choices = sorted(self.guard.choices.items())
                serializer('n_choices', numpy.int64(len(choices)))
                for i, ((label, names), way) in enumerate(choices):
                    serializer('choice_group%d' % i, numpy.array(label))
                    serializer('choice_names%d' % i,
                               numpy.array(names, dtype=str))
                    serializer('choice%d' % i, numpy.array(way))
        if not local:
            return
        entries = dict(self.loaded)   # loaded, not yet used
        for key, state in self.states.items():
            entries[key] = state.to_arrays()
        serializer('rank', numpy.int64(rank))
        serializer('size', numpy.int64(size))
        serializer('n_states', numpy.int64(len(entries)))
        for i, (label, names) in enumerate(sorted(entries)):
            arrays = entries[(label, names)]
            serializer('group%d' % i, numpy.array(label))
            serializer('names%d' % i, numpy.array(names, dtype=str))
            serializer('keys%d' % i, numpy.array(sorted(arrays), dtype=str))
            for name in sorted(arrays):
                # Host arrays already (to_arrays); as they are: a 0-d
                # value must stay 0-d (ascontiguousarray makes it 1-d).
                serializer('state%d_%s' % (i, name),
                           numpy.asarray(arrays[name]))

    def load(self, serializer, averaging, rank, size, shared, local):
        """Read what ``save`` wrote (a snapshot without it changes
        nothing).  The residuals only from this rank's own snapshot of a
        job of this size (else they restart at zero, with a warning); the
        Qs, the same on every rank, from any."""
        def read(key):   # None where absent (a strict one raises KeyError)
            try:
                return serializer(key, None)
            except KeyError:
                return None

        if shared:
            steps = read('steps')
            if steps is not None:
                averaging.steps = int(steps)
            n_choices = read('n_choices')
            if self.guard is not None and n_choices is not None:
                self.guard.choices = {
                    (str(serializer('choice_group%d' % i, None)),
                     tuple(str(n) for n in
                           serializer('choice_names%d' % i, None))):
                    str(serializer('choice%d' % i, None))
                    for i in range(int(n_choices))}
                self.guard.forget_trials()
        saved_rank, saved_size = (read('rank'), read('size')) if local \
            else (None, None)
        if saved_rank is None or saved_size is None:
            return
        own = (int(saved_rank), int(saved_size)) == (rank, size)
        loaded = {}
        for i in range(int(serializer('n_states', None))):
            key = (str(serializer('group%d' % i, None)),
                   tuple(str(n) for n in serializer('names%d' % i, None)))
            arrays = {str(name): numpy.array(
                serializer('state%d_%s' % (i, name), None))
                for name in serializer('keys%d' % i, None)}
            if not own:
                arrays = {k: v for k, v in arrays.items()
                          if not k.startswith('error_')}
            loaded[key] = arrays
        self.foreign = None if own else (rank, int(saved_rank),
                                         int(saved_size))
        self.loaded = loaded
        self.states = {}
