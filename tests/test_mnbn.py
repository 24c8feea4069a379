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
    """A float16 link (as chainer.links.BatchNormalization's: float16
    parameters and statistics) computes in float32."""
    n, r = comm.size, comm.rank
    x, gy = full_batch(n, numpy.float16)
    _, y_full, gx_full = single_process(x.astype(numpy.float32),
                                        gy.astype(numpy.float32))
    mnbn = mnopt.links.MultiNodeBatchNormalization(C, comm,
                                                   dtype=numpy.float16)
    mnbn.gamma.array[...] = numpy.arange(1, C + 1)
    mnbn.beta.array[...] = 0.5
    assert mnbn.gamma.dtype == mnbn.beta.dtype == numpy.float16
    assert mnbn.avg_mean.dtype == mnbn.avg_var.dtype == numpy.float16
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
    assert mnbn.gamma.grad.dtype == mnbn.beta.grad.dtype == numpy.float16


@pytest.mark.parametrize('dtype, param_dtype', [
    (numpy.float16, numpy.float16), (numpy.float32, numpy.float32),
    (numpy.float64, numpy.float64), ('mixed16', numpy.float32)])
def test_parameters_have_batch_normalizations_dtype(dtype, param_dtype):
    """The same dtypes as chainer.links.BatchNormalization, given as an
    argument or by chainer.config.dtype."""
    comm = mnopt.create_communicator('naive')
    try:
        dtype = getattr(chainer, dtype) if isinstance(dtype, str) else dtype
        with chainer.using_config('dtype', dtype):
            for mnbn, bn in (
                    (mnopt.links.MultiNodeBatchNormalization(C, comm),
                     chainer.links.BatchNormalization(C)),
                    (mnopt.links.MultiNodeBatchNormalization(
                        C, comm, dtype=dtype),
                     chainer.links.BatchNormalization(C, dtype=dtype))):
                for name in ('gamma', 'beta', 'avg_mean', 'avg_var'):
                    theirs = getattr(bn, name)
                    assert theirs.dtype == param_dtype
                    assert getattr(mnbn, name).dtype == theirs.dtype, name
                # An initializer given keeps the link's dtype too.
                mnbn = mnopt.links.MultiNodeBatchNormalization(
                    C, comm, dtype=dtype,
                    initial_gamma=chainer.initializers.Constant(2.0))
                assert mnbn.gamma.dtype == param_dtype
                numpy.testing.assert_array_equal(mnbn.gamma.array, 2.0)
        # mixed16: float16 activations, float32 parameters.
        if dtype is chainer.mixed16:
            with chainer.using_config('dtype', dtype):
                mnbn = mnopt.links.MultiNodeBatchNormalization(C, comm)
            x = numpy.random.RandomState(1).standard_normal(
                (4, C)).astype(numpy.float16)
            y = mnbn(x)
            assert y.dtype == numpy.float16
            chainer.functions.sum(y * y).backward()
            assert mnbn.gamma.grad.dtype == numpy.float32
    finally:
        comm.finalize()


def test_copies_share_the_communicator(comm):
    """copy(mode='copy') and deepcopy work (a communicator cannot be
    copied) and the copy normalises over all ranks as the original."""
    import copy
    n, r = comm.size, comm.rank

    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.bn = mnopt.links.MultiNodeBatchNormalization(C, comm)

    for original in (mnopt.links.MultiNodeBatchNormalization(C, comm),
                     Net()):
        for duplicate in (original.copy(mode='copy'),
                          copy.deepcopy(original)):
            bn = getattr(duplicate, 'bn', duplicate)
            assert bn.comm is comm
            assert bn.gamma is not getattr(original, 'bn', original).gamma
            x, gy = full_batch(n)
            _, y_full, _ = single_process(x, gy)
            bn.gamma.array[...] = numpy.arange(1, C + 1)
            bn.beta.array[...] = 0.5
            y = bn(x[my_slice(r, n)])
            numpy.testing.assert_allclose(y.array, y_full[my_slice(r, n)],
                                          rtol=1e-5, atol=1e-5)


def test_communication_backend_is_checked():
    """As ChainerMN: 'mpi' and 'auto' everywhere, 'nccl' only with the
    pure_nccl communicator, anything else refused (on every rank: the
    check needs no communication)."""
    comm = mnopt.create_communicator('naive')
    try:
        for backend in ('mpi', 'auto'):
            mnopt.links.MultiNodeBatchNormalization(
                C, comm, communication_backend=backend)
        for backend, message in (('nccl', 'pure_nccl'),
                                 ('dummy', 'must be one of'),
                                 ('MPI', 'must be one of')):
            with pytest.raises(ValueError, match=message):
                mnopt.links.MultiNodeBatchNormalization(
                    C, comm, communication_backend=backend)
            with pytest.raises(ValueError, match=message):
                mnopt.links.create_mnbn_model(
                    chainer.links.BatchNormalization(C), comm,
                    communication_backend=backend)
        model = mnopt.links.create_mnbn_model(
            chainer.Sequential(chainer.links.BatchNormalization(C)), comm,
            communication_backend='mpi')
        assert model[0].communication_backend == 'mpi'
    finally:
        comm.finalize()


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
