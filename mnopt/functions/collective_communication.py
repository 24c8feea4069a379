"""Differentiable collectives (ChainerMN's): each one's backward is the
collective that carries the gradients back.

On ranks that contribute no data (not the root of bcast or scatter) the
input is an empty *dummy* variable; on ranks that receive nothing (not the
root of gather) the output is one: keep it in the graph (e.g. add its sum
to the loss, or use pseudo_connect) so that those ranks take part in the
backward collective too.
"""

import chainer
import numpy
from chainer import backend


def _empty(xp=numpy):
    return xp.array([], dtype=numpy.float32)


def _dummy():
    return chainer.Variable(_empty())


def _zeros_for(grads, like):
    return tuple(backend.get_array_module(y).zeros_like(y) if g is None
                 else g for g, y in zip(grads, like))


class AllGather(chainer.Function):

    def __init__(self, comm):
        self.comm = comm

    def forward(self, inputs):
        ys = self.comm.allgather(inputs[0])
        self._like = ys
        return ys

    def backward(self, inputs, grad_outputs):
        # My input went to every rank's slot ``rank``: its gradient is the
        # sum of what every rank holds for that slot.
        gys = self.comm.alltoall(_zeros_for(grad_outputs, self._like))
        gx = gys[0].copy()
        for g in gys[1:]:
            gx += g
        return gx,


class AllToAll(chainer.Function):

    def __init__(self, comm):
        self.comm = comm

    def forward(self, inputs):
        if len(inputs) != self.comm.size:
            raise ValueError('alltoall needs one variable per rank (%d), got '
                             '%d' % (self.comm.size, len(inputs)))
        ys = self.comm.alltoall(tuple(inputs))
        self._like = ys
        return ys

    def backward(self, inputs, grad_outputs):
        return self.comm.alltoall(_zeros_for(grad_outputs, self._like))


class Bcast(chainer.Function):

    def __init__(self, comm, root):
        self.comm, self.root = comm, root

    def forward(self, inputs):
        x = inputs[0] if self.comm.rank == self.root else None
        y = self.comm.bcast(x, self.root)
        self._like = (y,)
        return y,

    def backward(self, inputs, grad_outputs):
        gy, = _zeros_for(grad_outputs, self._like)
        gys = self.comm.gather(gy, self.root)
        if self.comm.rank != self.root:
            return backend.get_array_module(inputs[0]).zeros_like(inputs[0]),
        gx = gys[0].copy()
        for g in gys[1:]:
            gx += g
        return gx,


class Gather(chainer.Function):

    def __init__(self, comm, root):
        self.comm, self.root = comm, root

    def forward(self, inputs):
        x, = inputs
        ys = self.comm.gather(x, self.root)
        if self.comm.rank == self.root:
            self._like = ys
            return ys
        return _empty(backend.get_array_module(x)),

    def backward(self, inputs, grad_outputs):
        if self.comm.rank == self.root:
            gx = self.comm.scatter(_zeros_for(grad_outputs, self._like),
                                   self.root)
        else:
            gx = self.comm.scatter(None, self.root)
        return gx,


class Scatter(chainer.Function):

    def __init__(self, comm, root):
        self.comm, self.root = comm, root

    def forward(self, inputs):
        root = self.comm.rank == self.root
        y = self.comm.scatter(tuple(inputs) if root else None, self.root)
        self._like = (y,)
        return y,

    def backward(self, inputs, grad_outputs):
        gy, = _zeros_for(grad_outputs, self._like)
        gys = self.comm.gather(gy, self.root)
        if self.comm.rank == self.root:
            return tuple(gys)
        return backend.get_array_module(inputs[0]).zeros_like(inputs[0]),


def _as_tuple(ys):
    # A Function with one output returns the Variable itself (one rank).
    return ys if isinstance(ys, tuple) else (ys,)


def allgather(comm, x):
    """Every rank's ``x``, as a tuple in rank order."""
    return _as_tuple(AllGather(comm)(x))


def alltoall(comm, xs):
    """Send ``xs[r]`` to rank r; returns what every rank sent here."""
    return _as_tuple(AllToAll(comm)(*xs))


def bcast(comm, x, root=0):
    """``x`` of ``root`` on every rank (other ranks pass None or anything:
    it is not read)."""
    return Bcast(comm, root)(x if comm.rank == root else _dummy())


def gather(comm, x, root=0):
    """On ``root``, every rank's ``x`` as a tuple; elsewhere a dummy (in a
    tuple too)."""
    return _as_tuple(Gather(comm, root)(x))


def scatter(comm, xs, root=0):
    """``xs[r]`` of ``root`` on rank r (other ranks pass None)."""
    if comm.rank == root:
        return Scatter(comm, root)(*xs)
    return Scatter(comm, root)(_dummy())
