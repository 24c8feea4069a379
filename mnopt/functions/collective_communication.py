"""Differentiable collectives (ChainerMN's): each one's backward is the
collective that carries the gradients back.

On ranks that contribute no data (not the root of bcast or scatter) the
input is an empty *dummy* variable; on ranks that receive nothing (not the
root of gather) the output is a *delegate* variable (empty): backpropagate
from it (``delegate.backward()``), or keep it in the graph with
pseudo_connect, so that those ranks take part in the backward collective
too.
"""

import chainer
import numpy
from chainer import backend


def _zeros_for(grads, like):
    return tuple(backend.get_array_module(y).zeros_like(y) if g is None
                 else g for g, y in zip(grads, like))


def _sum(arrays):
    total = arrays[0].copy()
    for a in arrays[1:]:
        total += a
    return total


class _Collective(chainer.Function):
    """A collective whose last input is an *anchor*: an empty variable
    that requires a gradient, so that the function is in the graph (and its
    backward collective runs) on every rank, also where the real inputs
    are plain arrays or there are none.  Subclasses see only the real
    inputs: ``collective_forward(xs)``, ``collective_backward(xs, gys)``."""

    def forward(self, inputs):
        return self.collective_forward(inputs[:-1])

    def backward(self, inputs, grad_outputs):
        xs, anchor = inputs[:-1], inputs[-1]
        gxs = self.collective_backward(xs, grad_outputs)
        return tuple(gxs) + (backend.get_array_module(anchor).zeros_like(
            anchor),)

    def apply_to(self, xs):
        xp = backend.get_array_module(*xs) if xs else numpy
        anchor = chainer.Variable(xp.array([], dtype=numpy.float32))
        return self(*(tuple(xs) + (anchor,)))


class AllGather(_Collective):

    def __init__(self, comm):
        self.comm = comm

    def collective_forward(self, xs):
        ys = self.comm.allgather(xs[0])
        self._like = ys
        return ys

    def collective_backward(self, xs, grad_outputs):
        # My input went to every rank's slot ``rank``: its gradient is the
        # sum of what every rank holds for that slot.
        gys = self.comm.alltoall(_zeros_for(grad_outputs, self._like))
        return _sum(gys),


class AllToAll(_Collective):

    def __init__(self, comm):
        self.comm = comm

    def collective_forward(self, xs):
        ys = self.comm.alltoall(tuple(xs))
        self._like = ys
        return ys

    def collective_backward(self, xs, grad_outputs):
        return self.comm.alltoall(_zeros_for(grad_outputs, self._like))


class Bcast(_Collective):
    """Inputs: ``x`` on the root, none elsewhere."""

    def __init__(self, comm, root):
        self.comm, self.root = comm, root

    def collective_forward(self, xs):
        y = self.comm.bcast(xs[0] if self.comm.rank == self.root else None,
                            self.root)
        self._like = (y,)
        return y,

    def collective_backward(self, xs, grad_outputs):
        gy, = _zeros_for(grad_outputs, self._like)
        gys = self.comm.gather(gy, self.root)
        return (_sum(gys),) if self.comm.rank == self.root else ()


class Gather(_Collective):

    def __init__(self, comm, root):
        self.comm, self.root = comm, root

    def collective_forward(self, xs):
        x, = xs
        ys = self.comm.gather(x, self.root)
        if self.comm.rank == self.root:
            self._like = ys
            return ys
        # The delegate variable: nothing arrived here.
        return backend.get_array_module(x).array([], dtype=x.dtype),

    def collective_backward(self, xs, grad_outputs):
        if self.comm.rank == self.root:
            gx = self.comm.scatter(_zeros_for(grad_outputs, self._like),
                                   self.root)
        else:
            gx = self.comm.scatter(None, self.root)
        return gx,


class Scatter(_Collective):
    """Inputs: one array per rank on the root, none elsewhere."""

    def __init__(self, comm, root):
        self.comm, self.root = comm, root

    def collective_forward(self, xs):
        root = self.comm.rank == self.root
        y = self.comm.scatter(tuple(xs) if root else None, self.root)
        self._like = (y,)
        return y,

    def collective_backward(self, xs, grad_outputs):
        gy, = _zeros_for(grad_outputs, self._like)
        gys = self.comm.gather(gy, self.root)
        return tuple(gys) if self.comm.rank == self.root else ()


def _as_tuple(ys):
    # A Function with one output returns the Variable itself (one rank).
    return ys if isinstance(ys, tuple) else (ys,)


def _check_one_per_rank(comm, xs, what):
    if xs is None or len(xs) != comm.size:
        raise ValueError('%s needs one variable per rank (%d), got %s'
                         % (what, comm.size, 'None' if xs is None
                            else len(xs)))


def allgather(comm, x):
    """Every rank's ``x``, as a tuple in rank order."""
    return _as_tuple(AllGather(comm).apply_to((x,)))


def alltoall(comm, xs):
    """Send ``xs[r]`` to rank r; returns what every rank sent here, as a
    tuple in rank order."""
    _check_one_per_rank(comm, xs, 'alltoall')
    return _as_tuple(AllToAll(comm).apply_to(tuple(xs)))


def bcast(comm, x, root=0):
    """``x`` of ``root`` on every rank (other ranks pass None or anything:
    it is not read)."""
    return Bcast(comm, root).apply_to((x,) if comm.rank == root else ())


def gather(comm, x, root=0):
    """On ``root``, every rank's ``x`` as a tuple in rank order; elsewhere
    the delegate variable (a Variable, as ChainerMN's), to backpropagate
    from."""
    ys = Gather(comm, root).apply_to((x,))
    return _as_tuple(ys) if comm.rank == root else ys


def scatter(comm, xs, root=0):
    """``xs[r]`` of ``root`` on rank r (other ranks pass None)."""
    if comm.rank == root:
        _check_one_per_rank(comm, xs, 'scatter')
        return Scatter(comm, root).apply_to(tuple(xs))
    return Scatter(comm, root).apply_to(())
