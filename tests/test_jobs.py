"""Whole mpiexec jobs, launched from the serial pass with a timeout, for
what must end a job rather than hang it."""

import pytest

from conftest import needs_chainer, run_mpi

pytestmark = pytest.mark.spawn

CRASH = '''
import sys, numpy, mnopt
from param_models import make_model
comm = mnopt.create_communicator(sys.argv[1])
model = make_model([(1000,)])
model.p000.grad = numpy.ones(1000, numpy.float32)
if comm.rank == 1:
    raise RuntimeError('rank 1 fell over')
comm.multi_node_mean_grad(model)   # rank 0 would wait here forever
print('rank 0 should never get here')
'''


@pytest.mark.every_mpi  # how the MPI library's launcher ends a job
@pytest.mark.parametrize('module_runner', [True, False],
                         ids=['python-m-mpi4py', 'plain-python'])
@pytest.mark.parametrize('name', ['flat', 'hierarchical'])
def test_uncaught_exception_on_one_rank_ends_the_job(name, module_runner):
    proc = run_mpi(2, 'import sys; sys.path.insert(0, "tests")\n' + CRASH,
                   args=[name], timeout=60, module_runner=module_runner)
    assert proc.returncode != 0
    assert 'rank 1 fell over' in proc.stderr
    assert 'should never get here' not in proc.stdout


MISMATCH = '''
import sys, numpy, mnopt
sys.path.insert(0, 'tests')
from param_models import make_model
comm = mnopt.create_communicator('flat')
model = make_model([(3,), (4 + comm.rank,)])
for _, p in model.namedparams():
    p.grad = numpy.zeros(p.shape, numpy.float32)
try:
    comm.multi_node_mean_grad(model)
except mnopt.LayoutMismatchError as e:
    print('rank %d: %s' % (comm.rank, e))
'''


def test_layout_mismatch_is_reported_by_every_rank():
    proc = run_mpi(2, MISMATCH, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for r in (0, 1):
        assert ("rank %d: ranks would reduce gradients that do not line up "
                "(rank 0 vs rank 1): gradient #1 is '/p001' (4,) float32 vs "
                "'/p001' (5,) float32" % r) in proc.stdout


CHAINERMN_SCRIPT = '''
# The shape of ChainerMN's MNIST example, with synthetic data.
import chainer, numpy
import chainer.links as L, chainer.functions as F
from chainer import training
from chainer.training import extensions
import mnopt as chainermn

comm = chainermn.create_communicator('naive')
model = L.Classifier(chainer.Sequential(L.Linear(20, 32), F.relu,
                                        L.Linear(32, 4)))
optimizer = chainermn.create_multi_node_optimizer(
    chainer.optimizers.Adam(), comm)
optimizer.setup(model)
if comm.rank == 0:
    rng = numpy.random.RandomState(0)
    x = rng.rand(256, 20).astype(numpy.float32)
    t = (x[:, :4].argmax(axis=1)).astype(numpy.int32)
    train = chainer.datasets.TupleDataset(x[:200], t[:200])
    test = chainer.datasets.TupleDataset(x[200:], t[200:])
else:
    train, test = None, None
train = chainermn.scatter_dataset(train, comm, shuffle=True)
test = chainermn.scatter_dataset(test, comm, shuffle=True)
train_iter = chainer.iterators.SerialIterator(train, 16)
test_iter = chainer.iterators.SerialIterator(test, 16, repeat=False,
                                             shuffle=False)
updater = training.StandardUpdater(train_iter, optimizer)
trainer = training.Trainer(updater, (3, 'epoch'), out=OUT)
evaluator = extensions.Evaluator(test_iter, model)
trainer.extend(chainermn.create_multi_node_evaluator(evaluator, comm))
if comm.rank == 0:
    trainer.extend(extensions.LogReport())
    trainer.extend(extensions.PrintReport(
        ['epoch', 'main/loss', 'validation/main/accuracy']))
trainer.run()
w = comm.allgather(model.predictor[0].W.array)
assert all((a == w[0]).all() for a in w), 'ranks diverged'
print('rank %d done' % comm.rank)
'''


@needs_chainer
def test_a_chainermn_script_runs_with_import_mnopt_as_chainermn(tmp_path):
    proc = run_mpi(3, 'OUT = %r\n' % str(tmp_path) + CHAINERMN_SCRIPT,
                   timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(3):
        assert 'rank %d done' % r in proc.stdout
    assert 'validation/main/accuracy' in proc.stdout


CHAINERMN_IMAGENET_SCRIPT = '''
# The shape of ChainerMN's ImageNet example (train_imagenet.py), with a
# small convolutional net and synthetic images.
import sys
import chainer, numpy
import chainer.functions as F, chainer.links as L
from chainer import training
from chainer.training import extensions
import mnopt as chainermn


class Net(chainer.Chain):
    def __init__(self):
        super(Net, self).__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(3, 8, 3, pad=1)
            self.bn = L.BatchNormalization(8)
            self.fc = L.Linear(8, 4)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        return self.fc(F.average(h, axis=(2, 3)))


iterations = int(sys.argv[1])
comm = chainermn.create_communicator('hierarchical')
device = -1
model = L.Classifier(Net())
if comm.rank == 0:
    rng = numpy.random.RandomState(0)
    x = rng.rand(96, 3, 12, 12).astype(numpy.float32)
    t = (x[:, 0].mean(axis=(1, 2)) * 4).astype(numpy.int32) % 4
    train = chainer.datasets.TupleDataset(x[:64], t[:64])
    val = chainer.datasets.TupleDataset(x[64:], t[64:])
else:
    train, val = None, None
train = chainermn.scatter_dataset(train, comm, shuffle=True)
val = chainermn.scatter_dataset(val, comm)
train_iter = chainer.iterators.MultiprocessIterator(train, 8, n_processes=1)
val_iter = chainer.iterators.SerialIterator(val, 8, repeat=False,
                                            shuffle=False)
optimizer = chainermn.create_multi_node_optimizer(
    chainer.optimizers.MomentumSGD(lr=0.01, momentum=0.9), comm)
optimizer.setup(model)
updater = training.StandardUpdater(train_iter, optimizer, device=device)
trainer = training.Trainer(updater, (iterations, 'iteration'), OUT)
checkpoint_interval = (2, 'iteration')
checkpointer = chainermn.create_multi_node_checkpointer(
    name='imagenet-example', comm=comm)
checkpointer.maybe_load(trainer, optimizer)
print('rank %d: loaded %s' % (comm.rank, checkpointer.get_stats()['loaded']))
trainer.extend(checkpointer, trigger=checkpoint_interval)
val_interval = (2, 'iteration')
evaluator = extensions.Evaluator(val_iter, model, device=device)
evaluator = chainermn.create_multi_node_evaluator(evaluator, comm)
trainer.extend(evaluator, trigger=val_interval)
if comm.rank == 0:
    trainer.extend(extensions.LogReport(trigger=(1, 'iteration')))
    trainer.extend(extensions.PrintReport(
        ['iteration', 'main/loss', 'validation/main/loss']),
        trigger=(1, 'iteration'))
trainer.run()
print('rank %d done at %d' % (comm.rank, trainer.updater.iteration))
'''


@needs_chainer
def test_a_chainermn_imagenet_script_runs_and_resumes(tmp_path):
    code = 'OUT = %r\n' % str(tmp_path) + CHAINERMN_IMAGENET_SCRIPT
    proc = run_mpi(2, code, timeout=180, args=['4'])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'rank 0: loaded None' in proc.stdout
    assert 'validation/main/loss' in proc.stdout
    proc = run_mpi(2, code, timeout=180, args=['6'])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in (0, 1):
        assert 'rank %d: loaded 4' % r in proc.stdout
        assert 'rank %d done at 6' % r in proc.stdout
