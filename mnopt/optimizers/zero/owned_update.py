"""The wrapped optimizer's update on this rank's pieces of the parameters
only (mnopt/optimizers/zero/partition.py): its per-parameter hooks,
GradientClipping by the global norm, its update rules, and which
optimizers and hooks allow that (those that work element by element).

A piece is updated through a stand-in ``chainer.Parameter`` whose array
and gradient are flat views of the piece: an update rule keeps state of
the piece's shape, and an elementwise rule gives each element what it
gives it unsharded."""

import chainer
import numpy
from chainer import optimizer_hooks
from chainer.optimizer_hooks import GradientClipping

#: Chainer's hooks that work element by element (the piece's elements
#: get what the whole parameter's would).
ELEMENTWISE_HOOKS = (optimizer_hooks.WeightDecay, optimizer_hooks.Lasso,
                     optimizer_hooks.GradientHardClipping,
                     optimizer_hooks.GradientNoise)


def optimizer_hooks_of(optimizer, timing):
    """The optimizer's hooks of ``timing`` as (name, hook), in the order
    Chainer calls them.

    Chainer 7 keeps them in ``optimizer._hookable`` and has no public
    accessor; they are only read here, never changed."""
    hookable = optimizer._hookable
    return list((hookable._pre_update_hooks if timing == 'pre'
                 else hookable._post_update_hooks).items())


def _elementwise(thing, known):
    """Whether a rule or hook works element by element: one of ``known``,
    or one that says so (``elementwise = True``)."""
    return isinstance(thing, known) or \
        getattr(thing, 'elementwise', False) is True


def _is_chainers_rule(rule):
    """Chainer's own update rules (chainer.optimizers: SGD, MomentumSGD,
    Adam, AdaGrad, RMSprop...) and mnopt's Signum all work element by
    element."""
    module = type(rule).__module__
    return module.startswith('chainer.optimizers.') or \
        module == 'mnopt.optimizers.signum'


def _rule_problem(name, rule):
    if not (_is_chainers_rule(rule) or _elementwise(rule, ())):
        return ('shard_state splits parameters between ranks, so each '
                'update rule runs on a piece of its parameter; the rule of '
                '%r (%s) is not one of Chainer\'s, which work element by '
                'element: if yours does too, set its class\'s '
                '`elementwise = True`' % (name, type(rule).__name__))
    hookable = getattr(rule, '_hookable', None)
    for timing in ('_pre_update_hooks', '_post_update_hooks'):
        for hook_name, hook in getattr(hookable, timing, {}).items():
            if not _elementwise(hook, ELEMENTWISE_HOOKS):
                return ('shard_state splits parameters between ranks; the '
                        'update rule hook %r (%s) of %r is not known to work '
                        'element by element: remove it, or set '
                        '`elementwise = True` on it if it does'
                        % (hook_name, type(hook).__name__, name))
    return None


def optimizer_problem(optimizer):
    """Why ``optimizer`` cannot have its state sharded (a sentence), or
    None: its update must be Chainer's per-parameter one, its rules and
    per-parameter hooks elementwise."""
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
        for name, hook in optimizer_hooks_of(optimizer, timing):
            if type(hook) is GradientClipping and timing == 'pre':
                continue
            if not getattr(hook, 'call_for_each_param', False):
                return ('shard_state runs per-parameter hooks (WeightDecay, '
                        'Lasso, GradientHardClipping...) and GradientClipping; '
                        'hook %r (%s) looks at every parameter at once and '
                        'would see only this rank\'s share'
                        % (name, type(hook).__name__))
            if not _elementwise(hook, ELEMENTWISE_HOOKS):
                return ('shard_state splits parameters between ranks, so a '
                        'per-parameter hook sees a piece of its parameter; '
                        'hook %r (%s) is not known to work element by '
                        'element (GradientLARS takes norms of whole '
                        'parameters): remove it, or set `elementwise = True` '
                        'on it if it does' % (name, type(hook).__name__))
    for name, param in sorted(optimizer.target.namedparams()):
        rule = getattr(param, 'update_rule', None)
        problem = rule is not None and _rule_problem(name, rule)
        if problem:
            return problem
    return None


class PieceUpdate(object):
    """One piece of a parameter at update time: the parameter, the
    piece, and a stand-in ``chainer.Parameter`` over a flat view of the
    piece's elements.  Made once and kept across steps while the
    parameter keeps its array (building 100+ stand-ins a step cost a few
    ms of ResNet-50's update); ``take`` gives it each step's mean
    gradient, ``release`` lets go of it after the update."""

    def __init__(self, param, piece):
        self.param, self.piece = param, piece
        self.array = param.array
        self.view = self.array.reshape(-1)[piece.lo:piece.hi]
        self.stand_in = chainer.Parameter(self.view)

    def fits(self, param, piece):
        """Whether this stand-in still views ``param``'s piece ``piece``
        (not when the parameter got a new array: to_gpu, a load...)."""
        return param is self.param and param.array is self.array and \
            piece == self.piece

    def take(self, grad):
        """This step's mean gradient (flat, the piece's length) on the
        stand-in, which views the piece as a fresh one would (``release``
        put the view back after the last update)."""
        self.stand_in.grad = grad
        self.stand_in._loss_scale = getattr(self.param, '_loss_scale', None)

    def release(self):
        """Drop the gradient, and the array a rule put in the view's place
        (fp32 updates do; written back by then): a piece's mean and that
        copy are freed after the update as before the stand-ins were
        kept."""
        self.stand_in.grad = None
        if self.stand_in.array is not self.view:
            self.stand_in.array = self.view

    def write_back(self):
        """Where a rule replaced the array (fp32 updates do), its values
        into the parameter."""
        if self.stand_in.array is not self.view:
            self.view[...] = self.stand_in.array


def update_pieces(actual, communicator, target, pieces):
    """Chainer's GradientMethod.update after the backward, on this rank's
    pieces only (``pieces``: PieceUpdate's, name order) of ``target``'s
    parameters; ``actual`` is the wrapped optimizer."""
    _reallocate_cleared_grads(pieces)
    _call_hooks(actual, 'pre', communicator, target, pieces)
    actual.t += 1
    for p in pieces:
        rule = p.param.update_rule
        if rule is not None:
            rule.update(p.stand_in)
            p.write_back()
    _count_uninitialised(target)
    _reallocate_cleared_grads(pieces)
    _call_hooks(actual, 'post', communicator, target, pieces)


def _count_uninitialised(target):
    """Chainer updates every parameter, also one without data yet (a
    link made with ``in_size=None`` not used so far): its rule counts the
    update (``t``), which Adam's bias correction then starts from once
    it has data.  Every rank does the same, as none holds a piece of it."""
    for param in target.params():
        rule = getattr(param, 'update_rule', None)
        if param.array is None and rule is not None and rule.enabled:
            rule.t += 1


def _reallocate_cleared_grads(pieces):
    """GradientMethod.reallocate_cleared_grads on the pieces: zeros where
    a hook cleared a gradient."""
    for p in pieces:
        if p.stand_in.grad is None:
            xp = chainer.backend.get_array_module(p.view)
            p.stand_in.grad = xp.zeros_like(p.view)


def _call_hooks(actual, timing, communicator, target, pieces):
    """The wrapped optimizer's hooks of ``timing`` on the pieces."""
    for _, hook in optimizer_hooks_of(actual, timing):
        if getattr(hook, 'call_for_each_param', False):
            for p in pieces:
                hook(p.param.update_rule, p.stand_in)
        else:   # GradientClipping (optimizer_problem refuses others)
            clip_by_global_norm(hook.threshold, communicator, target,
                                pieces)
        _reallocate_cleared_grads(pieces)


def clip_by_global_norm(threshold, communicator, target, pieces):
    """GradientClipping with the norm of every mean gradient: each rank
    computes its pieces' squared norms (each a dot in its gradient's
    dtype, as Chainer's), one small allreduce (a float64 per parameter)
    gives every rank every parameter's, and they are summed in Chainer's
    order and dtype.  A parameter held whole by one rank gets Chainer's
    dot exactly; one that spans ranks the sum of its pieces' dots, which
    can differ from it in the last bits (docs/zero.md).  The pieces'
    gradients are then scaled."""
    params = [(n, p) for n, p in target.namedparams()
              if p.array is not None]
    index = {n: k for k, (n, _) in enumerate(params)}
    squares = numpy.zeros(len(params), numpy.float64)
    for p in pieces:
        g = p.stand_in.grad
        squares[index[p.piece.name]] += float(g.dot(g))
    squares = numpy.asarray(chainer.backend.CpuDevice().send(
        communicator.allreduce(squares)))
    # GradientClipping: sum(dots), each dot in its gradient's dtype.
    sqnorm = sum(numpy.dtype(p.array.dtype).type(s)
                 for (_, p), s in zip(params, squares))
    rate = threshold / numpy.sqrt(sqnorm)
    if rate >= 1:
        return
    for p in pieces:
        grad = p.stand_in.grad
        with chainer.using_device(p.param.device):
            grad *= rate
