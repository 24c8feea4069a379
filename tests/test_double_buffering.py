"""create_multi_node_optimizer(..., double_buffering=True) on every CPU
communicator: ChainerMN's semantics, one step stale.

Iteration k's gradient on rank r is (k + 1) * (r + 1) + pattern, so its
mean is (k + 1) * (N + 1) / 2 + pattern.  With SGD and lr=1 the step an
update applies is exactly the mean it used.
"""

import numpy
import pytest

chainer = pytest.importorskip(
    'chainer', reason='the Chainer layer (the numpy1 and numpy2 stacks run it)')

import mnopt
from conftest import WORLD, make_model, run_mpi

# Also under mpiexec -n 3: the one-step-stale mean of three ranks.
pytestmark = pytest.mark.many_ranks

SHAPES = [(3,), (2, 5), (40000,)]  # the last one is reduced in place


def pattern(shape):
    return numpy.arange(int(numpy.prod(shape))).reshape(shape) % 5 * 0.25


def grads_at(k, rank, shape, dtype=numpy.float32):
    return ((k + 1) * (rank + 1) + pattern(shape)).astype(dtype)


def mean_at(k, shape, size):
    return (k + 1) * (size + 1) / 2.0 + pattern(shape)


def make_optimizer(comm, shapes=SHAPES, lazy=False):
    model = make_model(shapes)
    if lazy:  # a parameter without data yet, as lazily built links have
        with model.init_scope():
            model.late = chainer.Parameter()
    for _, p in model.namedparams():
        if p.array is not None:
            p.array[...] = 100 * (comm.rank + 1)
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(lr=1.0), comm, double_buffering=True)
    return model, opt.setup(model)


def set_grads(model, k, rank):
    for _, p in sorted(model.namedparams()):
        if p.array is not None:
            p.grad = grads_at(k, rank, p.shape)
        else:
            p.cleargrad()  # as update(lossfun) does via cleargrads()


@pytest.mark.parametrize('wire', [None, 'float16', 'bfloat16'])
def test_updates_apply_the_previous_iterations_mean(comm_name, wire):
    comm = mnopt.create_communicator(comm_name, allreduce_grad_dtype=wire)
    model, opt = make_optimizer(comm)
    rtol = {None: 1e-6, 'float16': 4e-3, 'bfloat16': 3e-2}[wire]
    expected = {n: numpy.full(p.shape, 100.0)  # rank 0's, broadcast
                for n, p in model.namedparams()}
    for k in range(6):
        set_grads(model, k, comm.rank)
        opt.update()
        # update 0 broadcasts; update 1 starts averaging and applies
        # nothing; update k >= 2 applies the mean of iteration k - 1.
        assert opt.t == max(0, k - 1)
        for name, p in sorted(model.namedparams()):
            if k >= 2:
                expected[name] = expected[name] - mean_at(k - 1, p.shape,
                                                          comm.size)
            numpy.testing.assert_allclose(p.array, expected[name], rtol=rtol,
                                          err_msg='%s after update %d'
                                          % (name, k))
        opt.wait()
        if k >= 1:  # iteration k's gradients, now averaged
            for name, p in sorted(model.namedparams()):
                numpy.testing.assert_allclose(
                    opt.communicated_target[name],
                    mean_at(k, p.shape, comm.size), rtol=rtol)
    comm.finalize()


def test_a_new_parameter_triggers_a_fresh_broadcast(comm_name):
    comm = mnopt.create_communicator(comm_name)
    model, opt = make_optimizer(comm, [(4,)], lazy=True)
    for k in range(3):
        set_grads(model, k, comm.rank)
        opt.update()
    assert opt.t == 1
    model.late.initialize((3,))
    model.late.array[...] = comm.rank + 7         # differs across ranks
    for k in range(3, 6):
        set_grads(model, k, comm.rank)
        opt.update()
        if k == 3:    # re-broadcast: every rank now holds rank 0's values
            numpy.testing.assert_array_equal(model.late.array, 7)
            assert opt.t == 1
    # 4 restarts the pipeline (nothing applied), 5 applies iteration 4.
    assert opt.t == 2
    numpy.testing.assert_allclose(
        model.late.array, 7 - mean_at(4, (3,), comm.size), rtol=1e-6)
    ws = comm.allgather(model.late.array)
    for w in ws:
        numpy.testing.assert_array_equal(w, ws[0])


def test_background_exception_reaches_the_caller(comm_name, monkeypatch):
    comm = mnopt.create_communicator(comm_name)
    model, opt = make_optimizer(comm, [(4,)])
    set_grads(model, 0, comm.rank)
    opt.update()                                   # broadcast

    def broken_mean(*args):       # whatever _mean takes
        raise RuntimeError('link down')
    monkeypatch.setattr(comm, '_mean', broken_mean)  # on every rank
    opt.update()                                   # fails in the background
    with pytest.raises(RuntimeError, match='link down'):
        opt.wait()
    opt.wait()                                     # raised once, not again
    set_grads(model, 1, comm.rank)
    opt.update()
    with pytest.raises(RuntimeError, match='link down'):
        opt.update()                               # ... or at the next update
    comm.finalize()


def test_background_layout_mismatch_raises_on_every_rank(comm_name):
    if WORLD.size == 1:
        pytest.skip('a mismatch needs two ranks')
    comm = mnopt.create_communicator(comm_name)
    model = make_model([(4,), (3,)])
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(lr=1.0), comm, double_buffering=True,
        zero_fill=False).setup(model)
    set_grads(model, 0, comm.rank)
    opt.update()
    set_grads(model, 1, comm.rank)
    if comm.rank == 1:
        model.p001.grad = None    # skipped here (zero_fill=False) only
    opt.update()
    with pytest.raises(mnopt.LayoutMismatchError, match='rank 0 vs rank 1'):
        opt.wait()


def test_parameter_set_changing_on_one_rank_only_is_an_error(comm_name):
    if WORLD.size == 1:
        pytest.skip('needs two ranks')
    comm = mnopt.create_communicator(comm_name)
    model, opt = make_optimizer(comm, [(4,)], lazy=True)
    set_grads(model, 0, comm.rank)
    opt.update()
    if comm.rank == 1:
        model.late.initialize((2,))
    set_grads(model, 1, comm.rank)
    with pytest.raises(RuntimeError, match=r'changed on ranks \[1\] but not '
                                           r'on ranks \[0'):
        opt.update()


def test_without_double_buffering_nothing_is_stale(comm_name):
    comm = mnopt.create_communicator(comm_name)
    model = make_model([(3,)])
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(lr=1.0), comm).setup(model)
    set_grads(model, 0, comm.rank)
    opt.update()
    set_grads(model, 1, comm.rank)
    opt.update()
    numpy.testing.assert_allclose(model.p000.array,
                                  -mean_at(1, (3,), comm.size))


ONE_RANK_FAILS = '''
import sys, numpy, chainer, mnopt
sys.path.insert(0, 'tests')
from param_models import make_model
comm = mnopt.create_communicator('flat')
model = make_model([(1000,)])
opt = mnopt.create_multi_node_optimizer(chainer.optimizers.SGD(), comm,
                                        double_buffering=True).setup(model)
for k in range(5):
    model.p000.grad = numpy.ones(1000, numpy.float32)
    if comm.rank == 1 and k == 2:
        model.p000.grad = numpy.ones(1000, numpy.int32)
    opt.update()
print('rank %d finished' % comm.rank)
'''


@pytest.mark.spawn
def test_background_failure_on_one_rank_ends_the_job():
    proc = run_mpi(2, ONE_RANK_FAILS, timeout=60, module_runner=False)
    assert proc.returncode != 0
    assert 'int32' in proc.stderr
    assert 'rank 0 finished' not in proc.stdout


EXIT_IN_FLIGHT = '''
import sys, numpy, chainer, mnopt
sys.path.insert(0, 'tests')
from param_models import make_model
comm = mnopt.create_communicator(sys.argv[1])
model = make_model([(300000,)])
opt = mnopt.create_multi_node_optimizer(chainer.optimizers.SGD(), comm,
                                        double_buffering=True).setup(model)
for k in range(4):
    model.p000.grad = numpy.ones(300000, numpy.float32)
    opt.update()
if sys.argv[2] == 'finalize':
    comm.finalize()
print('rank %d leaving with an averaging in flight' % comm.rank)
'''


@pytest.mark.spawn
@pytest.mark.parametrize('how', ['exit', 'finalize'])
def test_exit_with_an_averaging_in_flight_does_not_hang(how):
    proc = run_mpi(2, EXIT_IN_FLIGHT, timeout=60, args=['hierarchical', how])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count('leaving with an averaging in flight') == 2


@pytest.mark.parametrize('double_buffering', [False, True])
def test_snapshot_round_trip_continues_exactly(comm_name, double_buffering):
    """Save after 3 updates, load into a fresh optimizer and model (in the
    order Chainer's updater uses: optimizer first, then the model, whose
    lazy parameter has no data yet), continue: the same parameters as
    without the interruption."""
    from chainer.serializers import DictionarySerializer, NpzDeserializer
    comm = mnopt.create_communicator(comm_name)

    def fresh():
        model, opt = make_optimizer(comm, [(3,), (40000,)], lazy=True)
        opt = mnopt.create_multi_node_optimizer(
            chainer.optimizers.MomentumSGD(lr=0.5), comm,
            double_buffering=double_buffering).setup(model)
        return model, opt

    def step(model, opt, k):
        if model.late.array is None:
            model.late.initialize((2,))
            model.late.array[...] = comm.rank
        set_grads(model, k, comm.rank)
        opt.update()

    whole, opt = fresh()
    for k in range(6):
        step(whole, opt, k)
    part, opt = fresh()
    for k in range(3):
        step(part, opt, k)
    saved_opt, saved_model = {}, {}
    opt.serialize(DictionarySerializer(saved_opt))
    part.serialize(DictionarySerializer(saved_model))
    resumed, opt = fresh()
    opt.serialize(NpzDeserializer(saved_opt))
    resumed.serialize(NpzDeserializer(saved_model))
    for k in range(3, 6):
        step(resumed, opt, k)
    for (name, a), (_, b) in zip(sorted(whole.namedparams()),
                                 sorted(resumed.namedparams())):
        numpy.testing.assert_array_equal(a.array, b.array, err_msg=name)
    assert opt.t == (4 if double_buffering else 5)
