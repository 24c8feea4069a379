"""The wrapped optimizer's update on this rank's parameters only: its
per-parameter hooks, GradientClipping by the global norm, its update rules,
and which optimizers and hooks allow that."""

import chainer
import numpy
from chainer.optimizer_hooks import GradientClipping


def optimizer_hooks(optimizer, timing):
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
        for name, hook in optimizer_hooks(optimizer, timing):
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


def reallocate_cleared_grads(params):
    """GradientMethod.reallocate_cleared_grads on ``params`` only (the
    owned ones: the others' gradients stay dropped): zeros where a hook
    cleared a gradient."""
    for param in params:
        if param.array is not None and param.grad is None:
            with chainer.using_device(param.device):
                param.grad = param.device.xp.zeros_like(param.array)


def update_owned(actual, communicator, target, owners):
    """Chainer's GradientMethod.update after the backward, on this rank's
    parameters only (``owners``: {name: rank}); ``actual`` is the wrapped
    optimizer."""
    rank = communicator.rank
    owned = [p for n, p in target.namedparams() if owners.get(n) == rank]
    reallocate_cleared_grads(owned)
    _call_hooks(actual, 'pre', communicator, target, owners, owned)
    actual.t += 1
    for param in owned:
        param.update()
    reallocate_cleared_grads(owned)
    _call_hooks(actual, 'post', communicator, target, owners, owned)


def _call_hooks(actual, timing, communicator, target, owners, owned):
    """The wrapped optimizer's hooks of ``timing`` on ``owned``."""
    for _, hook in optimizer_hooks(actual, timing):
        if getattr(hook, 'call_for_each_param', False):
            for param in owned:
                hook(param.update_rule, param)
        else:   # GradientClipping (optimizer_problem refuses others)
            clip_by_global_norm(hook.threshold, communicator, target, owners,
                                owned)
        reallocate_cleared_grads(owned)


def clip_by_global_norm(threshold, communicator, target, owners, owned):
    """GradientClipping with the norm of every mean gradient: each
    parameter's squared norm comes from its owner (one small
    allreduce, each entry from one rank: exact), and they are summed
    in Chainer's order and dtype, so the rate is the unsharded one,
    bit for bit.  The owners (``owned``: this rank's parameters) then
    scale their gradients."""
    params = [(n, p) for n, p in target.namedparams()
              if p.array is not None]
    rank = communicator.rank
    squares = numpy.zeros(len(params), numpy.float64)
    dtypes = []
    for k, (name, param) in enumerate(params):
        dtypes.append(param.grad.dtype if param.grad is not None
                      else param.array.dtype)
        if owners.get(name) == rank:
            g = param.grad.ravel()
            squares[k] = float(g.dot(g))
    squares = numpy.asarray(
        chainer.backend.CpuDevice().send(
            communicator.allreduce(squares)))
    # GradientClipping: sum(dots), each dot in its gradient's dtype.
    sqnorm = sum(numpy.dtype(d).type(s) for d, s in zip(dtypes, squares))
    rate = threshold / numpy.sqrt(sqnorm)
    if rate >= 1:
        return
    for param in owned:
        grad = param.grad
        with chainer.using_device(param.device):
            grad *= rate
