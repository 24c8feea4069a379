"""MultiNodeBatchNormalization equals single-process BatchNormalization
over the concatenated batch, forward and backward, with a different batch
size on every rank; one reduction per direction.  Serially and under
mpiexec -n 2 / -n 3."""

import numpy
import pytest

from conftest import chainer, needs_chainer

pytestmark = needs_chainer

import mnopt  # NOQA


@pytest.fixture
def comm(any_comm):
    """Every CPU communicator, reduction_server workers included."""
    return any_comm


C, H, W = 4, 3, 2


def sizes(n):
    return [3 + r for r in range(n)]   # a different batch on every rank


def full_batch(n, dtype=numpy.float32):
    rng = numpy.random.RandomState(0)
    total = sum(sizes(n))
    x = (rng.standard_normal((total, C, H, W)) * 3 + 5).astype(dtype)
    gy = rng.standard_normal((total, C, H, W)).astype(dtype)
    return x, gy


def my_slice(rank, n):
    start = sum(sizes(n)[:rank])
    return slice(start, start + sizes(n)[rank])


def count_reductions(comm, monkeypatch):
    calls = []
    real = comm.allreduce

    def counting(x):
        calls.append(x.size)
        return real(x)
    monkeypatch.setattr(comm, 'allreduce', counting)
    return calls


def single_process(x, gy):
    bn = chainer.links.BatchNormalization(C)
    bn.gamma.array[...] = numpy.arange(1, C + 1)
    bn.beta.array[...] = 0.5
    xv = chainer.Variable(x)
    y = bn(xv)
    y.grad = gy
    y.backward()
    return bn, y.array, xv.grad


def test_forward_and_backward_equal_one_process(comm, monkeypatch):
    n, r = comm.size, comm.rank
    x, gy = full_batch(n)
    bn, y_full, gx_full = single_process(x, gy)
    mnbn = mnopt.links.MultiNodeBatchNormalization(C, comm)
    mnbn.gamma.array[...] = numpy.arange(1, C + 1)
    mnbn.beta.array[...] = 0.5
    calls = count_reductions(comm, monkeypatch)
    mine = my_slice(r, n)
    xv = chainer.Variable(x[mine])
    y = mnbn(xv)
    assert calls == [2 * C + 1]   # sums, sums of squares, count: one call
    numpy.testing.assert_allclose(y.array, y_full[mine], rtol=1e-5,
                                  atol=1e-5)
    y.grad = gy[mine]
    y.backward()
    assert calls == [2 * C + 1, 2 * C]   # one more, in backward
    numpy.testing.assert_allclose(xv.grad, gx_full[mine], rtol=1e-4,
                                  atol=1e-5)
    # Parameter gradients are each rank's share; they add up to the
    # single process's (the optimizer averages them).
    for name in ('gamma', 'beta'):
        total = comm.allreduce(getattr(mnbn, name).grad)
        numpy.testing.assert_allclose(total, getattr(bn, name).grad,
                                      rtol=1e-5, atol=1e-4)
    numpy.testing.assert_allclose(mnbn.avg_mean, bn.avg_mean, rtol=1e-6)
    numpy.testing.assert_allclose(mnbn.avg_var, bn.avg_var, rtol=1e-5)


def test_float16_inputs_accumulate_in_float32(comm):
    n, r = comm.size, comm.rank
    x, gy = full_batch(n, numpy.float16)
    _, y_full, gx_full = single_process(x.astype(numpy.float32),
                                        gy.astype(numpy.float32))
    mnbn = mnopt.links.MultiNodeBatchNormalization(C, comm,
                                                   dtype=numpy.float16)
    mnbn.gamma.array[...] = numpy.arange(1, C + 1)
    mnbn.beta.array[...] = 0.5
    assert mnbn.gamma.dtype == numpy.float32
    mine = my_slice(r, n)
    xv = chainer.Variable(x[mine])
    y = mnbn(xv)
    assert y.dtype == numpy.float16
    # One float16 rounding of a float32 result.
    numpy.testing.assert_allclose(y.array, y_full[mine], rtol=2 ** -10,
                                  atol=2 ** -10 * 4)
    y.grad = gy[mine]
    y.backward()
    numpy.testing.assert_allclose(xv.grad, gx_full[mine], rtol=2 ** -9,
                                  atol=2 ** -9 * 4)


def test_evaluation_uses_running_averages_without_communicating(
        comm, monkeypatch):
    mnbn = mnopt.links.MultiNodeBatchNormalization(C, comm)
    mnbn.avg_mean[...] = 1.0
    mnbn.avg_var[...] = 4.0
    calls = count_reductions(comm, monkeypatch)
    x = numpy.full((2, C, H, W), 3.0, numpy.float32)
    with chainer.using_config('train', False):
        y = mnbn(x)
    assert calls == []
    numpy.testing.assert_allclose(y.array, (3.0 - 1.0) / numpy.sqrt(
        4.0 + 2e-5), rtol=1e-6)


def test_create_mnbn_model_replaces_every_batch_normalization(comm):
    L = chainer.links

    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.conv = L.Convolution2D(3, C, 3)
                self.bn = L.BatchNormalization(C)
                self.block = chainer.Sequential(L.Linear(4, 4),
                                                L.BatchNormalization(4))

        def forward(self, x):
            return self.block(self.bn(self.conv(x)).array.mean(axis=(2, 3)))

    net = Net()
    net.bn.avg_mean[...] = 7.0
    model = mnopt.links.create_mnbn_model(net, comm)
    assert type(net.bn) is L.BatchNormalization          # untouched
    assert isinstance(model.bn, mnopt.links.MultiNodeBatchNormalization)
    assert isinstance(model.block[1], mnopt.links.MultiNodeBatchNormalization)
    assert isinstance(model.block[0], L.Linear)
    numpy.testing.assert_array_equal(model.bn.avg_mean, 7.0)
    assert sorted(n for n, _ in model.namedparams()) == \
        sorted(n for n, _ in net.namedparams())
    y = model(numpy.ones((2, 3, 5, 5), numpy.float32))
    assert y.shape == (2, 4)
