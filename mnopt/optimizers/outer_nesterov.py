"""OuterNesterov: the outer optimizer of ``local_steps`` by default,
Nesterov momentum as PyTorch's ``SGD(nesterov=True)`` computes it (the
optimizer DiLoCo, Streaming DiLoCo and torchft's DiLoCo use as the outer
one, there at lr 0.7 and momentum 0.9; here momentum 0.5 by default, which
measured as good or better at every H from 8 to 128: docs/local_sgd.md).

Chainer's own ``NesterovAG`` is another formulation of Nesterov's method
(its step adds ``momentum**2`` times the *new* velocity), so the same lr
and momentum do not give DiLoCo's outer step; this one does:

    buf = momentum * buf + grad
    param -= lr * (grad + momentum * buf)
"""

import chainer
from chainer import optimizer


class OuterNesterovRule(optimizer.UpdateRule):
    """One parameter's update: PyTorch's SGD with ``nesterov=True``
    (no dampening, no weight decay); ``buf`` starts at zero."""

    def __init__(self, parent_hyperparam=None, lr=None, momentum=None):
        super(OuterNesterovRule, self).__init__(parent_hyperparam)
        if lr is not None:
            self.hyperparam.lr = lr
        if momentum is not None:
            self.hyperparam.momentum = momentum

    def init_state(self, param):
        with chainer.using_device(param.device):
            self.state['buf'] = param.device.xp.zeros_like(param.data)

    def update_core_cpu(self, param):
        grad = param.grad
        if grad is None:
            return
        buf = self.state['buf']
        lr, momentum = self.hyperparam.lr, self.hyperparam.momentum
        buf *= momentum
        buf += grad
        param.data -= lr * (grad + momentum * buf)

    def update_core_gpu(self, param):
        grad = param.grad
        if grad is None:
            return
        # Unverified on a GPU (written for CuPy; the CPU path is tested).
        chainer.backends.cuda.elementwise(
            'T grad, T lr, T momentum', 'T param, T buf',
            '''buf = momentum * buf + grad;
               param -= lr * (grad + momentum * buf);''',
            'mnopt_outer_nesterov')(
                grad, self.hyperparam.lr, self.hyperparam.momentum,
                param.data, self.state['buf'])


class OuterNesterov(optimizer.GradientMethod):
    """Nesterov momentum as PyTorch's ``SGD(lr, momentum,
    nesterov=True)``: DiLoCo's outer lr 0.7, and momentum 0.5 (DiLoCo's
    0.9 is for H in the hundreds; at H of tens or less it stacks on the
    inner momentum and overshoots: docs/local_sgd.md's measurements)."""

    def __init__(self, lr=0.7, momentum=0.5):
        super(OuterNesterov, self).__init__()
        self.hyperparam.lr = lr
        self.hyperparam.momentum = momentum

    lr = optimizer.HyperparameterProxy('lr')
    momentum = optimizer.HyperparameterProxy('momentum')

    def create_update_rule(self):
        return OuterNesterovRule(self.hyperparam)
