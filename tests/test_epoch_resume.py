"""A resume mid-epoch on another number of ranks: the examples of an epoch
interrupted at 4 ranks and finished at 3 (at 3, finished at 5; at 3,
finished at 3 from rank 0's file alone; at 4 through ChainerMN's
checkpointer, finished at 3) are the examples of one uninterrupted epoch, none read twice (but the padding
``force_equal_length`` asks for) and none skipped, with ``scatter_dataset``
shuffled and not, ``SerialIterator`` (shuffled and not) and
``MultiprocessIterator``.  Spawns its own jobs (tests/epoch_resume_job.py);
the record itself is tested serially."""

import collections
import json
import os

import numpy
import pytest

from conftest import REPO, mpiexec, python_path, run_job

pytest.importorskip('chainer', reason='iterators and snapshots are of the '
                                      'Chainer layer')

import chainer  # NOQA

import mnopt  # NOQA
from mnopt.datasets.scatter import share_bounds  # NOQA

JOB = os.path.join(REPO, 'tests', 'epoch_resume_job.py')
N, BATCH = 26, 2


def job(n, phase, out, saver='snapshot'):
    import sys
    env = dict(os.environ, PYTHONPATH=python_path())
    done = run_job(mpiexec() + ['-n', str(n), sys.executable, '-m', 'mpi4py',
                                JOB, phase, str(out), str(N), str(BATCH),
                                saver], 300, env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def read_in_epoch_0(out, phase, n):
    found = []
    for rank in range(n):
        with open(os.path.join(out, '%s.%d.json' % (phase, rank))) as f:
            found += json.load(f).get('0', [])
    return found


def padding(n_ranks, equal):
    """How many examples one epoch over ``n_ranks`` reads twice."""
    return sum(e - b for b, e in share_bounds(N, n_ranks, equal)) - N


@pytest.mark.spawn
@pytest.mark.parametrize('before,after', [
    (4, 3), (3, 5),
    # The same number of ranks, one replica set: every rank loads rank
    # 0's iterator, whose order is not its own (it was: skipped and
    # repeated examples).
    (3, 3)])
def test_an_epoch_interrupted_and_finished_on_another_rank_count(
        tmp_path, before, after):
    job(before, 'first', tmp_path)
    done = job(after, 'resume', tmp_path)
    # The old rebuild (the same fraction of the epoch, a new order) is
    # not what happened.
    assert 'same fraction' not in done.stderr
    assert_one_epoch_read(tmp_path, before, after)


@pytest.mark.spawn
def test_an_epoch_interrupted_and_finished_through_the_checkpointer(
        tmp_path):
    # ChainerMN's checkpointer (each rank's own file, maybe_load) records
    # the epoch's position as multi_node_snapshot does (it did not: 4 -> 3
    # ranks skipped and repeated examples).
    job(4, 'first', tmp_path, 'checkpointer')
    done = job(3, 'resume', tmp_path, 'checkpointer')
    assert 'same fraction' not in done.stderr
    assert 'skipping checkpoint' not in done.stderr   # it did resume
    assert_one_epoch_read(tmp_path, 4, 3)


def assert_one_epoch_read(tmp_path, before, after):
    """Epoch 0's examples read before the interruption (at ``before``
    ranks) and after it (at ``after``) are one uninterrupted epoch's, in
    every configuration of tests/epoch_resume_job.py."""
    import epoch_resume_job
    for k, (kind, it_shuffle, scatter_shuffle, equal) in enumerate(
            epoch_resume_job.CONFIGS):
        out = tmp_path / str(k)
        first = read_in_epoch_0(out, 'first', before)
        rest = read_in_epoch_0(out, 'resume', after)
        what = '%s iterator (shuffle=%s), scatter shuffle=%s, ' \
            'force_equal_length=%s' % (kind, it_shuffle, scatter_shuffle,
                                       equal)
        assert len(first) == before * 2 * BATCH, what
        counts = collections.Counter(first + rest)
        assert sorted(counts) == list(range(N)), what   # none skipped
        if not equal:   # the shares are disjoint: each example once
            assert set(counts.values()) == {1}, what
        else:   # twice only as padding: the old epoch's, and < one a rank
            assert sum(counts.values()) - N <= \
                padding(before, True) + after - 1, what
        # Every new rank read the same number of the epoch's examples
        # with force_equal_length (the epoch ends at one iteration).
        if equal:
            per_rank = {len(json.load(open(out / ('resume.%d.json' % r)))
                            .get('0', [])) for r in range(after)}
            assert len(per_rank) == 1, (what, per_rank)


@pytest.mark.spawn
def test_an_epoch_interrupted_twice_on_three_rank_counts(tmp_path):
    # 4 ranks to iteration 2, 3 ranks to 3 (a snapshot inside the rest of
    # the epoch it was given), 5 ranks to the end of the epoch.
    import epoch_resume_job
    job(4, 'first', tmp_path)
    job(3, 'middle', tmp_path)
    job(5, 'resume', tmp_path)
    for k, (kind, it_shuffle, scatter_shuffle, equal) in enumerate(
            epoch_resume_job.CONFIGS):
        out = tmp_path / str(k)
        read = read_in_epoch_0(out, 'first', 4) + \
            read_in_epoch_0(out, 'middle', 3) + \
            read_in_epoch_0(out, 'resume', 5)
        what = (kind, it_shuffle, scatter_shuffle, equal)
        counts = collections.Counter(read)
        assert sorted(counts) == list(range(N)), what
        if not equal:
            assert set(counts.values()) == {1}, what
        else:
            assert sum(counts.values()) - N <= padding(4, True) + 2 + 4, \
                what


@pytest.mark.many_ranks
def test_the_record_is_what_every_rank_read(tmp_path):
    # The record marks exactly the examples the ranks read this epoch, on
    # every rank (serially and under mpiexec -n 2 / -n 3).
    from mnopt.iterators.epoch_position import epoch_record, SEEN_KEY
    comm = mnopt.create_communicator('naive')
    data = mnopt.scatter_dataset(numpy.arange(N), comm, shuffle=True, seed=1,
                                 force_equal_length=False)
    it = chainer.iterators.SerialIterator(data, 4)
    mine = [int(i) for _ in range(2) for i in it.next()]
    read = set(sum(comm.allgather_obj(mine), []))
    opt = chainer.optimizers.SGD()
    opt.setup(chainer.links.Linear(1, 1))
    trainer = chainer.training.Trainer(
        chainer.training.StandardUpdater(it, opt), (1, 'epoch'),
        out=str(tmp_path))
    record = epoch_record(trainer, comm)
    seen = numpy.unpackbits(record['updater/iterator:main/' + SEEN_KEY],
                            count=N).astype(bool)
    assert set(numpy.nonzero(seen)[0]) == read


@pytest.mark.many_ranks
def test_ranks_two_epochs_apart_record_no_position_and_say_so(tmp_path,
                                                              caplog):
    # force_equal_length=False: shares of unequal length, the ranks'
    # epochs drift apart.  Two epochs apart, no position is recorded, and
    # rank 0 says so once.
    from mnopt.iterators.epoch_position import epoch_record, SEEN_KEY
    comm = mnopt.create_communicator('naive')
    if comm.size == 1:
        pytest.skip('needs two ranks')
    data = mnopt.scatter_dataset(numpy.arange(N), comm,
                                 force_equal_length=False)
    it = chainer.iterators.SerialIterator(data, 1)
    for _ in range(2 * len(data) if comm.rank == 1 else 1):
        it.next()
    opt = chainer.optimizers.SGD()
    opt.setup(chainer.links.Linear(1, 1))
    trainer = chainer.training.Trainer(
        chainer.training.StandardUpdater(it, opt), (1, 'epoch'),
        out=str(tmp_path))
    for _ in range(2):
        record = epoch_record(trainer, comm)
        assert 'updater/iterator:main/' + SEEN_KEY not in record
    said = [r.getMessage() for r in caplog.records
            if 'record no position' in r.getMessage()]
    assert len(said) == (1 if comm.rank == 0 else 0), said
    if said:
        assert 'updater/iterator:main: the ranks are in epochs 0 to 2' \
            in said[0] and 'force_equal_length=True' in said[0]


class _Failing(chainer.training.StandardUpdater):
    """Reads a batch, then fails at iteration ``fail_at``."""

    fail_at = 4

    def update_core(self):
        self.get_iterator('main').next()
        if self.iteration + 1 == self.fail_at:
            raise RuntimeError('the failure')


@pytest.mark.many_ranks
def test_the_snapshot_on_error_records_no_stale_position(tmp_path):
    # snapshot_on_error writes the iterator as it is at the failure: an
    # epoch record beside it must be of that moment too (or absent), never
    # the last regular snapshot's, which a resume would read examples
    # twice by.
    from mnopt.iterators.epoch_position import SEEN_KEY
    comm = mnopt.create_communicator('naive')
    data = mnopt.scatter_dataset(numpy.arange(N), comm, shuffle=True, seed=1,
                                 force_equal_length=False)
    it = chainer.iterators.SerialIterator(data, 2)
    opt = chainer.optimizers.SGD()
    opt.setup(chainer.links.Linear(1, 1))
    trainer = chainer.training.Trainer(_Failing(it, opt), (1, 'epoch'),
                                       out=str(tmp_path))
    trainer.extend(mnopt.extensions.multi_node_snapshot(
        comm, chainer.training.extensions.snapshot(snapshot_on_error=True),
        list(range(comm.size))), trigger=(2, 'iteration'))
    with pytest.raises(RuntimeError, match='the failure'):
        trainer.run()
    with numpy.load(str(tmp_path / ('snapshot_iter_2.%d' % comm.rank))) as f:
        key = [k for k in f.files if k.endswith(SEEN_KEY)][0]
        assert numpy.unpackbits(f[key]).sum() == 2 * 2 * comm.size
    with numpy.load(str(tmp_path / ('snapshot_iter_3.%d' % comm.rank))) as f:
        for key in [k for k in f.files if k.endswith(SEEN_KEY)]:
            assert numpy.unpackbits(f[key]).sum() == 4 * 2 * comm.size, \
                'the record of iteration 2 beside the iterator of 4 batches'
