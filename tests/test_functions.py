"""The differentiable communication functions and MultiNodeChainList
(model parallelism): forward values and gradients, exactly.  Serially and
under mpiexec -n 2 / -n 3."""

import numpy
import pytest

from conftest import chainer, needs_chainer

# Also under mpiexec -n 3: all-to-all and point-to-point chains over 3 ranks.
pytestmark = [needs_chainer, pytest.mark.many_ranks]

import mnopt  # NOQA


@pytest.fixture
def comm(any_comm):
    """Every CPU communicator, reduction_server workers included."""
    return any_comm


# The Chainer layer's functions, where Chainer is installed (the core
# stack has none: this module's tests are skipped there).
F = mnopt.functions if chainer is not None else None


def var(values):
    return chainer.Variable(numpy.asarray(values, numpy.float32))


def weighted_sum(ys):
    """sum_r (r + 1) * sum(ys[r])."""
    return sum((r + 1) * chainer.functions.sum(y) for r, y in enumerate(ys))


def test_allgather(comm):
    r, n = comm.rank, comm.size
    x = var(numpy.full(2, r + 1.0))
    ys = F.allgather(comm, x)
    assert [float(y.array[0]) for y in ys] == [k + 1.0 for k in range(n)]
    weighted_sum(ys).backward()
    # Every rank's loss weighs my slot by (r + 1).
    numpy.testing.assert_array_equal(x.grad, n * (r + 1.0))


def test_alltoall(comm):
    r, n = comm.rank, comm.size
    xs = [var(numpy.full(2, 10.0 * r + k)) for k in range(n)]
    ys = F.alltoall(comm, xs)
    assert [float(y.array[0]) for y in ys] == [10.0 * k + r
                                               for k in range(n)]
    weighted_sum(ys).backward()
    for x in xs:   # rank k weighs what I sent it by (my rank + 1)
        numpy.testing.assert_array_equal(x.grad, r + 1.0)


def test_bcast(comm):
    r, n = comm.rank, comm.size
    root = n - 1
    x = var(numpy.arange(3.0)) if r == root else None
    y = F.bcast(comm, x, root=root)
    numpy.testing.assert_array_equal(y.array, numpy.arange(3.0))
    ((r + 1) * chainer.functions.sum(y)).backward()
    if r == root:
        numpy.testing.assert_array_equal(x.grad, n * (n + 1) / 2.0)


def test_gather_and_scatter(comm):
    r, n = comm.rank, comm.size
    x = var(numpy.full(2, float(r)))
    ys = F.gather(comm, x, root=0)
    if r == 0:
        assert isinstance(ys, tuple)
        assert [float(y.array[0]) for y in ys] == list(map(float, range(n)))
        weighted_sum(ys).backward()
    else:
        # ChainerMN's: the delegate variable, to backpropagate from.
        assert isinstance(ys, chainer.Variable) and ys.array.size == 0
        ys.backward()
    numpy.testing.assert_array_equal(x.grad, r + 1.0)

    xs = [var(numpy.full(2, float(k))) for k in range(n)] if r == 0 else None
    y = F.scatter(comm, xs, root=0)
    numpy.testing.assert_array_equal(y.array, float(r))
    ((r + 1) * chainer.functions.sum(y)).backward()
    if r == 0:
        for k, xk in enumerate(xs):
            numpy.testing.assert_array_equal(xk.grad, k + 1.0)


def test_collectives_of_plain_arrays_still_backpropagate(comm):
    """Inputs that need no gradient (arrays, not Variables) on one rank
    must not keep that rank out of the backward collective the others
    enter: it would leave them waiting."""
    r, n = comm.rank, comm.size
    x = numpy.arange(3.0).astype(numpy.float32)
    y = F.bcast(comm, x if r == 0 else None, root=0)
    ((r + 1) * chainer.functions.sum(y)).backward()   # root: nothing to get

    ys = F.allgather(comm, numpy.full(2, r, numpy.float32))
    weighted_sum(ys).backward()
    # And the communicator is still in step: a gradient-carrying call works.
    v = var(numpy.full(2, r + 1.0))
    ys = F.allgather(comm, v)
    weighted_sum(ys).backward()
    numpy.testing.assert_array_equal(v.grad, n * (r + 1.0))


def test_pseudo_connect_returns_a_tuple():
    delegate = chainer.Variable(numpy.zeros(0, numpy.float32))
    a, b = var([1.0, 2.0]), var([3.0])
    one = F.pseudo_connect(delegate, a)
    assert isinstance(one, tuple) and len(one) == 1
    numpy.testing.assert_array_equal(one[0].array, a.array)
    assert F.pseudo_connect(delegate) == ()
    y, z = F.pseudo_connect(delegate, a, b)
    (2 * chainer.functions.sum(y) + 3 * chainer.functions.sum(z)).backward()
    numpy.testing.assert_array_equal(a.grad, 2.0)
    numpy.testing.assert_array_equal(b.grad, 3.0)
    numpy.testing.assert_array_equal(delegate.grad, numpy.zeros(0))
    # No delegate (a part with nothing sent before it): the actual values.
    c = var([4.0])
    w, = F.pseudo_connect(None, c)
    (5 * chainer.functions.sum(w)).backward()
    numpy.testing.assert_array_equal(c.grad, 5.0)


def test_send_of_plain_arrays_still_receives_the_gradient(comm):
    """A send of arrays that need no gradient still receives the one its
    peer's recv sends back (ChainerMN's test_non_variable_send)."""
    r, n = comm.rank, comm.size
    if n == 1:
        return
    if r == 0:
        x = numpy.ones((1, 3), numpy.float32)
        delegate = F.send(x, comm, rank=1)
        assert delegate.array.size == 0
        y, = F.pseudo_connect(delegate, x)
        chainer.functions.sum(y).backward()   # runs the send's backward
        # In step: the next exchange pairs up with the peer's.
        delegate = F.send(var([7.0]), comm, rank=1)
        delegate.backward()
    elif r == 1:
        x = F.recv(comm, rank=0)
        chainer.functions.sum(x).backward()
        y = F.recv(comm, rank=0)
        numpy.testing.assert_array_equal(y.array, [7.0])
        chainer.functions.sum(y).backward()


def test_send_recv_and_pseudo_connect(comm):
    r, n = comm.rank, comm.size
    if n == 1:
        with pytest.raises(ValueError, match='cannot send to itself'):
            F.send(var([1.0]), comm, rank=0)
        return
    if r == 0:
        x = var([1.0, 2.0, 3.0])
        delegate = F.send(x * 2, comm, rank=1)
        other = var([5.0])
        z, = F.pseudo_connect(delegate, other * 3)
        chainer.functions.sum(z).backward()
        numpy.testing.assert_array_equal(x.grad, 2 * 4.0)  # d(4y)/dy, y=2x
        numpy.testing.assert_array_equal(other.grad, 3.0)
    elif r == 1:
        y = F.recv(comm, rank=0)
        numpy.testing.assert_array_equal(y.array, [2.0, 4.0, 6.0])
        chainer.functions.sum(4 * y).backward()


def test_multi_node_chain_list_equals_one_process(comm):
    r, n = comm.rank, comm.size
    L = chainer.links
    rng = numpy.random.RandomState(0)
    first, second = L.Linear(3, 4), L.Linear(4, 2)
    for link in (first, second):
        for p in link.params():
            p.array[...] = rng.standard_normal(p.shape)
    x = numpy.arange(6, dtype=numpy.float32).reshape(2, 3)
    # The same model in one process.
    alone = chainer.Sequential(first.copy(mode='copy'),
                               second.copy(mode='copy'))
    chainer.functions.sum(alone(x) ** 2).backward()

    model = mnopt.links.MultiNodeChainList(comm)
    if n == 1:   # one rank: one part holds the whole model
        model.add_link(chainer.Sequential(first, second))
    elif r == 0:
        model.add_link(first, rank_in=None, rank_out=1)
    elif r == 1:
        model.add_link(second, rank_in=0, rank_out=None)
    if r > 1:
        return   # not in the model
    y = model(x)
    if n == 1 or r == 1:
        numpy.testing.assert_allclose(y.array, alone(x).array, rtol=1e-6)
        loss = chainer.functions.sum(y ** 2)
    else:
        loss = y   # the delegate variable
    loss.backward()
    for mine, ref in ((first, alone[0]), (second, alone[1])):
        if mine.W.grad is not None:
            numpy.testing.assert_allclose(mine.W.grad, ref.W.grad,
                                          rtol=1e-5)
