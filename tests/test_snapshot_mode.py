"""A local-steps snapshot autoloaded (multi_node_snapshot, the multi-node
checkpointer) by a trainer whose multi-node optimizer has no local steps
is refused on every rank before anything is loaded
(mnopt/extensions/snapshot_mode.py): the iterator, the iteration and the
model stay as they were.  Serially and under mpiexec -n 2."""

import numpy
import pytest

from conftest import chainer, needs_chainer

pytestmark = [needs_chainer]

import mnopt  # NOQA


@pytest.fixture
def comm(flat_comm):
    return flat_comm


def make_trainer(comm, out, iterations, how, autoload=False, **kw):
    """A trainer of every rank's own data saving a snapshot every 2
    iterations (``how``: 'snapshot', one replica set per rank, or
    'checkpointer')."""
    L, E = chainer.links, chainer.training.extensions
    model = L.Classifier(L.Linear(3, 2))
    rng = numpy.random.RandomState(comm.rank)
    x = rng.standard_normal((32, 3)).astype(numpy.float32)
    t = (x[:, 0] > 0).astype(numpy.int32)
    it = chainer.iterators.SerialIterator(
        chainer.datasets.TupleDataset(x, t), 4, shuffle=False)
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(0.1), comm, **kw)
    opt.setup(model)
    updater = chainer.training.StandardUpdater(it, opt)
    trainer = chainer.training.Trainer(updater, (iterations, 'iteration'),
                                       out=out)
    if how == 'snapshot':
        ext = mnopt.extensions.multi_node_snapshot(
            comm, E.snapshot(autoload=autoload), list(range(comm.size)))
    else:
        ext = mnopt.create_multi_node_checkpointer('mode', comm,
                                                   cp_interval=5)
    trainer.extend(ext, trigger=(2, 'iteration'))
    return trainer, ext


def position(trainer):
    it = trainer.updater.get_iterator('main')
    model = trainer.updater.get_optimizer('main').target
    return (it.epoch, it.current_position, trainer.updater.iteration,
            [p.array.tobytes() for _, p in sorted(model.namedparams())])


@pytest.mark.parametrize('how', ['snapshot', 'checkpointer'])
def test_a_local_steps_snapshot_is_refused_before_anything_loads(
        comm, outdir, how):
    written, _ = make_trainer(comm, outdir, 5, how, local_steps=4,
                              fragments=2)
    written.run()   # the snapshot at 4: mid-H
    comm.allgather_obj(None)
    again, ext = make_trainer(comm, outdir, 8, how, autoload=True)
    before = position(again)
    with pytest.raises(ValueError, match='written with local_steps=4, '
                       'fragments=2'):
        if how == 'snapshot':
            ext.initialize(again)
        else:
            ext.maybe_load(again)
    assert position(again) == before


@pytest.mark.parametrize('kw', [{'local_steps': 4, 'fragments': 2}, {}],
                         ids=['local-steps', 'synchronous'])
def test_a_snapshot_the_optimizer_can_load_still_loads(comm, outdir, kw):
    """A local-steps snapshot into a local-steps optimizer; a synchronous
    one into either."""
    written, _ = make_trainer(comm, outdir, 4, 'snapshot', **kw)
    written.run()
    comm.allgather_obj(None)
    for into in ({'local_steps': 4, 'fragments': 2}, {}):
        if kw and not into:
            continue   # the refusal above
        again, ext = make_trainer(comm, outdir, 8, 'snapshot',
                                  autoload=True, **into)
        ext.initialize(again)
        assert ext.loaded == 'snapshot_iter_4'
        assert again.updater.iteration == 4


def test_mode_refusal_finds_the_optimizers_of_any_target(comm, outdir):
    """A trainer, its updater, or the optimizer itself: the prefix each
    saves its optimizer under."""
    from mnopt.extensions.snapshot_mode import mode_refusal, optimizers_of
    written, _ = make_trainer(comm, outdir, 4, 'snapshot', local_steps=2)
    written.run()
    comm.allgather_obj(None)
    path = '%s/snapshot_iter_4.%d' % (outdir, comm.rank)
    again, _ = make_trainer(comm, outdir, 8, 'snapshot')
    updater = again.updater
    optimizer = updater.get_optimizer('main')
    assert optimizers_of(again) == [('updater/optimizer:main/', optimizer)]
    assert optimizers_of(updater) == [('optimizer:main/', optimizer)]
    assert optimizers_of(optimizer) == [('', optimizer)]
    assert isinstance(mode_refusal(path, again), ValueError)
    assert mode_refusal(path, written) is None   # a local-steps one


def test_another_models_snapshot_in_the_folder_is_named_on_every_rank(
        comm, outdir):
    # Another run's snapshot in the same folder (other shapes): an error
    # naming its file and what to do, on every rank, not a bare NumPy one.
    written, _ = make_trainer(comm, outdir, 4, 'snapshot')
    written.run()
    comm.allgather_obj(None)
    again, ext = make_trainer(comm, outdir, 8, 'snapshot', autoload=True)
    model = again.updater.get_optimizer('main').target
    model.predictor.W.array = numpy.zeros((2, 5), numpy.float32)  # wider
    with pytest.raises(ValueError, match=r'snapshot snapshot_iter_4 does '
                       r'not fit this model \(.*snapshot_iter_4\.\d+: '
                       r'ValueError.*another run'):
        ext.initialize(again)
