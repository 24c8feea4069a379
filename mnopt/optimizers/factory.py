"""The factories: ``create_multi_node_optimizer`` checks its arguments
and picks the variant (plain, double buffering, overlap, ZeRO stage 1 or
2); ``create_sharded`` (``mnopt.zero.create``) the sharded ones."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import chainer

from mnopt.optimizers.double_buffering import DoubleBufferingOptimizer
from mnopt.optimizers.overlap_optimizer import OverlapOptimizer
from mnopt.optimizers.protocol import MultiNodeOptimizer
from mnopt.optimizers.zero.owned_update import optimizer_problem
from mnopt.optimizers.zero.stage1 import ShardedStateOptimizer
from mnopt.optimizers.zero.stage2 import ShardedGradsOptimizer

if TYPE_CHECKING:
    from mnopt.communicators.base import CommunicatorBase


def check_actual_optimizer(actual_optimizer):
    """A clear error now for what would fail (or average twice) later.
    Every rank passes the same kind of argument, so each raises alike
    before any collective."""
    if isinstance(actual_optimizer, MultiNodeOptimizer):
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
        shard_state: ZeRO stage 1 (mnopt/optimizers/zero/, docs/zero.md):
            each rank owns a share of the parameters (whole arrays, balanced
            by bytes), keeps the optimizer state (Adam's m and v, momentum...)
            of its share only and updates only it; the mean gradients reach
            their owners through one reduce-scatter and the updated
            parameters come back through one all-gather.  Optimizers whose
            update is per parameter, per-parameter hooks and
            GradientClipping; a snapshot holds each rank's own share.
            With ``overlap=True``, ZeRO stage 2: the gradients are
            sharded too, each bucket reduce-scattered to its owners
            during backward and the other ranks' gradients freed then.
            Not with double_buffering, the reduction_server
            communicator or any compression.

    A communicator with 'auto' settings (``bucket_bytes='auto'``, ...:
    docs/tuning.md) tunes them in its first averagings, with the plain
    optimizer or double buffering; ``overlap`` and ``shard_state`` refuse
    it (a ValueError on every rank).
    """
    check_actual_optimizer(actual_optimizer)
    tuning_problem = getattr(communicator, 'tuning_problem', None)
    if (shard_state or overlap) and tuning_problem is not None:
        # The communicator's 'auto' settings are shared, and so is this
        # call's mode: every rank refuses alike, before any collective.
        problem = tuning_problem('shard_state' if shard_state
                                 else 'overlap')
        if problem is not None:
            raise ValueError(problem)
    if shard_state:
        if double_buffering:
            raise ValueError('shard_state does not combine with '
                             'double_buffering: the owners update with '
                             'this iteration\'s mean (overlap=True hides '
                             'the reduce-scatter behind backward instead)')
        return create_sharded(actual_optimizer, communicator, zero_fill,
                              grads=overlap)
    if double_buffering and overlap:
        raise ValueError('double_buffering and overlap exclude each other: '
                         'double buffering applies last iteration\'s mean, '
                         'overlap this one\'s')
    cls = DoubleBufferingOptimizer if double_buffering else \
        OverlapOptimizer if overlap else MultiNodeOptimizer
    return cls(actual_optimizer, communicator, zero_fill)


def create_sharded(actual_optimizer, communicator, zero_fill, grads=False):
    """The sharded optimizer (``grads``: stage 2, the gradients sharded
    too), or a ValueError saying why it cannot be."""
    problem = communicator.sharding_problem() or \
        optimizer_problem(actual_optimizer)
    if problem is None and grads and \
            communicator.background_collectives_problem() is not None:
        problem = ('shard_state with overlap reduce-scatters gradients on '
                   'a background thread during backward, which needs '
                   'MPI_THREAD_MULTIPLE; this MPI was initialised with a '
                   'lower thread level')
    if problem is not None:
        raise ValueError(problem)
    cls = ShardedGradsOptimizer if grads else ShardedStateOptimizer
    return cls(actual_optimizer, communicator, zero_fill)
