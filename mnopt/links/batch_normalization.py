"""MultiNodeBatchNormalization: batch statistics over every rank's batch.

In training, the mean and variance of each channel are those of the
batches of all ranks together, as if one process normalised the
concatenated batch; the gradient goes through the same global statistics.
Each direction costs one reduction: forward sums (sum, sum of squares,
count) per channel, backward (sum of gy, sum of gy * x_hat) per channel,
packed into one float64 buffer (ChainerMN makes two in each direction).
Batch sizes may differ between ranks; float16 inputs are accumulated in
float64 and normalised in float32.  Parameters and running statistics
have the link's dtype, as chainer.links.BatchNormalization's (float16 for
float16, float32 under chainer.mixed16).  In evaluation
(chainer.config.train False) the running averages are used and nothing is
communicated.

Parameters' gradients are each rank's own (sum over its batch), as for
every other link: the multi-node optimizer averages them.
"""

import copy

import chainer
import numpy
from chainer import function
from chainer import initializers
from chainer import variable

from mnopt.links.communicator_sharing import deepcopy_sharing

#: ChainerMN's choices; 'nccl' needs a pure_nccl communicator.  Every
#: choice reduces through ``comm.allreduce`` (which uses NCCL where the
#: communicator does): the argument is checked, as ChainerMN does.
COMMUNICATION_BACKENDS = ('mpi', 'nccl', 'auto')


def _is_pure_nccl(comm):
    # Not imported at module level: the communicators import mpi4py.MPI,
    # which ``import mnopt.links`` must not start (mnopt/__init__.py).
    from mnopt.communicators.pure_nccl import PureNcclCommunicator
    return isinstance(comm, PureNcclCommunicator)


def check_communication_backend(comm, communication_backend):
    """Raises ValueError for a backend ChainerMN would refuse with
    ``comm``."""
    if communication_backend not in COMMUNICATION_BACKENDS:
        raise ValueError(
            'MultiNodeBatchNormalization: communication_backend must be one '
            'of %s, not %r' % (', '.join(COMMUNICATION_BACKENDS),
                               communication_backend))
    if communication_backend == 'nccl' and \
            not _is_pure_nccl(comm):
        raise ValueError(
            "MultiNodeBatchNormalization: communication_backend='nccl' "
            "needs the pure_nccl communicator, not %s (use 'mpi' or "
            "'auto')" % type(comm).__name__)


def _channel_axes(x):
    return (0,) + tuple(range(2, x.ndim))


def _channel_shape(x):
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


def _global_sums(comm, xp, arrays):
    """Sum each per-channel float64 vector of ``arrays`` over all ranks, in
    one reduction; returns them split again."""
    packed = xp.concatenate([xp.asarray(a, dtype=numpy.float64).ravel()
                             for a in arrays])
    total = xp.asarray(comm.allreduce(packed))
    out, start = [], 0
    for a in arrays:
        out.append(total[start:start + a.size].reshape(a.shape))
        start += a.size
    return out


def _initializer(value, default, dtype):
    """An initializer of ``dtype`` from what BatchNormalization accepts:
    None (the default constant), a scalar or array, or an initializer (a
    copy: the caller's keeps its dtype)."""
    if value is None:
        value = default
    if isinstance(value, chainer.initializer.Initializer):
        value = copy.copy(value)
        value.dtype = dtype
        return value
    return initializers.Constant(value, dtype=dtype)


class _MultiNodeBNFunction(function.Function):
    """Training-mode batch normalization with global statistics (first
    order only, like ChainerMN's)."""

    def __init__(self, comm, eps, running, decay):
        self.comm, self.eps = comm, eps
        self.running, self.decay = running, decay  # (avg_mean, avg_var)

    def forward(self, inputs):
        x, gamma, beta = inputs
        xp = chainer.backend.get_array_module(x)
        axes = _channel_axes(x)
        compute = numpy.float64 if x.dtype == numpy.float64 \
            else numpy.float32
        local_count = x.size // x.shape[1]
        s = x.sum(axis=axes, dtype=numpy.float64)
        ss = xp.square(x.astype(numpy.float64)).sum(axis=axes)
        s, ss, count = _global_sums(self.comm, xp, [
            s, ss, xp.full(1, local_count, numpy.float64)])
        count = float(count[0])
        self.count = count
        mean = s / count
        var = xp.maximum(ss / count - mean * mean, 0.0)
        self.inv_std = (1.0 / xp.sqrt(var + self.eps)).astype(compute)
        shape = _channel_shape(x)
        self.x_hat = (x.astype(compute) - mean.astype(compute).reshape(
            shape)) * self.inv_std.reshape(shape)
        y = gamma.astype(compute).reshape(shape) * self.x_hat + \
            beta.astype(compute).reshape(shape)
        if self.running is not None:
            avg_mean, avg_var = self.running
            unbiased = var * (count / max(count - 1.0, 1.0))
            avg_mean *= self.decay
            avg_mean += ((1 - self.decay) * mean).astype(avg_mean.dtype)
            avg_var *= self.decay
            avg_var += ((1 - self.decay) * unbiased).astype(avg_var.dtype)
        return y.astype(x.dtype),

    def backward(self, inputs, grad_outputs):
        x, gamma, _ = inputs
        gy, = grad_outputs
        xp = chainer.backend.get_array_module(x)
        axes = _channel_axes(x)
        compute = self.x_hat.dtype
        gy = gy.astype(compute)
        local_gbeta = gy.sum(axis=axes, dtype=numpy.float64)
        local_ggamma = (gy * self.x_hat).sum(axis=axes, dtype=numpy.float64)
        gbeta_all, ggamma_all = _global_sums(self.comm, xp,
                                             [local_gbeta, local_ggamma])
        shape = _channel_shape(x)
        mean_gy = (gbeta_all / self.count).astype(compute).reshape(shape)
        mean_gy_xhat = (ggamma_all / self.count).astype(compute).reshape(
            shape)
        gx = (gamma.astype(compute) * self.inv_std).reshape(shape) * (
            gy - mean_gy - self.x_hat * mean_gy_xhat)
        return (gx.astype(x.dtype), local_ggamma.astype(gamma.dtype),
                local_gbeta.astype(gamma.dtype))


class MultiNodeBatchNormalization(chainer.Link):
    """Batch normalization whose statistics are over the batches of every
    rank of ``comm`` (ChainerMN's link of the same name and arguments).

    ``communication_backend``: 'mpi', 'nccl' (a pure_nccl communicator
    only) or 'auto', checked as ChainerMN does; the reduction goes through
    ``comm.allreduce`` whichever it is.

    A copy of the link (``copy(mode='copy')``, ``copy.deepcopy``) shares
    the communicator."""

    def __init__(self, size, comm, decay=0.9, eps=2e-5, dtype=None,
                 use_gamma=True, use_beta=True, initial_gamma=None,
                 initial_beta=None, communication_backend='auto'):
        super(MultiNodeBatchNormalization, self).__init__()
        check_communication_backend(comm, communication_backend)
        self.communication_backend = communication_backend
        # As chainer.links.BatchNormalization: mixed16 keeps float32
        # parameters and statistics, float16 keeps float16.
        param_dtype = chainer.get_dtype(dtype, map_mixed16=numpy.float32)
        self.comm = comm
        self.decay, self.eps = decay, eps
        self.avg_mean = numpy.zeros(size, dtype=param_dtype)
        self.register_persistent('avg_mean')
        self.avg_var = numpy.ones(size, dtype=param_dtype)  # as Chainer's
        self.register_persistent('avg_var')
        self.N = 0
        self.register_persistent('N')
        with self.init_scope():
            if use_gamma:
                self.gamma = variable.Parameter(
                    _initializer(initial_gamma, 1, param_dtype), size)
            if use_beta:
                self.beta = variable.Parameter(
                    _initializer(initial_beta, 0, param_dtype), size)

    def forward(self, x, finetune=False):
        xp = self.xp
        size = self.avg_mean.shape
        gamma = self.gamma if hasattr(self, 'gamma') else variable.Variable(
            xp.ones(size, dtype=self.avg_mean.dtype))
        beta = self.beta if hasattr(self, 'beta') else variable.Variable(
            xp.zeros(size, dtype=self.avg_mean.dtype))
        if chainer.config.train:
            if finetune:
                self.N += 1
                decay = 1.0 - 1.0 / self.N
            else:
                decay = self.decay
            func = _MultiNodeBNFunction(self.comm, self.eps,
                                        (self.avg_mean, self.avg_var), decay)
            return func(x, gamma, beta)
        if gamma.dtype != x.dtype:
            gamma = chainer.functions.cast(gamma, x.dtype)
            beta = chainer.functions.cast(beta, x.dtype)
        return chainer.functions.fixed_batch_normalization(
            x, gamma, beta, xp.asarray(self.avg_mean, dtype=x.dtype),
            xp.asarray(self.avg_var, dtype=x.dtype), self.eps)

    def start_finetuning(self):
        self.N = 0

    def __deepcopy__(self, memo):
        return deepcopy_sharing(self, memo, self.comm)
