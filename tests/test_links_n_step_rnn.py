"""create_multi_node_n_step_rnn (ChainerMN's): an RNN whose initial states
come from the previous rank and whose final states go to the next equals
the RNNs chained in one process, values and gradients (h's and c's
gradients must go back each to its own send).  Serially and under
mpiexec -n 2 / -n 3."""

import numpy
import pytest

from conftest import naive_comm as comm  # NOQA: the comm fixture
from conftest import chainer, needs_chainer

pytestmark = needs_chainer

import mnopt  # NOQA

N_IN, N_HID = 3, 4


def lstm(seed):
    """The same NStepLSTM on every rank (no dropout: deterministic)."""
    link = chainer.links.NStepLSTM(1, N_IN, N_HID, dropout=0.0)
    rng = numpy.random.RandomState(seed)
    for p in link.params():
        p.array[...] = rng.standard_normal(p.shape) * 0.5
    return link


def sequences(seed):
    rng = numpy.random.RandomState(seed)
    return [rng.standard_normal((length, N_IN)).astype(numpy.float32)
            for length in (4, 2, 3)]


def loss_of(ys, weights):
    return sum(chainer.functions.sum(w * y) for w, y in zip(weights, ys))


def test_states_pass_from_rank_to_rank(comm):
    me, n = comm.rank, comm.size
    links = [lstm(100 + r) for r in range(n)]
    refs = [link.copy(mode='copy') for link in links]
    xs = [sequences(200 + r) for r in range(n)]
    # Output weights that differ per element, so that h's and c's
    # gradients differ: swapped, the test fails.
    weights = [numpy.random.RandomState(300 + r).standard_normal(
        (N_HID,)).astype(numpy.float32) for r in range(n)]

    # One process: rank r's RNN starts from rank r - 1's final states.
    h = c = None
    total = 0
    for r in range(n):
        h, c, ys = refs[r](h, c, xs[r])
        total += loss_of(ys, [weights[r]] * len(ys))
    (total + chainer.functions.sum(h * c)).backward()

    rnn = mnopt.links.create_multi_node_n_step_rnn(
        links[me], comm, rank_in=me - 1 if me > 0 else None,
        rank_out=me + 1 if me < n - 1 else None)
    assert isinstance(rnn, chainer.Chain)
    hy, cy, ys, delegate = rnn(xs[me])
    assert (delegate is None) == (me == n - 1)
    loss = loss_of(ys, [weights[me]] * len(ys))
    if me == n - 1:
        loss = loss + chainer.functions.sum(hy * cy)
    else:
        loss, = mnopt.functions.pseudo_connect(delegate, loss)
    loss.backward()
    for mine, ref in zip(links[me].params(), refs[me].params()):
        numpy.testing.assert_allclose(mine.grad, ref.grad, rtol=1e-4,
                                      atol=1e-5)
    if me == n - 1:
        numpy.testing.assert_allclose(hy.array, h.array, rtol=1e-5)


def test_only_stacked_rnn_links(comm):
    with pytest.raises(ValueError, match='stacked RNN link'):
        mnopt.links.create_multi_node_n_step_rnn(
            chainer.links.Linear(2, 2), comm)
    with pytest.raises(ValueError, match='not in the communicator'):
        mnopt.links.create_multi_node_n_step_rnn(
            lstm(0), comm, rank_out=comm.size)
