"""PowerSGD in a communicator (``compression='powersgd'`` and ``'auto'``):
a gradient set's mean as two averagings of the communicator's own, the
state kept per gradient set and per parameter, and what a snapshot keeps
of it.

The arithmetic is mnopt/codecs/powersgd.py's.  What travels goes through the
communicator's own averaging (``mean_of``: its packing, wire dtype, sum
and layout check), so the Ps and the Qs are summed by the ring, MPI, NCCL
or the reduction servers alike: first the Ps together with the arrays
left whole (vectors, small matrices), then the Qs.  Both are means, not
sums: Gram-Schmidt does not see the scale of P, and the mean Q gives the
mean gradient directly (``world_size`` 1 in ``reconstruct``).  A factor's
name in the layout carries its gradient's shape and dtype, so that the
layout check refuses ranks whose gradients differ though their factors
would not.

The warm Qs are kept per gradient set (a bucket, with overlap); the
error-feedback residuals per parameter, so that a residual follows its
parameter into whichever set averages it next (overlap's first updates
average the whole model as one set, then its buckets).

With ``'auto'`` a ``CompressionGuard`` (compression_guard.py) times the
first averagings of each gradient set both ways and keeps the set
uncompressed where compressing it did not pay.  An array averaged plain
first takes in its residual, so no compression error is lost.
"""

import time

import numpy

from mnopt.common import log
from mnopt.codecs import powersgd
from mnopt.common.arrays import array_module, to_host
from mnopt.averaging.compression import read_optional, why_residuals_restart
from mnopt.averaging.compression_guard import CompressionGuard
from mnopt.averaging.compression_guard import COMPRESSED, PLAIN

#: The logger of mnopt.communicators.base, where compression speaks.
logger = log.get('mnopt.communicators.base')

#: What a snapshot's PowerSGD state says it is (a sign snapshot differs).
KIND = 'powersgd'


def factor_name(name, kind, array):
    """The name of gradient ``name``'s factor ``kind`` ('P' or 'Q') in
    an averaging's layout: with the gradient's shape and dtype, which the
    factor's own shape and dtype do not tell."""
    return '%s/powersgd.%s%s:%s' % (name, kind, list(array.shape),
                                    array.dtype.name)


def on_module(a, xp):
    """``a`` on ``xp`` (the gradients' array module): a state made on the
    host follows a model moved to a GPU, and back."""
    if array_module([a]) is xp:
        return a
    return to_host(a) if xp is numpy else xp.asarray(a)


class PowerSGDCompression(object):
    """``compression='powersgd'`` (``guarded``: ``'auto'``) for one
    communicator; holds no reference to it.  ``states``: {(label, names):
    powersgd.PowerSGDState}, one per gradient set of each group ('sync',
    'async'), holding its warm Qs; ``residuals``: {(label, name):
    matrix}, each parameter's error-feedback residual."""

    def __init__(self, rank, min_compression_rate, error_feedback,
                 warm_start, guarded=False):
        self.options = {'rank': rank,
                        'min_compression_rate': min_compression_rate,
                        'use_error_feedback': error_feedback,
                        'warm_start': warm_start, 'start_iter': 0}
        self.states = {}
        self.residuals = {}
        #: The CompressionGuard of 'auto', else None.
        self.guard = CompressionGuard() if guarded else None
        #: Warm Qs and counts from a loaded snapshot ({(label, names):
        #: (iteration, {plan index: Q})}), taken by their set's first
        #: averaging.
        self.loaded = {}
        #: What to say at the next averaging about the snapshot loaded
        #: (its residuals dropped, its settings other), or None.
        self.loaded_note = None

    def state_for(self, key, named, xp):
        """The state of gradient set ``key``: a new one where the set is
        new or its shapes changed, taking a loaded snapshot's Qs where
        their shapes fit this communicator's settings."""
        shapes = [tuple(a.shape) for _, a in named]
        state = self.states.get(key)
        if state is not None and state.shapes == shapes:
            state.qs = {i: on_module(q, xp) for i, q in state.qs.items()}
            return state
        state = powersgd.PowerSGDState(shapes, **self.options)
        loaded = self.loaded.pop(key, None)
        if loaded is not None:
            iteration, qs = loaded
            state.iteration = iteration
            for e in state.plan:
                q = qs.get(e.index)
                if e.matrix is not None and q is not None and \
                        q.shape == (e.matrix[1], e.rank):
                    state.qs[e.index] = on_module(q, xp)
        self.states[key] = state
        return state

    def mean(self, label, named, xp, mean_of, quickest):
        """The mean of ``named`` ((name, array) pairs, averaged in place)
        over the ranks.  ``mean_of(pairs)``: the communicator's own
        in-place mean; ``quickest(times)``: agreement.quickest over the
        group (the guard's one exchange per gradient set)."""
        if self.loaded_note is not None:
            logger.warning(self.loaded_note)
            self.loaded_note = None
        key = (label, tuple(n for n, _ in named))
        state = self.state_for(key, named, xp)
        way = COMPRESSED if self.guard is None else self.guard.next(key)
        start = time.perf_counter()
        if way == PLAIN:
            self._take_residuals(label, named, range(len(named)))
            mean_of(named)
        else:
            self._compressed_mean(label, state, named, xp, mean_of)
        if self.guard is not None:
            self.guard.record(key, way, time.perf_counter() - start,
                              quickest)

    def _compressed_mean(self, label, state, named, xp, mean_of):
        names = [n for n, _ in named]
        grads = [a for _, a in named]
        compressed = {e.index: e for e in state.plan if e.matrix is not None}
        # Plain arrays take in residuals left from a set that compressed
        # them; the compressed ones' go into the state for the step.
        self._take_residuals(label, named, [i for i in range(len(named))
                                            if i not in compressed])
        for i, e in compressed.items():
            r = self.residuals.pop((label, names[i]), None)
            if r is not None and r.shape == e.matrix:
                state.errors[i] = on_module(r, xp)
        try:
            matrices, ps, plain = powersgd.project(state, grads, xp)
            mean_of([(factor_name(names[i], 'P', grads[i]), ps[i])
                     for i in sorted(ps)] +
                    [(names[i], plain[i]) for i in sorted(plain)])
            ps, qs = powersgd.reproject(state, matrices, ps, xp)
            if qs:
                mean_of([(factor_name(names[i], 'Q', grads[i]), qs[i])
                         for i in sorted(qs)])
            # Written into the gradients where they are contiguous (all
            # of a Chainer model's are), else copied back.
            into = [g if g.flags.c_contiguous else None for g in grads]
            means = powersgd.reconstruct(state, grads, matrices, ps, qs, {},
                                         1, xp, out=into)
            for i in matrices:
                if means[i] is not grads[i]:
                    grads[i][...] = means[i]
        finally:
            # Back to the parameters: this step's residuals, or (a step
            # that failed or was not finite) the ones it started from.
            for i, error in state.errors.items():
                self.residuals[(label, names[i])] = error
            state.errors = {}

    def _take_residuals(self, label, named, indices):
        """Add to the gradients at ``indices`` the residuals their
        parameters hold, and drop them: before a plain averaging."""
        for i in indices:
            name, grad = named[i]
            r = self.residuals.pop((label, name), None)
            if r is not None and r.size == grad.size:
                xp = array_module([grad])
                grad += on_module(r, xp).reshape(grad.shape).astype(
                    grad.dtype, copy=False)

    # -- snapshots -----------------------------------------------------------

    def save(self, serializer, averaging, rank, size, shared, local):
        """``shared``: the averaging counter and the guard's choices (with
        the job's size: another size times again); ``local``: every set's
        count and warm Qs (the same on every rank) and this rank's
        residuals, with this rank and size."""
        if shared:
            serializer('steps', numpy.int64(averaging.steps))
            serializer('kind', numpy.array(KIND))
            if self.guard is not None:
                choices = sorted(self.guard.choices.items())
                serializer('choice_size', numpy.int64(size))
                serializer('n_choices', numpy.int64(len(choices)))
                for i, ((label, names), way) in enumerate(choices):
                    serializer('choice_group%d' % i, numpy.array(label))
                    serializer('choice_names%d' % i,
                               numpy.array(names, dtype=str))
                    serializer('choice%d' % i, numpy.array(way))
        if not local:
            return
        sets = {key: (iteration, dict(qs))
                for key, (iteration, qs) in self.loaded.items()}
        for key, state in self.states.items():
            sets[key] = (state.iteration, state.qs)
        serializer('kind', numpy.array(KIND))
        serializer('rank', numpy.int64(rank))
        serializer('size', numpy.int64(size))
        serializer('powersgd_rank', numpy.int64(self.options['rank']))
        serializer('n_factor_sets', numpy.int64(len(sets)))
        for i, key in enumerate(sorted(sets)):
            iteration, qs = sets[key]
            serializer('set_group%d' % i, numpy.array(key[0]))
            serializer('set_names%d' % i, numpy.array(key[1], dtype=str))
            serializer('set_iteration%d' % i, numpy.int64(iteration))
            serializer('set_qs%d' % i, numpy.array(sorted(qs), numpy.int64))
            for j in sorted(qs):
                serializer('set%d_q%d' % (i, j), to_host(qs[j]))
        residuals = sorted(self.residuals.items())
        serializer('n_residual_arrays', numpy.int64(len(residuals)))
        for i, ((label, name), r) in enumerate(residuals):
            serializer('residual_group%d' % i, numpy.array(label))
            serializer('residual_name%d' % i, numpy.array(name))
            serializer('residual%d' % i, to_host(r))

    def load(self, serializer, averaging, rank, size, shared, local):
        """Read what ``save`` wrote (a snapshot without it, or with sign
        compression's, changes nothing but the counter).  The residuals
        only from this rank's own snapshot of a job of this size (else
        they restart at zero, said at the next averaging); the Qs, the
        same on every rank, from any, where their shapes fit."""
        def read(key):
            return read_optional(serializer, key)

        kind = read('kind')
        if shared:
            steps = read('steps')
            if steps is not None:
                averaging.steps = int(steps)
            n_choices = read('n_choices')
            choice_size = read('choice_size')
            if self.guard is not None and n_choices is not None and \
                    choice_size is not None and int(choice_size) == size:
                self.guard.choices = {
                    (str(serializer('choice_group%d' % i, None)),
                     tuple(str(n) for n in
                           serializer('choice_names%d' % i, None))):
                    str(serializer('choice%d' % i, None))
                    for i in range(int(n_choices))}
            if self.guard is not None:
                self.guard.forget_trials()
        if not local or kind is None or str(kind) != KIND:
            if local and read('rank') is not None:
                logger.warning('mnopt: warning: the snapshot holds no '
                               'PowerSGD state (another compression): '
                               'PowerSGD starts afresh')
            return
        saved_rank, saved_size = int(read('rank')), int(read('size'))
        loaded = {}
        for i in range(int(serializer('n_factor_sets', None))):
            key = (str(serializer('set_group%d' % i, None)),
                   tuple(str(n) for n in serializer('set_names%d' % i,
                                                    None)))
            qs = {int(j): numpy.array(serializer('set%d_q%d' % (i, j),
                                                 None))
                  for j in serializer('set_qs%d' % i, None)}
            loaded[key] = (int(serializer('set_iteration%d' % i, None)), qs)
        own = (saved_rank, saved_size) == (rank, size)
        residuals = {}
        for i in range(int(serializer('n_residual_arrays', None))):
            residuals[(str(serializer('residual_group%d' % i, None)),
                       str(serializer('residual_name%d' % i, None)))] = \
                numpy.array(serializer('residual%d' % i, None))
        notes = []
        if not own and residuals and self.options['use_error_feedback']:
            notes.append(
                'rank %d loaded the snapshot of rank %d of %d: its PowerSGD '
                'residuals restart at zero, so the resumed run is not the '
                'uninterrupted one bit for bit (%s)'
                % (rank, saved_rank, saved_size,
                   why_residuals_restart(size, saved_size)))
        saved_factors = int(read('powersgd_rank'))
        if saved_factors != self.options['rank'] and rank == 0:
            notes.append(
                'the snapshot was taken with powersgd_rank=%d, this '
                'communicator has %d: its warm Qs restart from a fresh '
                'draw' % (saved_factors, self.options['rank']))
        self.loaded_note = 'mnopt: warning: ' + '; '.join(notes) \
            if notes else None
        self.loaded = loaded
        self.residuals = residuals if own and \
            self.options['use_error_feedback'] else {}
        self.states = {}
