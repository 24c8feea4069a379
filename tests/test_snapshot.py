"""multi_node_snapshot: one writer per replica set, atomic files, and an
autoload that picks the newest snapshot every rank holds completely, also
on another number of ranks.  Serially and under mpiexec -n 2 / -n 3."""

import contextlib
import os

import numpy
import pytest

from conftest import chainer, needs_chainer, warns_on_rank_0
from damaged_npz import damage_deflate_stream

# Also under mpiexec -n 3: replica sets, and an autoload from fewer sets.
pytestmark = [needs_chainer, pytest.mark.many_ranks]

import mnopt  # NOQA


@pytest.fixture
def comm(flat_comm):
    return flat_comm


def make_trainer(comm, out, iterations, replica_sets='each alone',
                 autoload=False, interval=2):
    L, E = chainer.links, chainer.training.extensions
    model = L.Classifier(L.Linear(3, 2))
    rng = numpy.random.RandomState(comm.rank)
    x = rng.standard_normal((16, 3)).astype(numpy.float32)
    t = (x[:, 0] > 0).astype(numpy.int32)
    it = chainer.iterators.SerialIterator(
        chainer.datasets.TupleDataset(x, t), 4, shuffle=False)
    opt = mnopt.create_multi_node_optimizer(chainer.optimizers.SGD(0.1), comm)
    opt.setup(model)
    updater = chainer.training.StandardUpdater(it, opt)
    trainer = chainer.training.Trainer(updater, (iterations, 'iteration'),
                                       out=out)
    if replica_sets == 'each alone':
        replica_sets = list(range(comm.size))
    ext = mnopt.extensions.multi_node_snapshot(
        comm, E.snapshot(autoload=autoload), replica_sets)
    trainer.extend(ext, trigger=(interval, 'iteration'))
    return trainer, ext


def test_every_replica_set_writes_and_autoload_resumes(comm, outdir):
    trainer, _ = make_trainer(comm, outdir, 6)
    trainer.run()
    comm.allgather_obj(None)
    names = sorted(os.listdir(outdir))
    for r in range(comm.size):   # ChainerMN's names: the writer's rank
        assert 'snapshot_iter_6.%d' % r in names
    again, ext = make_trainer(comm, outdir, 8, autoload=True)
    ext.initialize(again)
    assert ext.loaded == 'snapshot_iter_6'
    assert again.updater.iteration == 6
    w = comm.allgather(again.updater.get_optimizer('main').target
                       .predictor.W.array)
    assert all((a == w[0]).all() for a in w)


def test_autoload_skips_a_snapshot_one_rank_lacks(comm, outdir):
    trainer, _ = make_trainer(comm, outdir, 6)
    trainer.run()
    comm.allgather_obj(None)
    if comm.rank == comm.size - 1:   # its newest file was cut short
        path = os.path.join(outdir, set_file(comm, 'snapshot_iter_6'))
        with open(path, 'r+b') as f:
            f.truncate(os.path.getsize(path) // 2)
    comm.allgather_obj(None)
    again, ext = make_trainer(comm, outdir, 8, autoload=True)
    with warns_on_rank_0(comm, 'skipping snapshot snapshot_iter_6'):
        ext.initialize(again)
    assert ext.loaded == 'snapshot_iter_4'   # on every rank
    assert again.updater.iteration == 4


def set_file(comm, name):
    """The name of this rank's own file of snapshot ``name`` (one replica
    set per rank)."""
    return '%s.%d' % (name, comm.rank)


def test_autoload_never_loads_another_sets_file_for_a_missing_one(
        comm, outdir):
    # The last rank was killed while writing its newest file (never
    # renamed into place): set 0's file of that snapshot is no stand-in.
    trainer, _ = make_trainer(comm, outdir, 6)
    trainer.run()
    comm.allgather_obj(None)
    if comm.rank == comm.size - 1:
        os.remove(os.path.join(outdir, set_file(comm, 'snapshot_iter_6')))
    comm.allgather_obj(None)
    again, ext = make_trainer(comm, outdir, 8, autoload=True)
    with (warns_on_rank_0(comm, r'snapshot_iter_6\b.*rank %d: '
                          r'snapshot_iter_6\.%d is missing'
                          % ((comm.size - 1,) * 2))
          if comm.size > 1 else contextlib.nullcontext()):
        ext.initialize(again)
    assert ext.loaded == 'snapshot_iter_4'   # on every rank
    assert again.updater.iteration == 4


def test_autoload_skips_a_damaged_snapshot_with_a_warning(comm, outdir):
    trainer, _ = make_trainer(comm, outdir, 6)
    trainer.run()
    comm.allgather_obj(None)
    if comm.rank == comm.size - 1:   # 4 KiB of its newest file overwritten
        damage_deflate_stream(
            os.path.join(outdir, set_file(comm, 'snapshot_iter_6')))
    comm.allgather_obj(None)
    again, ext = make_trainer(comm, outdir, 8, autoload=True)
    with warns_on_rank_0(comm, r'skipping snapshot snapshot_iter_6\b.*'
                         r'is damaged \(zlib\.error'):
        ext.initialize(again)
    assert ext.loaded == 'snapshot_iter_4'   # on every rank
    assert again.updater.iteration == 4


def test_autoload_loads_set_0s_file_only_for_a_snapshot_of_fewer_sets(
        comm, outdir):
    if comm.size == 1:
        pytest.skip('needs a job to resume on more ranks')
    # All ranks but the last write (one replica set each), then all of
    # them resume: the last one from set 0's file, which says so.
    fewer = comm.split(int(comm.rank == comm.size - 1), comm.rank)
    if comm.rank < comm.size - 1:
        trainer, _ = make_trainer(fewer, outdir, 4)
        trainer.run()
    fewer.finalize()
    comm.allgather_obj(None)
    again, ext = make_trainer(comm, outdir, 6, autoload=True)
    ext.initialize(again)
    assert ext.loaded == 'snapshot_iter_4'
    w = comm.allgather(again.updater.get_optimizer('main').target
                       .predictor.W.array)
    assert all((a == w[0]).all() for a in w)


def test_one_replica_set_writes_once_and_loads_on_any_number_of_ranks(
        comm, outdir):
    everyone = [list(range(comm.size))]
    trainer, _ = make_trainer(comm, outdir, 4, replica_sets=everyone)
    trainer.run()
    comm.allgather_obj(None)
    assert sorted(n for n in os.listdir(outdir) if n.startswith('snap')) \
        == ['snapshot_iter_2.0', 'snapshot_iter_4.0']
    # Resume on one rank each (another number of ranks).
    alone = comm.split(comm.rank, 0)
    again, ext = make_trainer(alone, outdir, 6, autoload=True)
    ext.initialize(again)
    assert ext.loaded == 'snapshot_iter_4'
    alone.finalize()


def test_a_crash_mid_write_leaves_nothing_loadable(comm, outdir):
    from chainer.training.extensions import snapshot_writers

    def crash(path, target):
        with open(path, 'wb') as f:
            f.write(b'PK\x03\x04 half a snapshot')
        raise RuntimeError('killed while writing')
    trainer, _ = make_trainer(comm, outdir, 1)
    model = trainer.updater.get_optimizer('main').target
    ext = mnopt.extensions.multi_node_snapshot(
        comm, chainer.training.extensions.snapshot_object(
            model, 'snapshot_iter_{.updater.iteration}',
            writer=snapshot_writers.SimpleWriter(savefun=crash)),
        [list(range(comm.size))])
    ext.initialize(trainer)
    # The writer's error on rank 0, and on every other rank one naming it.
    with pytest.raises(RuntimeError, match='killed while writing' if
                       comm.rank == 0 else 'rank 0: RuntimeError: killed'):
        ext(trainer)
    comm.allgather_obj(None)
    assert not [n for n in os.listdir(outdir)
                if n.startswith('snapshot_iter')]


def test_bad_replica_sets_fail_on_every_rank(comm):
    with pytest.raises(ValueError, match='in two sets'):
        mnopt.extensions.multi_node_snapshot(
            comm, chainer.training.extensions.snapshot(), [[0], 0])
    with pytest.raises(ValueError, match='is not a rank of'):
        mnopt.extensions.multi_node_snapshot(
            comm, chainer.training.extensions.snapshot(), [comm.size])
    if comm.size > 1:
        sets = [[r] for r in range(comm.size)]
        if comm.rank == 1:
            sets = [list(range(comm.size))]
        with pytest.raises(ValueError, match='ranks passed different '
                                             'replica_sets'):
            mnopt.extensions.multi_node_snapshot(
                comm, chainer.training.extensions.snapshot(), sets)


def test_checkpointer_keeps_the_newest_and_loads_what_all_hold(comm, outdir):
    trainer, _ = make_trainer(comm, outdir, 10)
    cp = mnopt.create_multi_node_checkpointer('t', comm, cp_interval=2,
                                              gc_interval=1)
    trainer.extend(cp, trigger=(2, 'iteration'))
    trainer.run()
    comm.allgather_obj(None)
    mine = sorted(n for n in os.listdir(outdir)
                  if n.startswith('cp-t.') and n.endswith('.rank%d.npz'
                                                          % comm.rank))
    assert mine == ['cp-t.10.rank%d.npz' % comm.rank,
                    'cp-t.8.rank%d.npz' % comm.rank]
    assert cp.get_stats()['saved'] == 5
    if comm.rank == comm.size - 1:
        os.remove(os.path.join(outdir, 'cp-t.10.rank%d.npz' % comm.rank))
    comm.allgather_obj(None)
    again, _ = make_trainer(comm, outdir, 12)
    loader = mnopt.extensions.create_multi_node_checkpointer('t', comm)
    with (warns_on_rank_0(comm, 'rank %d: no file found' % (comm.size - 1))
          if comm.size > 1 else contextlib.nullcontext()):
        loader.maybe_load(again)
    assert loader.get_stats()['loaded'] == 8
    assert again.updater.iteration == 8


@pytest.mark.parametrize('intervals', [
    {'cp_interval': 0}, {'gc_interval': 0}, {'cp_interval': -1},
    {'gc_interval': 1.5}])
def test_checkpointer_intervals_below_one_are_an_error(comm, intervals):
    # ChainerMN asserts both are positive: keeping 0 checkpoints, or
    # cleaning up every 0 saves, means nothing (it used to keep all).
    name = next(iter(intervals))
    with pytest.raises(ValueError, match='%s .* must be a positive integer'
                                         % name):
        mnopt.create_multi_node_checkpointer('t', comm, **intervals)


def test_checkpointer_skips_a_damaged_checkpoint_with_a_warning(
        comm, outdir):
    trainer, _ = make_trainer(comm, outdir, 6)
    trainer.extend(mnopt.create_multi_node_checkpointer('t', comm),
                   trigger=(2, 'iteration'))
    trainer.run()
    comm.allgather_obj(None)
    if comm.rank == comm.size - 1:
        damage_deflate_stream(os.path.join(outdir, 'cp-t.6.rank%d.npz'
                                           % comm.rank))
    comm.allgather_obj(None)
    again, _ = make_trainer(comm, outdir, 8)
    loader = mnopt.create_multi_node_checkpointer('t', comm)
    with warns_on_rank_0(comm, r'skipping checkpoint 6, .*rank %d: '
                         r'cp-t\.6\.rank%d\.npz is damaged \(zlib\.error'
                         % ((comm.size - 1,) * 2)):
        loader.maybe_load(again)
    assert loader.get_stats()['loaded'] == 4
    assert again.updater.iteration == 4


@pytest.mark.parametrize('replica_sets,size,expected', [
    ([0], 4, [{0}, {1, 2, 3}]),
    ([0, 1], 4, [{0}, {1}, {2, 3}]),
    ([[0, 1], [2, 3]], 4, [{0, 1}, {2, 3}]),
    ([], 4, [{0, 1, 2, 3}]),
    ([range(0, 8, 2)], 8, [{0, 2, 4, 6}, {1, 3, 5, 7}]),
])
def test_replica_sets_are_parsed_as_chainermn_documents(replica_sets, size,
                                                        expected):
    from mnopt.extensions.multi_node_snapshot import parse_replica_sets
    assert parse_replica_sets(replica_sets, size) == expected


@pytest.mark.parametrize('replica_sets', [[], None, [0]])
def test_the_first_rank_of_each_set_writes_name_dot_rank(comm, replica_sets):
    snapshot = chainer.training.extensions.snapshot()
    ext = mnopt.extensions.multi_node_snapshot(comm, snapshot, replica_sets)
    writers = [0] if replica_sets != [0] or comm.size == 1 else [0, 1]
    assert ext.is_master == (comm.rank in writers)
    assert snapshot.filename == 'snapshot_iter_{.updater.iteration}.%d' \
        % comm.rank


def test_a_callable_filename_gets_the_rank_too(comm):
    import types
    snapshot = chainer.training.extensions.snapshot(
        filename=lambda t: 'it-%d' % t.updater.iteration)
    mnopt.extensions.multi_node_snapshot(comm, snapshot, [])
    trainer = types.SimpleNamespace(
        updater=types.SimpleNamespace(iteration=7))
    assert snapshot.filename(trainer) == 'it-7.%d' % comm.rank


def test_checkpointer_saves_and_loads_an_object_without_a_trainer(
        comm, outdir):
    # ChainerMN's use without a trainer: save(target, iteration) each step.
    model = chainer.links.Linear(2, 2)
    cp = mnopt.create_multi_node_checkpointer('obj', comm, path=outdir)
    for it in (1, 2):
        model.W.array[...] = it
        cp.save(model, it)
    again = chainer.links.Linear(2, 2)
    loader = mnopt.create_multi_node_checkpointer('obj', comm, path=outdir)
    loader.maybe_load(again)
    assert loader.get_stats()['loaded'] == 2
    assert (again.W.array == 2).all()
    with pytest.raises(ValueError, match='needs path='):
        mnopt.create_multi_node_checkpointer('obj', comm).save(model, 3)
