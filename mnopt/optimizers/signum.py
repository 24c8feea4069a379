"""Signum, the optimizer made for sign compression: momentum, then a step
of ``lr`` in the direction of its sign."""

import chainer


class SignumRule(chainer.optimizer.UpdateRule):
    """Signum's update of one parameter (its state: the momentum ``m``)."""

    def init_state(self, param):
        xp = chainer.backend.get_array_module(param.data)
        with chainer.using_device(param.device):
            self.state['m'] = xp.zeros_like(param.data)

    def update_core(self, param):
        grad = param.grad
        if grad is None:
            return
        hp = self.hyperparam
        m = self.state['m']
        # m <- beta m + (1 - beta) g;  w <- w - lr sign(m)
        m *= hp.momentum
        m += (1 - hp.momentum) * grad
        xp = chainer.backend.get_array_module(param.data)
        param.data -= hp.lr * xp.sign(m).astype(param.data.dtype, copy=False)


class Signum(chainer.optimizer.GradientMethod):
    """Signum (Bernstein et al., 2018): momentum, then a step of ``lr`` in
    the direction of its sign: ``m = beta m + (1 - beta) g; w -= lr sign(m)``.

    Made for sign compression (``create_communicator(...,
    compression='sign')``): the gradients it sees are the voted signs times
    a scale, which it ignores; the momentum smooths the votes from step to
    step.  ``momentum=0`` is plain signSGD on the vote.  Weight decay goes
    through Chainer's hooks (``WeightDecay``), as for any optimizer.
    """

    def __init__(self, lr=1e-3, momentum=0.9):
        super(Signum, self).__init__()
        if not 0 <= momentum < 1:
            raise ValueError('momentum must be in [0, 1), not %r' % momentum)
        self.hyperparam.lr = lr
        self.hyperparam.momentum = momentum

    lr = chainer.optimizer.HyperparameterProxy('lr')
    momentum = chainer.optimizer.HyperparameterProxy('momentum')

    def create_update_rule(self):
        return SignumRule(self.hyperparam)
