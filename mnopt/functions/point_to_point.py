"""Differentiable send and receive (ChainerMN's model-parallel functions).

``send`` returns a *delegate variable*: an empty array standing for the
data that left; backpropagating through it receives the gradient from
the peer.  ``recv`` returns the data; backpropagating through it sends the
gradient back.  ``pseudo_connect`` ties a delegate variable into the graph
of other variables, so that one backward pass reaches every send.
"""

import chainer
import numpy
from chainer import backend


def _empty(xp):
    return xp.array([], dtype='float32')


class Send(chainer.Function):

    def __init__(self, comm, peer_rank, peer_tag):
        self.comm, self.peer_rank, self.peer_tag = comm, peer_rank, peer_tag

    def forward(self, inputs):
        xp = backend.get_array_module(*inputs)
        self.comm.send(inputs[0] if len(inputs) == 1 else tuple(inputs),
                       self.peer_rank, self.peer_tag)
        return _empty(xp),

    def backward(self, inputs, grad_outputs):
        xp = backend.get_array_module(*inputs)
        grad = self.comm.recv(self.peer_rank, self.peer_tag)
        grads = grad if isinstance(grad, tuple) else (grad,)
        return tuple(xp.asarray(g, dtype=x.dtype).reshape(x.shape)
                     for g, x in zip(grads, inputs))


class Recv(chainer.Function):

    def __init__(self, comm, peer_rank, peer_tag, device=-1):
        self.comm, self.peer_rank, self.peer_tag = comm, peer_rank, peer_tag
        self.device = device

    def forward(self, inputs):
        data = self.comm.recv(self.peer_rank, self.peer_tag)
        data = data if isinstance(data, tuple) else (data,)
        if isinstance(self.device, int) and self.device >= 0:
            data = tuple(chainer.backends.cuda.to_gpu(x, self.device)
                         for x in data)
        self._zeros = [backend.get_array_module(y).zeros_like(y)
                       for y in data]   # for outputs given no gradient
        return data

    def backward(self, inputs, grad_outputs):
        xp = backend.get_array_module(*inputs)
        grads = tuple(z if g is None else g
                      for g, z in zip(grad_outputs, self._zeros))
        self.comm.send(grads[0] if len(grads) == 1 else grads,
                       self.peer_rank, self.peer_tag)
        return tuple(xp.zeros_like(x) for x in inputs)


def send(x, communicator, rank, tag=0):
    """Send ``x`` (a Variable or a tuple of them) to ``rank``; returns the
    delegate variable (see the module's doc)."""
    if rank == communicator.rank:
        raise ValueError('rank %d cannot send to itself' % rank)
    xs = x if isinstance(x, (tuple, list)) else (x,)
    return Send(communicator, rank, tag)(*xs)


def recv(communicator, rank, delegate_variable=None, tag=0, device=-1,
         force_tuple=False):
    """Receive what ``rank`` sends; with ``delegate_variable`` (from an
    earlier ``send``), the received variables are tied after it in the
    graph.  A tuple when several arrays were sent, or with
    ``force_tuple``."""
    if rank == communicator.rank:
        raise ValueError('rank %d cannot receive from itself' % rank)
    function = Recv(communicator, rank, tag, device)
    if delegate_variable is None:
        # A graph node needs an input: an empty one, given no gradient.
        res = function(chainer.Variable(_empty(numpy)))
    else:
        delegate_variable.name = 'delegate_variable'
        res = function(delegate_variable)
    if force_tuple and not isinstance(res, tuple):
        return (res,)
    return res


class PseudoConnect(chainer.Function):

    def forward(self, inputs):
        return inputs[1:]

    def backward(self, inputs, grad_outputs):
        xp = backend.get_array_module(*inputs)
        grads = tuple(xp.zeros_like(x) if g is None else g
                      for g, x in zip(grad_outputs, inputs[1:]))
        return (xp.zeros_like(inputs[0]),) + grads


def pseudo_connect(delegate_variable, *actual_variables):
    """``actual_variables`` unchanged, but with ``delegate_variable`` among
    their ancestors: backpropagating from them also runs what produced the
    delegate (a send whose gradient must be received).  With no actual
    variables, the delegate itself."""
    if not actual_variables:
        return delegate_variable
    return PseudoConnect()(delegate_variable, *actual_variables)
