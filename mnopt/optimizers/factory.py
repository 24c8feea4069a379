"""The factories: ``create_multi_node_optimizer`` checks its arguments
and picks the variant (plain, double buffering, overlap, ZeRO stage 1 or
2); ``create_sharded`` (``mnopt.zero.create``) the sharded ones."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import chainer
import numpy

from mnopt.optimizers.double_buffering import DoubleBufferingOptimizer
from mnopt.optimizers.overlap_optimizer import OverlapOptimizer
from mnopt.optimizers.hook_agreement import hook_settings
from mnopt.optimizers.local_steps import LocalStepsOptimizer
from mnopt.optimizers.local_steps_settings import LocalSteps
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


def shared_settings(actual_optimizer, **keywords):
    """What every rank must pass alike to ``create_multi_node_optimizer``
    (the ``keywords``, read as true or false), and the wrapped
    optimizer's class and hyperparameters (``lr``, ``momentum``, ...:
    replicas that update with different ones drift apart in silence), as
    values every rank can compare."""
    settings = {name: bool(value) for name, value in keywords.items()}
    cls = type(actual_optimizer)
    settings['actual_optimizer'] = '%s.%s' % (cls.__module__,
                                              cls.__qualname__)
    hyperparam = getattr(actual_optimizer, 'hyperparam', None)
    if hyperparam is not None:
        for name, value in hyperparam.get_dict().items():
            settings['actual_optimizer.%s' % name] = comparable(value)
    # Hooks added before wrapping (the optimizer set up); those added
    # later are compared in each update's exchange (protocol.py).
    settings['optimizer hooks'] = ', '.join(
        hook_settings(actual_optimizer)) or 'none'
    return settings


def comparable(value):
    """A hyperparameter as a value that compares equal on two ranks
    exactly when they hold the same: a number or string as itself (NaN as
    'nan', which equals itself), anything else by its type."""
    if isinstance(value, numpy.generic):
        value = value.item()
    if isinstance(value, float) and value != value:
        return 'nan'
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return 'a %s object' % type(value).__name__


def create_multi_node_optimizer(actual_optimizer: chainer.Optimizer,
                                communicator: CommunicatorBase,
                                double_buffering: bool = False,
                                zero_fill: bool = True, overlap: bool = False,
                                shard_state: bool = False,
                                accumulation_steps: int = 1,
                                local_steps: int | None = None,
                                outer_optimizer: chainer.Optimizer | None
                                = None, fragments: int = 1,
                                fragment_sync_delay: int = 0,
                                sync_warmup_steps: int = 0
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
            each rank holds an equal share of the parameters' elements (a
            parameter may span ranks), keeps the optimizer state (Adam's m
            and v, momentum...) of its share only and updates only it; the
            mean gradients reach their ranks through one reduce-scatter and
            the updated parameters come back through one all-gather.  Optimizers whose
            update is per parameter, per-parameter hooks and
            GradientClipping; a snapshot holds each rank's own share.
            With ``overlap=True``, ZeRO stage 2: the gradients are
            sharded too, each bucket reduce-scattered to its owners
            during backward and the other ranks' gradients freed then.
            Not with double_buffering, the reduction_server
            communicator or any compression.
        accumulation_steps: average once per this many calls of
            ``update`` (Horovod's ``backward_passes_per_step``, DDP's
            ``no_sync()``; docs/accumulation.md): the gradients of K
            backward passes are summed, divided by K and averaged once,
            and the wrapped optimizer updates once (``t`` counts
            updates).  With every mode above.
        local_steps: DiLoCo (docs/local_sgd.md): each rank updates its
            own replica with ``actual_optimizer`` (the inner one) on its
            own gradients, and every ``local_steps`` = H updates the
            pseudo-gradients (parameters at the last sync minus the
            local ones) are averaged and ``outer_optimizer`` (default
            ``mnopt.OuterNesterov()``: PyTorch's Nesterov
            SGD at DiLoCo's lr 0.7, momentum 0.9; any Chainer optimizer)
            steps the synced parameters with their mean, which every
            rank then holds.  ``fragments`` = F: Streaming DiLoCo, the
            parameters cut into F parts of about equal bytes synced in
            turn, H/F updates apart; ``fragment_sync_delay`` = tau: each
            fragment's averaging runs in the background during the next
            tau updates.  ``sync_warmup_steps``: synchronous updates
            first.  The communicator's compression (sign, PowerSGD,
            'auto') compresses each sync's pseudo-gradients.  Not with
            double_buffering, overlap, shard_state or a comm hook.
            Between syncs an update exchanges nothing (docs/local_sgd.md).

    A communicator with 'auto' settings (``bucket_bytes='auto'``, ...:
    docs/tuning.md) tunes them in its first averagings, with the plain
    optimizer or double buffering; ``overlap`` and ``shard_state`` refuse
    it (a ValueError on every rank).

    Every rank must pass the same keywords and an optimizer of the same
    class with the same hyperparameters: they are compared here, in one
    exchange over the communicator, and a difference is a ValueError on
    every rank naming each one and every rank's value (a bad argument on
    one rank: its error there, a RuntimeError naming it on the others).
    """
    check_communicator(communicator)
    local = LocalSteps(local_steps, outer_optimizer, fragments,
                       fragment_sync_delay, sync_warmup_steps)
    try:
        check_mode(actual_optimizer, communicator, double_buffering,
                   overlap, shard_state)
        check_accumulation_steps(accumulation_steps)
        local.check(communicator, double_buffering=double_buffering,
                    overlap=overlap, shard_state=shard_state)
        problem = None
    except (TypeError, ValueError) as e:
        problem = e
    settings = {} if problem is not None else shared_settings(
        actual_optimizer, double_buffering=double_buffering,
        zero_fill=zero_fill, overlap=overlap, shard_state=shard_state)
    if problem is None:
        settings['accumulation_steps'] = int(accumulation_steps)
        settings.update((name, comparable(value))
                        for name, value in local.shared().items())
    # One exchange: a problem on any rank, or settings that differ, is an
    # error on every rank here, not a hang at the second update (a
    # double-buffered rank's mean_grads_async against another's
    # mean_grads).
    try:
        communicator.same(settings, 'create_multi_node_optimizer', problem)
    except ValueError as e:
        if problem is not None:
            raise
        raise ValueError('%s: every rank must pass the same (see '
                         'docs/settings.md)' % e) from None
    if shard_state:
        cls = ShardedGradsOptimizer if overlap else ShardedStateOptimizer
    else:
        cls = DoubleBufferingOptimizer if double_buffering else \
            OverlapOptimizer if overlap else MultiNodeOptimizer
    optimizer = LocalStepsOptimizer(
        actual_optimizer, communicator, zero_fill, local) if local.enabled \
        else cls(actual_optimizer, communicator, zero_fill)
    optimizer._accumulate_over(int(accumulation_steps))
    return optimizer


def check_accumulation_steps(steps):
    """A whole number of backward passes per update, at least 1."""
    if isinstance(steps, bool) or not isinstance(
            steps, (int, numpy.integer)) or steps < 1:
        raise ValueError(
            'accumulation_steps must be a whole number of backward passes '
            'per update, at least 1 (as Horovod\'s '
            'backward_passes_per_step); got %r' % (steps,))


def check_communicator(communicator):
    """A TypeError, on this rank (there is nothing yet to tell the others
    over), for what is not an mnopt communicator."""
    if not callable(getattr(communicator, 'same', None)):
        raise TypeError(
            'create_multi_node_optimizer takes a communicator from '
            "mnopt.create_communicator(...) (e.g. 'flat'); got %s" % (
                'None' if communicator is None else
                'a %s object' % type(communicator).__name__))


def check_mode(actual_optimizer, communicator, double_buffering, overlap,
               shard_state):
    """Raise TypeError/ValueError for what this rank was given, without
    communicating (the factory then tells every rank)."""
    check_actual_optimizer(actual_optimizer)
    tuning_problem = getattr(communicator, 'tuning_problem', None)
    if (shard_state or overlap) and tuning_problem is not None:
        # The communicator's 'auto' settings are shared, and so is this
        # call's mode (compared below): every rank refuses alike.
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
        problem = sharding_problem(actual_optimizer, communicator,
                                   grads=overlap)
        if problem is not None:
            raise ValueError(problem)
    if double_buffering and overlap:
        raise ValueError('double_buffering and overlap exclude each other: '
                         'double buffering applies last iteration\'s mean, '
                         'overlap this one\'s')


def create_sharded(actual_optimizer, communicator, zero_fill, grads=False):
    """The sharded optimizer (``grads``: stage 2, the gradients sharded
    too), or a ValueError on every rank saying why it cannot be:
    ``create_multi_node_optimizer(..., shard_state=True, overlap=grads)``."""
    return create_multi_node_optimizer(actual_optimizer, communicator,
                                       zero_fill=zero_fill, overlap=grads,
                                       shard_state=True)


def sharding_problem(actual_optimizer, communicator, grads):
    """Why a sharded optimizer (``grads``: stage 2) cannot be, or None."""
    problem = communicator.sharding_problem() or \
        optimizer_problem(actual_optimizer)
    if problem is None and grads and \
            communicator.background_collectives_problem() is not None:
        problem = ('shard_state with overlap reduce-scatters gradients on '
                   'a background thread during backward, which needs '
                   'MPI_THREAD_MULTIPLE; this MPI was initialised with a '
                   'lower thread level')
    return problem
