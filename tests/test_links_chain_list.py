"""MultiNodeChainList as ChainerMN's: parts that send to their own rank,
parts fed by several ranks (called as ``part(*received)``, in rank_in's
order), and the same values and gradients as the model in one process.
Serially and under mpiexec -n 2 / -n 3."""

import numpy
import pytest

from conftest import naive_comm as comm  # NOQA: the comm fixture
from conftest import chainer, needs_chainer

# Also under mpiexec -n 3: rank 0 fans out to several children.
pytestmark = [needs_chainer, pytest.mark.many_ranks]
if chainer is None:   # the core stack: nothing here runs without Chainer
    pytest.skip('needs Chainer', allow_module_level=True)

import mnopt  # NOQA


def linear(seed, n_in=3, n_out=3):
    """The same Linear on every rank."""
    link = chainer.links.Linear(n_in, n_out)
    rng = numpy.random.RandomState(seed)
    for p in link.params():
        p.array[...] = rng.standard_normal(p.shape)
    return link


class Apply(chainer.Chain):
    def __init__(self, link):
        super(Apply, self).__init__()
        with self.init_scope():
            self.f = link

    def forward(self, x):
        return self.f(x)


class WeightedSum(chainer.Chain):
    """f(sum_k (k + 1) * xs[k]): the order of the inputs shows."""

    def __init__(self, link):
        super(WeightedSum, self).__init__()
        with self.init_scope():
            self.f = link

    def forward(self, *xs):
        return self.f(sum((k + 1) * x for k, x in enumerate(xs)))


X = numpy.arange(6, dtype=numpy.float32).reshape(2, 3) / 6


def assert_grads_equal(mine, ref):
    for p, q in zip(mine.params(), ref.params()):
        numpy.testing.assert_allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_a_part_sends_to_its_own_rank(comm):
    """rank_out and rank_in naming the part's own rank (ChainerMN raised
    nothing here; mnopt's send said "cannot send to itself")."""
    me = comm.rank
    a, b = linear(1), linear(2)
    ref_a, ref_b = a.copy(mode='copy'), b.copy(mode='copy')
    model = mnopt.links.MultiNodeChainList(comm)
    model.add_link(Apply(a), rank_in=None, rank_out=me)
    model.add_link(Apply(b), rank_in=me, rank_out=None)
    y = model(X)
    ref = ref_b(ref_a(X))
    numpy.testing.assert_allclose(y.array, ref.array, rtol=1e-6)
    chainer.functions.sum(y ** 2).backward()
    chainer.functions.sum(ref ** 2).backward()
    assert_grads_equal(a, ref_a)
    assert_grads_equal(b, ref_b)


def test_branches_from_several_ranks_are_passed_in_order(comm):
    """Rank 0 sends to every other rank and to itself, each branch
    transforms it, and rank 0's last part gets them all as separate
    arguments in rank_in's order (mnopt added them up)."""
    me, n = comm.rank, comm.size
    children = list(range(1, n))
    order = children[::-1] + [0]   # not rank order: the order must hold
    first, own, last = linear(10), linear(11), linear(12)
    branch = {r: linear(20 + r) for r in children}
    # One process: last(sum_k (k + 1) * branch_k(first(x))).
    ref_first, ref_own, ref_last = (l.copy(mode='copy')
                                    for l in (first, own, last))
    ref_branch = {r: l.copy(mode='copy') for r, l in branch.items()}
    h = ref_first(X)
    outs = [ref_own(h) if r == 0 else ref_branch[r](h) for r in order]
    ref = WeightedSum(ref_last)(*outs)
    chainer.functions.sum(ref ** 2).backward()

    model = mnopt.links.MultiNodeChainList(comm)
    if me == 0:
        model.add_link(Apply(first), rank_in=None, rank_out=order)
        model.add_link(Apply(own), rank_in=0, rank_out=0)
        model.add_link(WeightedSum(last), rank_in=order, rank_out=None)
        y = model(X)
        numpy.testing.assert_allclose(y.array, ref.array, rtol=1e-5)
        chainer.functions.sum(y ** 2).backward()
        for mine, theirs in ((first, ref_first), (own, ref_own),
                             (last, ref_last)):
            assert_grads_equal(mine, theirs)
    else:
        model.add_link(Apply(branch[me]), rank_in=0, rank_out=0)
        delegate = model()
        delegate.backward()
        assert_grads_equal(branch[me], ref_branch[me])


def test_tuple_outputs_travel_whole(comm):
    """A part returning a tuple, sent to its own rank: the next part gets
    the tuple as one argument (ChainerMN's TupleData models)."""
    me = comm.rank
    a0, a1, b = linear(30), linear(31), linear(32)

    class Pair(chainer.Chain):
        def __init__(self):
            super(Pair, self).__init__()
            with self.init_scope():
                self.f0, self.f1 = a0, a1

        def forward(self, x):
            return self.f0(x), self.f1(x)

    class Unpair(chainer.Chain):
        def __init__(self):
            super(Unpair, self).__init__()
            with self.init_scope():
                self.f = b

        def forward(self, pair):
            y0, y1 = pair
            return self.f(y0 - 2 * y1)

    ref = [l.copy(mode='copy') for l in (a0, a1, b)]
    expected = ref[2](ref[0](X) - 2 * ref[1](X))
    chainer.functions.sum(expected ** 2).backward()
    model = mnopt.links.MultiNodeChainList(comm)
    model.add_link(Pair(), rank_in=None, rank_out=me)
    model.add_link(Unpair(), rank_in=me, rank_out=None)
    y = model(X)
    numpy.testing.assert_allclose(y.array, expected.array, rtol=1e-5)
    chainer.functions.sum(y ** 2).backward()
    for mine, theirs in zip((a0, a1, b), ref):
        assert_grads_equal(mine, theirs)


def test_configuration_errors_are_clear(comm):
    me, n = comm.rank, comm.size
    model = mnopt.links.MultiNodeChainList(comm)
    model.add_link(Apply(linear(1)), rank_in=None, rank_out=None)
    with pytest.raises(ValueError, match='only one part'):
        model.add_link(Apply(linear(2)), rank_in=None, rank_out=None)
    with pytest.raises(ValueError, match='not in the communicator'):
        model.add_link(Apply(linear(2)), rank_in=n, rank_out=None)

    # Sent to itself, never received (no other rank is involved).
    model = mnopt.links.MultiNodeChainList(comm)
    model.add_link(Apply(linear(1)), rank_in=None, rank_out=me)
    with pytest.raises(ValueError, match='never received'):
        model(X)
    # Received from itself, never sent.
    model = mnopt.links.MultiNodeChainList(comm)
    model.add_link(Apply(linear(1)), rank_in=me, rank_out=None)
    with pytest.raises(ValueError, match='no earlier part sent'):
        model()
