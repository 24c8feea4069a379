"""A sharded optimizer's snapshots at another number of ranks: a trainer
with multi_node_snapshot(autoload) trains at 2 ranks, resumes at 3, then
at 2 again.  After each resume the optimizer state (Adam's t, m and v of
every parameter), gathered from the ranks, must be the state the previous
job saved (the union of its ranks' files), bit for bit, each parameter's
state on exactly one rank, its owner for the new number of ranks; and the
training goes on.  Whole mpiexec jobs: runs in the serial pass only."""

import pytest

from conftest import run_mpi

pytestmark = pytest.mark.spawn
pytest.importorskip('chainer', reason='the sharded optimizer is of the '
                                      'Chainer layer')

JOB = r'''
import os, sys
import numpy
import chainer
import chainer.links as L
import mnopt
from mnopt import zero

out, stop, resumed_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
comm = mnopt.create_communicator(sys.argv[4])
E = chainer.training.extensions
numpy.random.seed(0)
model = L.Classifier(chainer.Sequential(
    L.Linear(6, 5), chainer.functions.relu, L.Linear(5, 4),
    chainer.functions.relu, L.Linear(4, 3)))
rng = numpy.random.RandomState(comm.rank)
x = rng.standard_normal((16, 6)).astype(numpy.float32)
t = (x[:, 0] > 0).astype(numpy.int32) + (x[:, 1] > 0)
it = chainer.iterators.SerialIterator(
    chainer.datasets.TupleDataset(x, t), 4, shuffle=False)
opt = mnopt.create_multi_node_optimizer(
    chainer.optimizers.Adam(alpha=0.01), comm, shard_state=True)
opt.setup(model)
trainer = chainer.training.Trainer(
    chainer.training.StandardUpdater(it, opt), (stop, 'iteration'), out=out)
snap = mnopt.extensions.multi_node_snapshot(comm, E.snapshot(autoload=True))
trainer.extend(snap, trigger=chainer.training.triggers.ManualScheduleTrigger(
    [4, 7, 10], 'iteration'))

snap.initialize(trainer)   # the autoload (trainer.run does it again)
assert trainer.updater.iteration == resumed_at, trainer.updater.iteration
if resumed_at:
    # What the previous job saved: every rank's share, from its file.
    name = os.path.join(out, 'snapshot_iter_%d' % resumed_at)
    prefix = 'updater/optimizer:main/'
    saved = {}
    size = 0
    while os.path.exists('%s.%d' % (name, size)):
        with numpy.load('%s.%d' % (name, size)) as f:
            assert int(f[prefix + 'mnopt_shard/rank']) == size
            written_by = int(f[prefix + 'mnopt_shard/size'])
            for k in f.files:
                if k.startswith(prefix) and '/mnopt_shard/' not in \
                        '/' + k[len(prefix):] and k[len(prefix):] not in (
                            't', 'epoch', 'mnopt_updates'):
                    assert k not in saved, k    # one owner each
                    saved[k[len(prefix):]] = f[k]
        size += 1
    assert size == written_by != comm.size, (size, comm.size)  # a resize
    # What the ranks hold now, gathered.
    mine = {}
    for pname, p in model.namedparams():
        rule = p.update_rule
        if rule.state is not None:
            mine[pname.lstrip('/') + '/t'] = numpy.asarray(rule.t)
            for key, value in rule.state.items():
                mine[pname.lstrip('/') + '/' + key] = value
    held = comm.allgather_obj(mine)
    gathered = {}
    for r, part in enumerate(held):
        for k, v in part.items():
            assert k not in gathered, ('state on two ranks', k)
            gathered[k] = v
    assert sorted(gathered) == sorted(saved), (sorted(gathered),
                                               sorted(saved))
    for k in saved:
        numpy.testing.assert_array_equal(gathered[k], saved[k], err_msg=k)
        assert saved[k].dtype == gathered[k].dtype, k
    assert any(numpy.any(v != 0) for k, v in saved.items()
               if k.endswith('/m'))
    # Each parameter's state on its owner for this number of ranks, and
    # every rank owns some.
    owners = zero.assign_owners(
        [(n, p.array.nbytes) for n, p in sorted(model.namedparams())],
        comm.size)
    for r, part in enumerate(held):
        names = {k.rsplit('/', 1)[0] for k in part}
        assert names == {n.lstrip('/') for n, o in owners.items()
                         if o == r}, (r, names)
        assert names, r
    assert opt.actual_optimizer.t == resumed_at - 1  # first: broadcast
    before = {n: p.array.copy() for n, p in model.namedparams()}
    if comm.rank == 0:
        print('RESHARDED %d entries from %d to %d ranks'
              % (len(saved), size, comm.size), flush=True)

trainer.run()
assert trainer.updater.iteration == stop
assert opt.actual_optimizer.t == stop - 1
digests = comm.allgather_obj(
    [p.array.tobytes() for _, p in sorted(model.namedparams())])
assert all(d == digests[0] for d in digests)   # replicas agree
if resumed_at:
    assert any(numpy.any(p.array != before[n])
               for n, p in model.namedparams())   # it trained on
if comm.rank == 0:
    print('DONE at %d' % stop, flush=True)
'''


@pytest.mark.parametrize('communicator', ['flat'])
def test_resharded_resume_2_3_2(tmp_path, communicator):
    out = str(tmp_path)
    for n, stop, resumed_at in ((2, 4, 0), (3, 7, 4), (2, 10, 7)):
        proc = run_mpi(n, JOB, timeout=120,
                       args=[out, str(stop), str(resumed_at), communicator])
        assert proc.returncode == 0, (n, proc.stderr[-3000:])
        assert 'DONE at %d' % stop in proc.stdout, proc.stdout[-2000:]
        if resumed_at:
            assert 'RESHARDED 18 entries from %d to %d ranks' % (
                {3: 2, 2: 3}[n], n) in proc.stdout, proc.stdout[-2000:]
