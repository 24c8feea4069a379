"""Asynchronous snapshots (``multi_node_snapshot(..., asynchronous=True)``):
the state of the step the snapshot was taken at, written by a thread, a
file under a snapshot's name only once it is complete and read back, the
next snapshot confirming the previous write on every rank, and a kill at
any phase of a write (the copy, the write, between two ranks' writes)
leaving the newest complete snapshot loadable on every rank.  Serially
and under mpiexec -n 2 / -n 3; the kills spawn their own jobs
(tests/async_snapshot_job.py)."""

import os
import sys
import threading

import numpy
import pytest

from conftest import (REPO, chainer, mpiexec, needs_chainer, python_path,
                      run_job)

pytestmark = [needs_chainer, pytest.mark.many_ranks]

import mnopt  # NOQA

JOB = os.path.join(REPO, 'tests', 'async_snapshot_job.py')
RETENTION_JOB = os.path.join(REPO, 'tests', 'async_retention_job.py')


@pytest.fixture
def comm(flat_comm):
    return flat_comm


@pytest.fixture
def hook():
    from mnopt.extensions import background_writer
    yield background_writer
    background_writer.phase_hook = None


def make_trainer(comm, out, iterations, asynchronous, autoload=False):
    sys.path.insert(0, os.path.join(REPO, 'tests'))
    import async_snapshot_job
    trainer, ext = async_snapshot_job.trainer_for(comm, out, autoload,
                                                  asynchronous)
    trainer.stop_trigger = chainer.training.get_trigger(
        (iterations, 'iteration'))
    return trainer, ext


def test_the_file_holds_the_state_at_the_step_not_after(tmp_path, hook):
    from mnopt.extensions.background_writer import BackgroundWriter
    release = threading.Event()
    hook.phase_hook = lambda phase, name: \
        phase == 'writing' and release.wait(60)
    value = numpy.arange(4.0)
    writer = BackgroundWriter()
    writer('snap.0', str(tmp_path), {'a': value})
    assert writer.in_flight()
    value[...] = 99   # training goes on while the thread writes
    assert not os.path.exists(tmp_path / 'snap.0')   # not complete yet
    release.set()
    writer.wait()
    with numpy.load(tmp_path / 'snap.0') as f:
        assert f['a'].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert os.listdir(tmp_path) == ['snap.0']   # no partial file left


def test_asynchronous_writes_what_a_synchronous_snapshot_writes(
        comm, outdir):
    from mnopt.extensions.snapshot_records import WRITE_ID_KEY
    for kind in ('sync', 'async'):
        out = os.path.join(outdir, kind)
        trainer, _ = make_trainer(comm, out, 4, kind == 'async')
        trainer.run()
    comm.allgather_obj(None)
    name = 'snapshot_iter_4.%d' % comm.rank
    with numpy.load(os.path.join(outdir, 'sync', name)) as a, \
            numpy.load(os.path.join(outdir, 'async', name)) as b:
        # A write's id and the trainer's clock differ from run to run.
        keys = set(a.files) - {WRITE_ID_KEY, '_snapshot_elapsed_time'}
        assert keys == set(b.files) - {WRITE_ID_KEY,
                                       '_snapshot_elapsed_time'}
        for k in keys:
            assert numpy.array_equal(a[k], b[k]), k


def test_a_failed_background_write_fails_the_next_snapshot_on_every_rank(
        comm, outdir, hook):
    def fail(phase, name):
        if phase == 'written' and name.startswith('snapshot_iter_2.'):
            raise OSError('no space left on the device')
    if comm.rank == comm.size - 1:
        hook.phase_hook = fail
    trainer, _ = make_trainer(comm, outdir, 6, True)
    with pytest.raises(Exception, match='no space left' if comm.rank ==
                       comm.size - 1 else 'rank %d: OSError: no space left'
                       % (comm.size - 1)):
        trainer.run()


def test_a_failed_last_background_write_fails_the_end_on_every_rank(
        comm, outdir, hook):
    # The snapshot of the last iteration has no next snapshot to confirm
    # it: the trainer's end does, on every rank (it was raised on the
    # writer alone, and the other ranks ended as if it were saved).
    failing = comm.size - 1

    def fail(phase, name):
        if phase == 'writing' and name.startswith('snapshot_iter_4.'):
            raise OSError('no space left on the device')
    if comm.rank == failing:
        hook.phase_hook = fail
    trainer, _ = make_trainer(comm, outdir, 4, True)
    with pytest.raises(Exception, match='no space left' if comm.rank ==
                       failing else 'rank %d: OSError: no space left'
                       % failing):
        trainer.run()
    assert trainer.updater.iteration == 4   # raised at the end, not before
    names = os.listdir(outdir)
    assert 'snapshot_iter_4.%d' % failing not in names
    assert 'snapshot_iter_2.%d' % comm.rank in names   # the one to resume


def test_another_writer_with_asynchronous_is_an_error(comm):
    from chainer.training.extensions import snapshot_writers
    with pytest.raises(ValueError, match='leave the snapshot.s writer out'):
        mnopt.extensions.multi_node_snapshot(
            comm, chainer.training.extensions.snapshot(
                writer=snapshot_writers.ThreadWriter()), asynchronous=True)


def test_asynchronous_on_some_ranks_only_is_an_error_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip('needs two ranks')
    with pytest.raises(ValueError, match=r'asynchronous=True on ranks \[0\] '
                                         'only'):
        mnopt.extensions.multi_node_snapshot(
            comm, chainer.training.extensions.snapshot(),
            asynchronous=comm.rank == 0)


def job(args, timeout=240):
    env = dict(os.environ, PYTHONPATH=python_path())
    return run_job(mpiexec() + ['-n', '2', sys.executable, '-m', 'mpi4py',
                                JOB] + args, timeout, env)


@pytest.mark.spawn
@pytest.mark.parametrize('kill_rank,phase,newest', [
    (0, 'copied', 2),          # during the copy: nothing of 4 written
    (1, 'writing', 2),         # during the write: a partial file only
    (1, 'written-alone', 2),   # between the ranks' writes: rank 0's alone
    (1, 'renamed', 4),         # after both: 4 is complete
])
def test_a_kill_at_any_phase_leaves_the_newest_complete_snapshot(
        tmp_path, kill_rank, phase, newest):
    killed = job(['run', str(tmp_path), str(kill_rank), phase])
    assert killed.returncode != 0, killed.stdout
    resumed = job(['resume', str(tmp_path)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count('LOADED snapshot_iter_%d AT %d'
                                % (newest, newest)) == 2, resumed.stdout
    if phase == 'written-alone':   # skipped, naming the missing file
        assert 'snapshot_iter_4.1 is missing' in resumed.stderr


@pytest.mark.spawn
def test_retention_counts_only_snapshots_autoload_would_load(tmp_path):
    # n_retains=1, sharded, in the background.  A 3-rank run's node is
    # lost during snapshot 8 (8.0 and 8.1 written, 8.2 never); on 2 ranks
    # 8 is no snapshot (its shares need every file), so the run resumes
    # from 6.  Its prune before its own write of 8 must not count the old
    # 8 as complete: 6 is the only loadable snapshot while that write is
    # in flight, and a kill during it leaves 6 to resume from.
    def run(n, kill):
        env = dict(os.environ, PYTHONPATH=python_path())
        return run_job(mpiexec() + ['-n', str(n), sys.executable, '-m',
                                    'mpi4py', RETENTION_JOB, str(tmp_path),
                                    kill], 240, env)
    assert run(3, 'lost-node').returncode != 0
    assert 'snapshot_iter_8.2' not in os.listdir(str(tmp_path))
    failed = run(2, 'second-failure')
    assert failed.returncode != 0
    assert 'LOADED snapshot_iter_6 AT 6' in failed.stdout, failed.stdout
    assert 'snapshot_iter_6.0 snapshot_iter_6.1' in failed.stdout, \
        failed.stdout
    resumed = run(2, 'none')
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert 'LOADED snapshot_iter_6 AT 6' in resumed.stdout, \
        resumed.stdout + resumed.stderr[-3000:]
    # Its own 10 complete, the rest goes (6.2 too: no rank writes it now).
    assert sorted(n for n in os.listdir(str(tmp_path))
                  if n.startswith('snap')) == [
        'snapshot_iter_10.0', 'snapshot_iter_10.1']


def test_a_write_in_flight_never_costs_the_complete_snapshot(
        comm, outdir, hook):
    # A filename that starts with a format field: the partial file of the
    # write in flight (.mnopt-partial.4.snap.R) is no snapshot, so the
    # prune keeps 2.snap until 4.snap is complete; with n_retains=1 one
    # file is left at the end, once the last write is complete.
    release = threading.Event()
    hook.phase_hook = lambda phase, name: \
        phase == 'writing' and name.startswith('4.') and release.wait(60)
    numpy.random.seed(0)
    model = chainer.links.Classifier(chainer.links.Linear(3, 2))
    x = numpy.ones((8, 3), numpy.float32)
    it = chainer.iterators.SerialIterator(chainer.datasets.TupleDataset(
        x, numpy.zeros(8, numpy.int32)), 2)
    opt = mnopt.create_multi_node_optimizer(chainer.optimizers.SGD(), comm)
    opt.setup(model)
    trainer = chainer.training.Trainer(
        chainer.training.StandardUpdater(it, opt), (4, 'iteration'),
        out=outdir)
    trainer.extend(mnopt.extensions.multi_node_snapshot(
        comm, chainer.training.extensions.snapshot(
            filename='{.updater.iteration}.snap', n_retains=1),
        list(range(comm.size)), asynchronous=True), trigger=(2, 'iteration'))
    during = []

    @chainer.training.make_extension(trigger=(1, 'iteration'),
                                     priority=-1000)   # after the snapshot
    def look(trainer):
        if trainer.updater.iteration == 4:
            during.append(sorted(os.listdir(outdir)))
            release.set()
    trainer.extend(look)
    trainer.run()
    mine = '2.snap.%d' % comm.rank
    assert mine in during[0], during
    comm.allgather_obj(None)
    assert sorted(n for n in os.listdir(outdir) if n.endswith('.snap.%d'
                  % comm.rank)) == ['4.snap.%d' % comm.rank]
