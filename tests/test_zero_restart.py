"""A sharded optimizer's snapshots at another number of ranks: a trainer
with multi_node_snapshot(autoload) trains at 2 ranks, resumes at 3, then
at 5, then at 2 again, with no conversion step: each resume re-shards
the saved pieces element by element.  Beside it the same chain without
sharding: every gradient is N times a dyadic number (a loss linear in
each layer's output), so every mean is exact and the order of its sum
cannot matter, and after each job the parameters and
the optimizer state (Adam's t, m and v of every element, joined from the
ranks' pieces) must be the unsharded run's bit for bit.  Whole mpiexec
jobs: runs in the serial pass only."""

import os

import numpy
import pytest

from conftest import run_mpi

pytestmark = [pytest.mark.spawn, pytest.mark.every_stack]
pytest.importorskip('chainer', reason='the sharded optimizer is of the '
                                      'Chainer layer')

JOB = r'''
import sys
import numpy
import chainer
import chainer.links as L
import mnopt

out, stop, resumed_at, shard = (sys.argv[1], int(sys.argv[2]),
                                int(sys.argv[3]), sys.argv[4] == 'sharded')
comm = mnopt.create_communicator('flat')
E = chainer.training.extensions


class Net(chainer.Chain):
    """A loss linear in each layer's output, with dyadic inputs and
    coefficients, times the number of ranks: every gradient is N times a
    dyadic number, so that divided by N (before the sum) and summed in any
    order it is exact, and the unsharded run's means are the sharded
    run's, whatever order each communicator sums in."""

    def __init__(self):
        super(Net, self).__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(2, 3, 3, pad=1)
            self.fc = L.Linear(32, 5)

    def __call__(self, x, t):
        c = (t[:, None] == numpy.arange(5)).astype(numpy.float32) * 0.25
        return comm.size * (chainer.functions.sum(self.conv(x)) / 8
                            + chainer.functions.sum(
                                self.fc(x.reshape(len(x), -1)) * c))


numpy.random.seed(0)
model = Net()
rng = numpy.random.RandomState(comm.rank)
x = (rng.randint(-16, 16, (32, 2, 4, 4)) / 8.0).astype(numpy.float32)
t = rng.randint(0, 5, 32).astype(numpy.int32)
it = chainer.iterators.SerialIterator(
    chainer.datasets.TupleDataset(x, t), 4, shuffle=False)
opt = mnopt.create_multi_node_optimizer(
    chainer.optimizers.Adam(alpha=0.01), comm, shard_state=shard)
opt.setup(model)
trainer = chainer.training.Trainer(
    chainer.training.StandardUpdater(it, opt), (stop, 'iteration'), out=out)
snap = mnopt.extensions.multi_node_snapshot(comm, E.snapshot(autoload=True))
trainer.extend(snap, trigger=chainer.training.triggers.ManualScheduleTrigger(
    [4, 7, 10], 'iteration'))
snap.initialize(trainer)
assert trainer.updater.iteration == resumed_at, trainer.updater.iteration
trainer.run()
assert trainer.updater.iteration == stop

# Every element's state, joined from the ranks' pieces: each element on
# exactly one rank.
params = dict(model.namedparams())
if shard:
    mine = {}
    for p in opt.pieces:
        rule = params[p.name].update_rule
        if p.rank == comm.rank and rule.state is not None:
            mine[p] = (rule.t, {k: numpy.asarray(v) for k, v in
                                rule.state.items()})
    state = {}
    for part in comm.allgather_obj(mine):
        for p, (rule_t, arrays) in part.items():
            state.setdefault(p.name + '/t', set()).add(rule_t)
            for k, v in arrays.items():
                key = p.name + '/' + k
                full = state.setdefault(key, numpy.full(
                    params[p.name].size, numpy.nan, v.dtype))
                assert numpy.isnan(full[p.lo:p.hi]).all(), key   # once
                full[p.lo:p.hi] = v
    state = {k: numpy.array(sorted(v)) if k.endswith('/t') else v
             for k, v in state.items()}
else:
    state = {}
    for name, param in params.items():
        state[name + '/t'] = numpy.array([param.update_rule.t])
        for k, v in param.update_rule.state.items():
            state[name + '/' + k] = v.reshape(-1)
if comm.rank == 0:
    numpy.savez('%s/result_%d.npz' % (out, stop), **dict(
        state, **{'param' + n: p.array for n, p in params.items()}))
    print('DONE at %d on %d' % (stop, comm.size), flush=True)
'''

CHAIN = ((2, 4, 0), (3, 7, 4), (5, 10, 7), (2, 13, 10))


def _chain(out, mode):
    os.makedirs(out)
    for n, stop, resumed_at in CHAIN:
        proc = run_mpi(n, JOB, timeout=300,
                       args=[out, str(stop), str(resumed_at), mode])
        assert proc.returncode == 0, (mode, n, proc.stderr[-3000:])
        assert 'DONE at %d on %d' % (stop, n) in proc.stdout, \
            proc.stdout[-2000:]


def test_resharded_resume_2_3_5_2_is_the_unsharded_resume(tmp_path):
    sharded, plain = str(tmp_path / 'sharded'), str(tmp_path / 'plain')
    _chain(sharded, 'sharded')
    _chain(plain, 'plain')
    for _, stop, _ in CHAIN:
        with numpy.load('%s/result_%d.npz' % (sharded, stop)) as a, \
                numpy.load('%s/result_%d.npz' % (plain, stop)) as b:
            assert sorted(a.files) == sorted(b.files), stop
            assert any(k.endswith('/m') for k in a.files)
            for k in a.files:
                numpy.testing.assert_array_equal(a[k], b[k],
                                                 err_msg='%s %d' % (k, stop))
