"""The multi-node optimizer: averages gradients, then lets the wrapped
Chainer optimizer update.  Uses only the communicator's public API."""

from mnopt.communicators.base import named_grads


class _MultiNodeOptimizer(object):
    """ChainerMN's semantics: the first update (and any update after the
    parameter set changed) broadcasts the parameters from rank 0 and applies
    nothing; every other update applies the mean gradient."""

    def __init__(self, actual_optimizer, communicator, zero_fill):
        object.__setattr__(self, 'actual_optimizer', actual_optimizer)
        object.__setattr__(self, 'communicator', communicator)
        object.__setattr__(self, 'zero_fill', zero_fill)
        object.__setattr__(self, '_param_set', None)

    def setup(self, link):
        self.actual_optimizer.setup(link)
        return self

    def _backward(self, lossfun, args, kwds):
        target = self.target
        loss = lossfun(*args, **kwds)
        if getattr(self.actual_optimizer, '_use_cleargrads', True):
            target.cleargrads()
        else:
            target.zerograds()
        loss.backward(loss_scale=self.actual_optimizer._loss_scale)

    def _param_set_changed(self):
        """True on the first call and whenever parameters appeared,
        disappeared or got their data since the previous call.

        Ranks must agree: one that re-broadcasts while the others average
        would hang the job, so a disagreement is an error on every rank.
        """
        current = [(name, p.array is not None)
                   for name, p in sorted(self.target.namedparams())]
        changed = current != self._param_set
        object.__setattr__(self, '_param_set', current)
        votes = self.communicator.allgather_obj(changed)
        if any(v != changed for v in votes):
            raise RuntimeError(
                'the parameter set changed on ranks %s but not on ranks %s; '
                'every rank must add or initialise parameters at the same '
                'update' % ([r for r, v in enumerate(votes) if v],
                            [r for r, v in enumerate(votes) if not v]))
        return changed

    def update(self, lossfun=None, *args, **kwds):
        if lossfun is not None:
            self._backward(lossfun, args, kwds)
        if self._param_set_changed():
            self.communicator.bcast_data(self.target)
            return
        self.communicator.multi_node_mean_grad(self.target, self.zero_fill)
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
            handle.wait()

    def update(self, lossfun=None, *args, **kwds):
        if lossfun is not None:
            self._backward(lossfun, args, kwds)
        if self._param_set_changed():
            self.wait()
            self.communicator.bcast_data(self.target)
            object.__setattr__(self, 'communicated_target', {})
            object.__setattr__(self, 'needs_update', False)
            return
        self.wait()
        params = dict(self.target.namedparams())
        shadows = self.communicated_target
        fresh = named_grads(self.target, self.zero_fill)
        for name, grad in fresh:
            params[name].grad = shadows.get(name)
        object.__setattr__(self, 'communicated_target', dict(fresh))
        object.__setattr__(self, '_handle',
                           self.communicator.mean_grads_async(fresh))
        if self.needs_update:
            self.actual_optimizer.update(None, *args, **kwds)
        else:
            object.__setattr__(self, 'needs_update', True)


def create_multi_node_optimizer(actual_optimizer, communicator,
                                double_buffering=False, zero_fill=True):
    """Wrap a Chainer optimizer so it averages gradients over all ranks.

    Args:
        actual_optimizer: a Chainer optimizer (e.g. MomentumSGD).
        communicator: from ``mnopt.create_communicator`` (any kind).
        double_buffering: overlap the averaging of iteration k's gradients
            with iteration k+1's forward and backward; updates then use
            gradients one iteration old.
        zero_fill: treat parameters without a gradient (unused this
            iteration) as zero gradients, so every rank reduces the same set.
    """
    cls = _DoubleBufferingOptimizer if double_buffering else _MultiNodeOptimizer
    return cls(actual_optimizer, communicator, zero_fill)
