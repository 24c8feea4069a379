"""Differentiable send and receive (ChainerMN's model-parallel functions).

``send`` returns a *delegate variable*: an empty array standing for the
data that left; backpropagating through it receives the gradient from
the peer.  ``recv`` returns the data; backpropagating through it sends the
gradient back.  ``pseudo_connect`` ties a delegate variable into the graph
of other variables, so that one backward pass reaches every send.

Every send is matched by exactly one backward receive on its rank and
every recv by one backward send, whatever the inputs: a send of arrays
that need no gradient still takes part in the backward pass (else its
peer would wait forever for a gradient that never comes).
"""

import chainer
import numpy
from chainer import backend


def _empty(xp):
    return xp.array([], dtype=numpy.float32)


def _anchor(xp):
    """An empty variable that requires a gradient: an input that puts a
    communicating function in the graph even when its real inputs need
    none (plain arrays), so its backward runs."""
    return chainer.Variable(_empty(xp))


class Send(chainer.Function):
    """Inputs: the arrays to send, then the anchor; output: the delegate."""

    def __init__(self, comm, peer_rank, peer_tag):
        self.comm, self.peer_rank, self.peer_tag = comm, peer_rank, peer_tag

    @property
    def label(self):
        return 'Send (peer_rank: %d)' % self.peer_rank

    def forward(self, inputs):
        xp = backend.get_array_module(*inputs)
        xs = inputs[:-1]
        self.comm.send(xs[0] if len(xs) == 1 else tuple(xs),
                       self.peer_rank, self.peer_tag)
        return _empty(xp),

    def backward(self, inputs, grad_outputs):
        xp = backend.get_array_module(*inputs)
        xs, anchor = inputs[:-1], inputs[-1]
        grad = self.comm.recv(self.peer_rank, self.peer_tag)
        grads = grad if isinstance(grad, tuple) else (grad,)
        if len(grads) != len(xs):
            raise ValueError(
                'send to rank %d: %d arrays were sent, %d gradients came '
                'back' % (self.peer_rank, len(xs), len(grads)))
        return tuple(xp.asarray(g, dtype=x.dtype).reshape(x.shape)
                     for g, x in zip(grads, xs)) + (xp.zeros_like(anchor),)


class Recv(chainer.Function):
    """Input: the delegate variable (or an anchor); outputs: what came."""

    def __init__(self, comm, peer_rank, peer_tag, device=-1):
        self.comm, self.peer_rank, self.peer_tag = comm, peer_rank, peer_tag
        self.device = device

    @property
    def label(self):
        return 'Recv (peer_rank: %d)' % self.peer_rank

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
    """Send ``x`` (a Variable or array, or a tuple/list of them) to
    ``rank``; returns the delegate variable (see the module's doc)."""
    if rank == communicator.rank:
        raise ValueError('rank %d cannot send to itself (the receive would '
                         'never come)' % rank)
    xs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    if not xs:
        raise ValueError('send: nothing to send (an empty %s)'
                         % type(x).__name__)
    xp = backend.get_array_module(*xs)
    delegate = Send(communicator, rank, tag)(*(xs + (_anchor(xp),)))
    delegate.name = 'delegate_variable'
    return delegate


def recv(communicator, rank, delegate_variable=None, tag=0, device=-1,
         force_tuple=False):
    """Receive what ``rank`` sends; with ``delegate_variable`` (from an
    earlier ``send``), the received variables are tied after it in the
    graph.  A tuple when several arrays were sent, or with
    ``force_tuple``.  (``device``: ChainerMN 5's argument, a GPU to move
    the arrays to; they otherwise arrive on the current device if they
    left from a GPU.)"""
    if rank == communicator.rank:
        raise ValueError('rank %d cannot receive from itself' % rank)
    function = Recv(communicator, rank, tag, device)
    if delegate_variable is None:
        res = function(_anchor(numpy))
    else:
        delegate_variable.name = 'delegate_variable'
        res = function(delegate_variable)
    if force_tuple and not isinstance(res, tuple):
        return (res,)
    return res


class PseudoConnect(chainer.FunctionNode):
    """Inputs: the delegate, then the actual variables; outputs: the actual
    variables, unchanged."""

    def forward(self, inputs):
        delegate = inputs[0]
        self._delegate = (backend.get_array_module(delegate),
                          delegate.shape, delegate.dtype)
        return tuple(inputs[1:])

    def backward(self, target_input_indexes, grad_outputs):
        xp, shape, dtype = self._delegate
        # The delegate gets a zero gradient: its only use is to make the
        # backward pass reach what produced it.
        return (chainer.Variable(xp.zeros(shape, dtype)),) + \
            tuple(grad_outputs)


def pseudo_connect(delegate_variable, *actual_variables):
    """``actual_variables`` unchanged, as a tuple (one element for one
    variable, ``()`` for none), but with ``delegate_variable`` among their
    ancestors: backpropagating from them also runs what produced the
    delegate (a send whose gradient must be received).  A None delegate
    stands for an empty one (nothing to reach)."""
    if delegate_variable is None:
        xp = backend.get_array_module(*actual_variables) \
            if actual_variables else numpy
        delegate_variable = _empty(xp)
    return PseudoConnect().apply((delegate_variable,) + actual_variables)
