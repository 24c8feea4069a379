"""``mnopt.join(optimizer)``: training on inputs of uneven length (DDP's
``Join`` / ``model.join()``; ChainerMN's ``force_equal_length=False``).

    with mnopt.join(optimizer):
        for batch in my_batches:            # as many as this rank has
            optimizer.update(lossfun, *batch)

A rank that leaves the block (its data ran out) goes on taking part in
the others' updates with zero gradients, and applies the same mean (the
mean over the ranks that contributed: DDP's
``divide_by_initial_world_size=False``), until every rank has left; then
the block ends on every rank, the replicas bit for bit the same.  With
``uneven='error'`` a rank that runs out before the others is an
UnevenInputsError on every rank instead, naming each rank's batches.

Whether a rank still has data rides on the exchange every update makes
(mnopt/optimizers/uneven.py).  The plain (synchronous) optimizer only;
the other modes are refused, alike on every rank (their settings were
agreed when the optimizer was made).  docs/uneven_inputs.md."""

from __future__ import annotations

from typing import Any

import chainer

from mnopt.optimizers import uneven
from mnopt.optimizers.double_buffering import DoubleBufferingOptimizer
from mnopt.optimizers.local_steps import LocalStepsOptimizer
from mnopt.optimizers.overlap_optimizer import OverlapOptimizer
from mnopt.optimizers.protocol import MultiNodeOptimizer
from mnopt.optimizers.zero.stage1 import ShardedStateOptimizer


class join(object):   # noqa: N801 (used as DDP's ``with model.join():``)
    """``with mnopt.join(optimizer, uneven='shadow'):`` around each
    rank's loop over its own batches; see the module.

    ``uneven='shadow'`` (the default): ranks that ran out shadow the
    others until every rank is done.  ``uneven='error'``: an
    UnevenInputsError on every rank at the first update where some rank
    has run out (DDP's ``throw_on_early_termination=True``).  Every rank
    must pass the same (checked in the first update's exchange).

    After the block, ``batches`` is every rank's number of updates in it
    (the same list on every rank)."""

    def __init__(self, optimizer: Any, uneven: str = uneven.SHADOW):
        problem = join_problem(optimizer, uneven)
        if problem is not None:
            raise ValueError(problem)
        self.optimizer = optimizer
        self.mode = uneven
        self.batches: list[int] = []
        self._joined = None

    def __enter__(self) -> 'join':
        if self.optimizer.__dict__.get('_uneven') is not None:
            raise RuntimeError('this optimizer is already inside a '
                               'mnopt.join block: one at a time')
        self._joined = uneven.Joined(self.mode)
        object.__setattr__(self.optimizer, '_uneven', self._joined)
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        try:
            if kind is None:
                self._shadow()
        finally:
            object.__setattr__(self.optimizer, '_uneven', None)
            self.batches = list(self._joined.every_rank)
        return False

    def _shadow(self):
        """This rank's data ran out: take part in the others' updates
        with zero gradients until no rank contributes (every rank leaves
        together, in the exchange where all of them said so)."""
        joined, optimizer = self._joined, self.optimizer
        joined.contributing = False
        while True:
            zero_grads(optimizer.target)
            try:
                optimizer.update()
            except uneven.AllJoined:
                return


def zero_grads(target):
    """Every parameter with data gets a zero gradient (what a rank that
    ran out adds to the others' sum)."""
    for _, param in target.namedparams():
        if param.array is not None:
            if param.grad is None:
                param.grad = chainer.backend.get_array_module(
                    param.array).zeros_like(param.array)
            else:
                param.grad.fill(0)


#: The modes a join refuses, by the class create_multi_node_optimizer
#: chose, and why.
REFUSED_MODES = [
    (DoubleBufferingOptimizer, 'double_buffering=True',
     'its updates apply the previous iteration\'s mean, whose contributors '
     'an exchange of this iteration cannot tell'),
    (OverlapOptimizer, 'overlap=True',
     'its averagings start during backward, which a rank without data '
     'does not run'),
    (ShardedStateOptimizer, 'shard_state=True',
     'the owners update from a reduce-scatter the mean over contributors '
     'is not yet applied to'),
    (LocalStepsOptimizer, 'local_steps',
     'its syncs come every H updates, which a rank without data would '
     'not count alike'),
]


def join_problem(optimizer, mode):
    """Why ``mnopt.join(optimizer, uneven=mode)`` cannot be, or None.
    Only what every rank shares (the optimizer's mode, the communicator's
    compression and hook were agreed), so every rank says the same."""
    if mode not in uneven.MODES:
        return ('mnopt.join(optimizer, uneven=...) takes %s; got %r' % (
            ' or '.join(repr(m) for m in uneven.MODES), mode))
    if not isinstance(optimizer, MultiNodeOptimizer):
        return ('mnopt.join takes the optimizer create_multi_node_optimizer '
                'returned; got %s' % (
                    'None' if optimizer is None else
                    'a %s object' % type(optimizer).__name__))
    for cls, keyword, why in REFUSED_MODES:
        if isinstance(optimizer, cls):
            return ('mnopt.join works with the synchronous optimizer only, '
                    'not with %s: %s.  Leave %s out for the epochs with '
                    'uneven inputs, or give every rank the same number of '
                    'batches (docs/uneven_inputs.md)' % (keyword, why,
                                                        keyword))
    if optimizer._accumulation.steps > 1:
        return ('mnopt.join does not combine with accumulation_steps=%d: a '
                'rank that runs out in the middle of an accumulation would '
                'average a partial sum.  Use accumulation_steps=1 for the '
                'epochs with uneven inputs (docs/uneven_inputs.md)'
                % optimizer._accumulation.steps)
    comm = optimizer.communicator
    compression = getattr(comm, 'compression', None)
    if compression is not None:
        return ('mnopt.join does not combine with compression=%r: a rank '
                'that ran out would feed its error-feedback residuals into '
                'the others\' updates.  Use a communicator without '
                'compression for the epochs with uneven inputs '
                '(docs/uneven_inputs.md)' % (compression,))
    if getattr(comm, 'comm_hook_registered', False):
        return ('mnopt.join does not combine with a registered comm hook '
                '(register_comm_hook): the hook\'s mean would be over every '
                'rank, and its state (residuals) would take a rank\'s zero '
                'gradients.  Call comm.register_comm_hook(None, None) for '
                'the epochs with uneven inputs (docs/uneven_inputs.md)')
    return None
