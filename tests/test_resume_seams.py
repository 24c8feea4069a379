"""Where resuming meets another feature (issue 35): pruning that every rank
agrees on (the checkpointer, ``snapshot(n_retains=)`` under
``multi_node_snapshot``), one write id per snapshot (a set mixing two
writes is skipped), unsharded snapshots into a sharded optimizer with
``strict=False``.  Serially and under mpiexec -n 2 / -n 3; the resize
tests (another number of ranks) spawn their own jobs."""

import contextlib
import os
import shutil

import numpy
import pytest

from conftest import chainer, needs_chainer, run_mpi, warns_on_rank_0

pytestmark = needs_chainer
# mnopt.zero is of the Chainer layer: the core stack (no Chainer) skips
# this module, as it skips every Chainer-layer test.
pytest.importorskip('chainer', reason='the snapshots and iterators resumed '
                                      'here are of the Chainer layer')

import mnopt  # NOQA
from mnopt import zero  # NOQA


@pytest.fixture
def comm(flat_comm):
    return flat_comm


def make_trainer(comm, out, iterations):
    L = chainer.links
    model = L.Classifier(L.Linear(3, 2))
    rng = numpy.random.RandomState(comm.rank)
    x = rng.standard_normal((16, 3)).astype(numpy.float32)
    t = (x[:, 0] > 0).astype(numpy.int32)
    it = chainer.iterators.SerialIterator(
        chainer.datasets.TupleDataset(x, t), 4, shuffle=False)
    opt = mnopt.create_multi_node_optimizer(chainer.optimizers.SGD(0.1), comm)
    opt.setup(model)
    return chainer.training.Trainer(
        chainer.training.StandardUpdater(it, opt), (iterations, 'iteration'),
        out=out)


def failing_on_last_rank(comm, iteration, save):
    """``save`` wrapped to fail on the last rank at ``iteration`` (a rank
    killed or out of disk space while writing)."""
    def savefun(path, target, *args, **kwargs):
        if comm.rank == comm.size - 1 and '_%d.' % iteration in \
                os.path.basename(path).replace('cp-t.', '_'):
            raise OSError('no space left (test)')
        return save(path, target, *args, **kwargs)
    return savefun


def expect_failure_everywhere(comm):
    """The last rank raises its own error, every other rank one naming
    it."""
    if comm.rank == comm.size - 1:
        return pytest.raises(OSError, match='no space left')
    return pytest.raises(RuntimeError, match=r'rank %d: OSError: no space '
                         % (comm.size - 1))


def test_checkpointer_prunes_only_checkpoints_every_rank_holds(
        comm, outdir, monkeypatch):
    # cp_interval=1: each clean-up keeps one checkpoint.  The last rank
    # fails to write checkpoint 2: no rank may delete checkpoint 1, the
    # newest one every rank holds, and every rank learns of the failure.
    monkeypatch.setattr(chainer.serializers, 'save_npz', failing_on_last_rank(
        comm, 2, chainer.serializers.save_npz))
    model = chainer.links.Linear(2, 2)
    cp = mnopt.create_multi_node_checkpointer('t', comm, cp_interval=1,
                                              gc_interval=1, path=outdir)
    model.W.array[...] = 1
    cp.save(model, 1)
    model.W.array[...] = 2
    with expect_failure_everywhere(comm):
        cp.save(model, 2)
    comm.allgather_obj(None)
    again = chainer.links.Linear(2, 2)
    loader = mnopt.create_multi_node_checkpointer('t', comm, path=outdir)
    with warns_on_rank_0(comm, 'skipping checkpoint 2') if comm.size > 1 \
            else contextlib.nullcontext():
        loader.maybe_load(again)
    assert loader.get_stats()['loaded'] == 1
    assert (again.W.array == 1).all()


def test_checkpointer_clean_up_removes_a_stale_newer_checkpoint(
        comm, outdir):
    # A previous run got to 3 on rank 0 only; this run resumed from 1 and
    # saves 2: rank 0's 3 is of another run and never loadable alongside
    # the others' (ChainerMN removes what is not kept), and the kept set
    # is what every rank holds.
    model = chainer.links.Linear(2, 2)
    cp = mnopt.create_multi_node_checkpointer('t', comm, cp_interval=2,
                                              gc_interval=1, path=outdir)
    cp.save(model, 1)
    if comm.rank == 0:
        chainer.serializers.save_npz(
            os.path.join(outdir, 'cp-t.3.rank0.npz'), model)
    comm.allgather_obj(None)
    cp.save(model, 2)
    comm.allgather_obj(None)
    assert sorted(n for n in os.listdir(outdir) if n.startswith('cp-t.')) \
        == sorted('cp-t.%d.rank%d.npz' % (i, r) for i in (1, 2)
                  for r in range(comm.size))


def test_n_retains_under_multi_node_snapshot_keeps_what_every_rank_holds(
        comm, outdir):
    # One replica set per rank, n_retains=1.  The last rank's write of
    # snapshot 4 fails: Chainer's clean-up (per rank, after each write)
    # left rank 0 with 4 only and the last rank with 2 only.
    from chainer.training.extensions import snapshot_writers
    writer = snapshot_writers.SimpleWriter(savefun=failing_on_last_rank(
        comm, 4, chainer.serializers.save_npz))
    trainer = make_trainer(comm, outdir, 6)
    ext = mnopt.extensions.multi_node_snapshot(
        comm, chainer.training.extensions.snapshot(n_retains=1,
                                                   writer=writer),
        list(range(comm.size)))
    trainer.extend(ext, trigger=(2, 'iteration'))
    with expect_failure_everywhere(comm):
        trainer.run()
    comm.allgather_obj(None)
    names = sorted(n for n in os.listdir(outdir) if n.startswith('snap'))
    held = {r: sorted(n for n in names if n.endswith('.%d' % r))
            for r in range(comm.size)}
    assert held[0][-1] == 'snapshot_iter_4.0' or comm.size == 1, held
    for r in range(comm.size):   # 2 kept: the newest every rank holds
        assert 'snapshot_iter_2.%d' % r in held[r], held
    again = make_trainer(comm, outdir, 8)
    auto = mnopt.extensions.multi_node_snapshot(
        comm, chainer.training.extensions.snapshot(autoload=True),
        list(range(comm.size)))
    with warns_on_rank_0(comm, r'skipping snapshot snapshot_iter_4\b.*'
                         r'is missing') if comm.size > 1 \
            else contextlib.nullcontext():
        auto.initialize(again)
    assert auto.loaded == 'snapshot_iter_2'
    # And without a failure: each rank keeps the one newest snapshot.
    trainer = make_trainer(comm, outdir, 6)
    trainer.extend(mnopt.extensions.multi_node_snapshot(
        comm, chainer.training.extensions.snapshot(n_retains=1),
        list(range(comm.size))), trigger=(2, 'iteration'))
    trainer.run()
    comm.allgather_obj(None)
    assert sorted(n for n in os.listdir(outdir) if n.startswith('snap')) \
        == ['snapshot_iter_6.%d' % r for r in range(comm.size)]


def test_a_snapshot_mixing_two_writes_is_skipped_with_a_warning(
        comm, outdir):
    if comm.size == 1:
        pytest.skip('one rank writes one file: nothing to mix')
    # Job A writes snapshots 2 and 4 (a file per rank); job B, another
    # run, rewrites snapshot 4 on every rank but the last, whose write
    # was lost: the last rank's file of 4 is still A's.
    def run(iterations):
        trainer = make_trainer(comm, outdir, iterations)
        trainer.extend(mnopt.extensions.multi_node_snapshot(
            comm, chainer.training.extensions.snapshot(),
            list(range(comm.size))), trigger=(2, 'iteration'))
        trainer.run()
        comm.allgather_obj(None)
    run(4)
    last = os.path.join(outdir, 'snapshot_iter_4.%d' % (comm.size - 1))
    if comm.rank == comm.size - 1:
        shutil.copy(last, last + '.keep')
    comm.allgather_obj(None)
    run(4)
    if comm.rank == comm.size - 1:
        os.replace(last + '.keep', last)
    comm.allgather_obj(None)
    again = make_trainer(comm, outdir, 8)
    auto = mnopt.extensions.multi_node_snapshot(
        comm, chainer.training.extensions.snapshot(autoload=True),
        list(range(comm.size)))
    with warns_on_rank_0(comm, r'skipping snapshot snapshot_iter_4\b.*'
                         r'different writes'):
        auto.initialize(again)
    assert auto.loaded == 'snapshot_iter_2'
    assert again.updater.iteration == 2


def test_a_snapshot_without_write_ids_still_loads(comm, outdir):
    # Written before mnopt recorded write ids: no id in any file.
    from mnopt.extensions.snapshot_records import WRITE_ID_KEY
    trainer = make_trainer(comm, outdir, 2)
    trainer.extend(mnopt.extensions.multi_node_snapshot(
        comm, chainer.training.extensions.snapshot(),
        list(range(comm.size))), trigger=(2, 'iteration'))
    trainer.run()
    comm.allgather_obj(None)
    path = os.path.join(outdir, 'snapshot_iter_2.%d' % comm.rank)
    with numpy.load(path) as f:
        assert WRITE_ID_KEY in f.files
        old = {k: f[k] for k in f.files if k != WRITE_ID_KEY}
    with open(path, 'wb') as f:
        numpy.savez_compressed(f, **old)
    comm.allgather_obj(None)
    again = make_trainer(comm, outdir, 4)
    auto = mnopt.extensions.multi_node_snapshot(
        comm, chainer.training.extensions.snapshot(autoload=True),
        list(range(comm.size)))
    auto.initialize(again)
    assert auto.loaded == 'snapshot_iter_2'


def test_an_unsharded_snapshot_loads_into_a_sharded_optimizer_not_strict(
        comm, tmp_path):
    L = chainer.links

    def model():
        numpy.random.seed(0)
        return L.Classifier(chainer.Sequential(L.Linear(3, 4), L.Linear(4, 2)))
    x = numpy.random.RandomState(1).standard_normal((8, 3)).astype('f')
    t = (x[:, 0] > 0).astype(numpy.int32)
    plain = mnopt.create_multi_node_optimizer(chainer.optimizers.Adam(),
                                              comm).setup(model())
    plain.update(plain.target, x, t)
    plain.update(plain.target, x, t)
    path = str(tmp_path / 'plain.npz')
    chainer.serializers.save_npz(path, plain)
    sharded = mnopt.create_multi_node_optimizer(
        chainer.optimizers.Adam(), comm, shard_state=True).setup(model())
    chainer.serializers.load_npz(path, sharded, strict=False)
    steps = plain.actual_optimizer.t
    assert steps > 0 and sharded.actual_optimizer.t == steps
    params = dict(plain.target.namedparams())
    # The partition the load made (the optimizer adopts it at the next
    # update, once every rank agreed).
    pieces = zero.partition([(n, p.array.size, p.array.dtype.name)
                             for n, p in sorted(params.items())], comm.size)
    mine = {p.name: p for p in pieces if p.rank == comm.rank}
    for name, p in sharded.target.namedparams():
        piece = mine.get(name)
        if piece is not None:
            for key, value in p.update_rule.state.items():
                whole = params[name].update_rule.state[key].reshape(-1)
                numpy.testing.assert_array_equal(
                    value, whole[piece.lo:piece.hi], err_msg=name + key)
        else:
            assert p.update_rule.state is None, name
    sharded.update(sharded.target, x, t)   # resumes on every rank
    assert sharded.actual_optimizer.t == steps + 1


# Another number of ranks: scatter_dataset(shuffle=True) gives each rank
# 48 / size examples (24 at 2 ranks, 16 at 3), each read by a shuffled
# iterator of batch 4 (a SerialIterator or a MultiprocessIterator).
# x[:, 0] is an example's index, so the job sees which examples its
# iterator yields: a copy of the loaded iterator, and the training itself
# (the converter records each example under the epoch it belongs to).
#: One variant (``mode``, ``kind``) of the resize job, run with its own
#: globals by RESIZE_JOB: one mpiexec job per stage runs every variant.
RESIZE_VARIANT = r"""
def iterator(data):
    if kind == 'multiprocess':
        return chainer.iterators.MultiprocessIterator(
            data, 4, shuffle=True, n_processes=1)
    return chainer.iterators.SerialIterator(data, 4, shuffle=True)


comm = mnopt.create_communicator('flat')
numpy.random.seed(0)
model = L.Classifier(chainer.Sequential(L.Linear(3, 4), L.Linear(4, 2)))
x = numpy.random.RandomState(5).standard_normal((48, 3)).astype('f')
x[:, 0] = numpy.arange(48)
t = (x[:, 1] > 0).astype(numpy.int32)
shard = mnopt.scatter_dataset(chainer.datasets.TupleDataset(x, t), comm,
                              shuffle=True, seed=7)
it = iterator(shard)
trained = {}


def converter(batch, device=None):
    ids = [int(e[0][0]) for e in batch]
    # A batch that ended an epoch: its last current_position examples are
    # the next epoch's (Chainer's iterators fill the batch from it).
    ended = len(ids) - it.current_position if it.is_new_epoch else len(ids)
    epoch = it.epoch - 1 if it.is_new_epoch else it.epoch
    trained.setdefault(epoch, []).extend(ids[:ended])
    trained.setdefault(it.epoch, []).extend(ids[ended:])
    return chainer.dataset.concat_examples(batch, device)


opt = mnopt.create_multi_node_optimizer(
    chainer.optimizers.Adam(), comm, shard_state=(mode == 'sharded'))
opt.setup(model)
trainer = chainer.training.Trainer(
    chainer.training.StandardUpdater(it, opt, converter=converter),
    (stop, 'iteration'), out=out)
snap = mnopt.extensions.multi_node_snapshot(
    comm, chainer.training.extensions.snapshot(autoload=True))
trainer.extend(snap, trigger=(stop, 'iteration'))

snap.initialize(trainer)   # the autoload (trainer.run does it again)
assert trainer.updater.iteration == resumed_at, trainer.updater.iteration
n = len(shard)
if resumed_at:
    with numpy.load(os.path.join(out, 'snapshot_iter_%d.0' % resumed_at)) \
            as f:
        epoch = int(f['updater/iterator:main/epoch'])
        old_n = len(f['updater/iterator:main/order'])
        old_position = int(f['updater/iterator:main/current_position'])
    assert old_n != n, (old_n, n)
    # The examples the epoch has not read (the snapshot records them),
    # split among the ranks: this rank's share is read at the end of its
    # epoch, whatever its shard (mnopt/iterators/epoch_position.py).
    with numpy.load(os.path.join(out, 'snapshot_iter_%d.0' % resumed_at)) \
            as f:
        read = numpy.unpackbits(
            f['updater/iterator:main/mnopt_epoch_seen'], count=48)
    unread = {i for i in range(48) if not read[i]}
    state = {}
    chainer.serializers.DictionarySerializer(state).save(it)
    copy = iterator(shard)
    chainer.serializers.NpzDeserializer(state).load(copy)
    seen = []
    while copy.epoch == epoch:
        seen += [int(e[0][0]) for e in copy.next()]
    if copy.is_new_epoch and copy.current_position:   # the next epoch's
        seen = seen[:-copy.current_position]
    assert len(set(seen)) == len(seen), seen
    assert len(seen) == n - it.current_position, (len(seen), n)
    assert set(seen) <= unread, (sorted(seen), sorted(unread))
    # Between them the ranks read every unread example; twice only as
    # force_equal_length's padding (fewer than one a rank).
    everyone = sum(comm.allgather_obj(seen), [])
    assert set(everyone) == unread and \
        len(everyone) - len(unread) < comm.size, everyone
    whole = []
    while copy.epoch == epoch + 1:
        whole += [int(e[0][0]) for e in copy.next()]
    whole = whole[:n]   # the last batch may reach into the epoch after
    if kind == 'multiprocess':
        copy.finalize()
    assert it.epoch == epoch and it.current_position == n - len(seen)
    if comm.rank == 0:
        print('%s: RESUMED epoch %d at %d of %d (%d of %d saved)'
              % (label, epoch, it.current_position, n, old_position, old_n),
              flush=True)
    resumed_epoch, resumed_position = epoch, it.current_position
trainer.run()
assert trainer.updater.iteration == stop
if kind == 'multiprocess':
    it.finalize()
# What training read: no example twice in an epoch; after a resize, the
# rest of the resumed epoch, then whole epochs of the new shard.
for e, got in sorted(trained.items()):
    assert len(set(got)) == len(got), (comm.rank, e, sorted(got))
    if resumed_at and e == resumed_epoch:
        assert len(got) == n - resumed_position, (comm.rank, e, len(got))
    elif e < max(trained):
        assert len(got) == n, (comm.rank, e, len(got))
if comm.rank == 0:
    print('%s: DONE at %d' % (label, stop), flush=True)
comm.finalize()
"""

RESIZE_JOB = r"""
import os, sys
import numpy
import chainer
import chainer.links as L
import mnopt

out, stop, resumed_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for label in sys.argv[4:]:
    mode, kind = label.split('-')
    exec(%r, dict(out=os.path.join(out, label), stop=stop,
                  resumed_at=resumed_at, mode=mode, kind=kind, label=label,
                  os=os, numpy=numpy, chainer=chainer, L=L, mnopt=mnopt))
""" % RESIZE_VARIANT

RESIZE_VARIANTS = ['plain-serial', 'sharded-serial', 'plain-multiprocess',
                   'sharded-multiprocess']


@pytest.mark.spawn
def test_a_resize_rebuilds_each_ranks_iterator_for_its_new_shard(tmp_path):
    # Every variant (plain or sharded optimizer state x Serial or
    # Multiprocess iterator) in turn, in each stage's one job.
    # 2 ranks to iteration 5 (20 of 24 each: 8 of 48 unread), 3 ranks to
    # 9 (3 of the 8 each, force_equal_length's padding: resumed at 13 of
    # 16; one batch to the epoch's end, which takes 1 of epoch 1, then
    # epoch 1 to 13 of 16: 9 of 48 unread), 2 ranks to 15 (5 of the 9
    # each: resumed at 19 of 24).
    out = str(tmp_path)
    for n, stop, resumed_at, expect in (
            (2, 5, 0, None),
            (3, 9, 5, 'RESUMED epoch 0 at 13 of 16 (20 of 24 saved)'),
            (2, 15, 9, 'RESUMED epoch 1 at 19 of 24 (13 of 16 saved)')):
        proc = run_mpi(n, RESIZE_JOB, timeout=240,
                       args=[out, str(stop), str(resumed_at)] +
                       RESIZE_VARIANTS)
        assert proc.returncode == 0, (n, proc.stderr[-3000:])
        for label in RESIZE_VARIANTS:
            assert '%s: DONE at %d' % (label, stop) in proc.stdout, \
                proc.stdout[-2000:]
            if expect:
                assert '%s: %s' % (label, expect) in proc.stdout, \
                    proc.stdout[-2000:]
