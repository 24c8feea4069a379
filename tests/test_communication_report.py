"""The communicator's per-step communication figures
(mnopt/timeline/step_stats.py, ``comm.communication_stats()``) and the
CommunicationReport extension that puts them in the trainer's observations:
exposed and hidden time consistent with the wire time, bytes by the algorithm's
formula, the rank that arrives late found with its lateness, the keys in the
LogReport in every optimizer mode, and no collective per step for any of it.
Runs serially (the averaging run at one rank: MNOPT_SINGLE_RANK_AVERAGING=1)
and under mpiexec -n 2 and -n 3."""

import time

import numpy
import pytest

from conftest import WORLD, needs_chainer, slack

import mnopt
from mnopt.timeline import step_stats, recorder as timeline

pytestmark = pytest.mark.many_ranks

N = WORLD.size


@pytest.fixture(autouse=True)
def averaging_at_one_rank(monkeypatch):
    # Serially, the whole averaging path runs (else it moves nothing);
    # the figures are kept with the timeline off.
    monkeypatch.setenv('MNOPT_SINGLE_RANK_AVERAGING', '1')
    monkeypatch.delenv(timeline.ENV, raising=False)
    monkeypatch.delenv(step_stats.LINK_RATE_ENV, raising=False)


def grads(n=1000, value=None):
    return [('/a', numpy.full(n, WORLD.rank if value is None else value,
                              numpy.float32)),
            ('/b', numpy.ones(24, numpy.float32))]


# -- the pieces, on one rank --------------------------------------------------

def test_traffic_and_bus_factors():
    assert step_stats.traffic('allreduce', 4000, 2) == (4000, 4000)
    assert step_stats.traffic('allreduce', 3000, 3) == (4000, 4000)
    assert step_stats.traffic('reduce_scatter', 3000, 3) == (2000, 2000)
    assert step_stats.traffic('allgather', 4000, 4) == (3000, 3000)
    assert step_stats.traffic('allreduce', 4000, 1) == (0, 0)
    assert step_stats.bus_factor('allreduce', 4) == 1.5
    assert step_stats.bus_factor('vote', 4) == 1.5     # as an allreduce
    assert step_stats.bus_factor('allreduce', 1) == 0.0


def test_link_rate(monkeypatch):
    assert step_stats.link_rate() is None
    assert step_stats.link_rate('10gbit') == 10e9
    assert step_stats.link_rate(1e9) == 1e9
    monkeypatch.setenv(step_stats.LINK_RATE_ENV, '250mbit')
    assert step_stats.link_rate() == 250e6
    assert step_stats.link_rate('1gbit') == 1e9      # given wins
    for bad in ('fast', '0', -5):
        with pytest.raises(ValueError):
            step_stats.link_rate(bad)


def test_stragglers_from_waits():
    # Collective 'x': rank 2 waited least (arrived last, 0.3 s after the
    # median of the others); 'y': rank 0; 'z' seen on one rank only.
    per_rank = [[('x', 0.40), ('y', 0.01), ('z', 1.0)],
                [('x', 0.30)],
                [('x', 0.05), ('y', 0.5)]]
    found = step_stats.stragglers(per_rank)
    assert found['matched'] == 2
    assert found['straggler'] == 0     # a tie: the lower rank
    assert found['last'][2] == [pytest.approx(0.30)]
    assert found['last'][0] == [pytest.approx(0.49)]
    found = step_stats.stragglers(      # 'w': rank 2 last again
        [r + [('w', 0.0 if i == 2 else 0.3)] for i, r in enumerate(per_rank)])
    assert found['straggler'] == 2 and found['matched'] == 3
    assert found['late'] == pytest.approx(0.30)           # the median
    assert step_stats.stragglers([[('x', 1.0)]])['straggler'] is None
    assert step_stats.last_arrival({0: 1.0, 1: 3.0, 2: 2.0}) == (1, 1.5)


def test_take_returns_and_starts_again():
    stats = step_stats.StepStats(4, keep=3)
    stats.add_time('caller', 0.5)
    stats.add_time('waited', 0.25)
    stats.add_time('background', 1.0)
    for seq in range(5):
        stats.add_wire(('c', seq), 0.1, 1000, 'allreduce', 1500, 1500)
    out = stats.take()
    assert out['exposed'] == 0.75 and out['waited'] == 0.25
    assert out['hidden'] == 0.75           # background less waited
    assert out['collectives'] == 5 and out['bytes'] == 5000
    assert out['bytes_sent'] == out['bytes_received'] == 7500
    assert out['busbw'] == pytest.approx(5000 * 1.5 / 0.5)
    assert [k for k, _ in out['arrivals']] == [('c', 2), ('c', 3), ('c', 4)]
    again = stats.take()
    assert again['exposed'] == again['wire'] == again['bytes'] == 0
    assert again['arrivals'] == [] and again['busbw'] is None
    stats.add_time('waited', 2.0)
    stats.add_time('background', 1.0)
    assert stats.take()['hidden'] == 0.0   # never below zero


# -- the communicator's figures -----------------------------------------------

@pytest.mark.parametrize('name', ['flat', 'naive', 'reduction_server'])
def test_bytes_follow_the_algorithm(name):
    comm = mnopt.create_communicator(name)
    try:
        comm.communication_stats()
        comm.mean_grads(grads())
        out = comm.communication_stats()
        payload = (1000 + 24) * 4
        assert out['collectives'] == 1 and out['bytes'] == payload
        if name == 'reduction_server':
            expected = payload              # pushed, and the mean pulled
        else:
            expected = round(2.0 * (N - 1) / N * payload)
        assert out['bytes_sent'] == out['bytes_received'] == expected
        if N > 1:
            assert out['busbw'] == pytest.approx(
                payload * 2.0 * (N - 1) / N / out['wire'])
        assert out['arrivals'][0][0] == (comm.timeline_name, 0)
        assert comm.communication_stats()['bytes'] == 0, 'taken'
    finally:
        comm.finalize()


def test_what_the_ranks_send_they_receive(comm_name):
    """Over all ranks, the bytes sent are the bytes received, and a rank
    that moves nothing is alone (hierarchical: an estimate, also with
    nodes faked as pairs of ranks)."""
    comm = mnopt.create_communicator(comm_name)
    try:
        comm.mean_grads(grads())
        out = comm.communication_stats()
        moved = comm.everyone((out['bytes_sent'], out['bytes_received']),
                              'the test')
        assert sum(s for s, _ in moved) == sum(r for _, r in moved)
        assert all(s > 0 and r > 0 for s, r in moved) == (N > 1)
    finally:
        comm.finalize()


def test_sign_counts_the_votes_bytes():
    comm = mnopt.create_communicator('flat', compression='sign')
    try:
        comm.mean_grads(grads(4096))
        out = comm.communication_stats()
        assert out['collectives'] == 1
        assert out['bytes_sent'] == comm.vote_stats.get('bytes_sent', 0)
        assert out['bytes'] == (4096 + 24 + 7) // 8     # one bit each
    finally:
        comm.finalize()


def test_exposed_and_hidden_against_the_wire():
    comm = mnopt.create_communicator('flat')
    try:
        # Synchronous: all of it exposed, none hidden.
        start = time.perf_counter()
        comm.mean_grads(grads(1 << 16))
        took = time.perf_counter() - start
        out = comm.communication_stats()
        assert out['hidden'] == 0.0 and out['background'] == 0.0
        assert 0 < out['wire'] <= out['exposed'] <= took
        # In the background: the wait is exposed; what ran meanwhile is
        # hidden; together they cover the wire.
        handle = comm.mean_grads_async(grads(1 << 16))   # the thread starts
        handle.wait()
        comm.communication_stats()
        start = time.perf_counter()
        handle = comm.mean_grads_async(grads(1 << 16))
        x = numpy.ones(1 << 18)
        for _ in range(20):                 # compute meanwhile
            x = numpy.sqrt(x + 1.0)
        handle.wait()
        took = time.perf_counter() - start
        out = comm.communication_stats()
        assert out['exposed'] == out['waited'] >= 0
        assert 0 < out['wire'] <= out['background']
        assert out['wire'] <= out['exposed'] + out['hidden'] + 1e-9
        assert out['exposed'] + out['hidden'] <= took
    finally:
        comm.finalize()


def test_figures_are_the_same_with_the_timeline_on(tmp_path):
    comm = mnopt.create_communicator(
        'flat', timeline=str(tmp_path / 'trace.json'))
    try:
        comm.mean_grads(grads())
        out = comm.communication_stats()
        assert comm.timeline, 'recording'
        assert out['collectives'] == 1 and out['bytes'] == (1000 + 24) * 4
    finally:
        comm.finalize()


@pytest.mark.skipif(N < 2, reason='a straggler needs two ranks')
def test_a_late_rank_is_the_straggler():
    comm = mnopt.create_communicator('flat')
    late, sleep = N - 1, 0.3
    try:
        comm.mean_grads(grads())            # the ranks line up
        comm.communication_stats()
        for _ in range(3):
            if comm.rank == late:
                time.sleep(sleep)
            comm.mean_grads(grads())
        mine = comm.communication_stats()['arrivals']
        found = step_stats.stragglers(comm.everyone(mine, 'the test'))
        assert found['matched'] == 3
        assert found['straggler'] == late
        assert len(found['last'][late]) == 3
        assert sleep * 0.5 <= found['late'] <= sleep + slack(0.5)
    finally:
        comm.finalize()


# -- the extension, in a trainer ----------------------------------------------

chainer = pytest.importorskip(
    'chainer', reason='the Chainer layer (the numpy1 and numpy2 stacks run it)')
import chainer.functions as F  # NOQA
import chainer.links as L  # NOQA
from chainer import training  # NOQA
from chainer.training import extensions  # NOQA

from mnopt.extensions import CommunicationReport  # NOQA

KEYS = ('comm/exposed', 'comm/hidden', 'comm/bytes_sent',
        'comm/bytes_received', 'comm/busbw')
#: mode: (create_communicator's keywords, create_multi_node_optimizer's).
MODES = {
    'sync': ({}, {}),
    'double_buffering': ({}, {'double_buffering': True}),
    'overlap': ({}, {'overlap': True}),
    'sign': ({'compression': 'sign'}, {}),
    'powersgd': ({'compression': 'powersgd'}, {}),
    'zero': ({}, {'shard_state': True}),
    'zero_stage2': ({}, {'shard_state': True, 'overlap': True}),
}


class Net(chainer.Chain):
    def __init__(self, late_rank=None, sleep=0.0):
        super(Net, self).__init__()
        self.late_rank, self.sleep = late_rank, sleep
        with self.init_scope():
            self.l1 = L.Linear(8, 32)
            self.l2 = L.Linear(32, 4)

    def forward(self, x, t):
        if WORLD.rank == self.late_rank:
            time.sleep(self.sleep)
        loss = F.softmax_cross_entropy(self.l2(F.relu(self.l1(x))), t)
        chainer.report({'loss': loss}, self)
        return loss


def trainer_for(comm, optimizer_options, iterations, out, model=None):
    model = model or Net()
    optimizer = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(lr=0.01), comm, **optimizer_options)
    optimizer.setup(model)
    rng = numpy.random.RandomState(WORLD.rank)
    data = [(rng.standard_normal(8).astype(numpy.float32),
             numpy.int32(rng.randint(4))) for _ in range(64)]
    it = chainer.iterators.SerialIterator(data, 4)
    updater = training.StandardUpdater(it, optimizer)
    trainer = training.Trainer(updater, (iterations, 'iteration'),
                               out=str(out))
    return trainer, optimizer


@needs_chainer
@pytest.mark.parametrize('mode', sorted(MODES))
def test_the_keys_are_in_the_log_report(mode, tmp_path):
    comm_options, optimizer_options = MODES[mode]
    comm = mnopt.create_communicator('flat', **comm_options)
    try:
        trainer, optimizer = trainer_for(comm, optimizer_options, 7,
                                         tmp_path)
        report = CommunicationReport(comm, trigger=(2, 'iteration'),
                                     link_rate='1gbit')
        trainer.extend(report)
        log = extensions.LogReport(trigger=(2, 'iteration'))
        trainer.extend(log)
        trainer.run()
        if optimizer_options.get('double_buffering'):
            optimizer.wait()
        entries = log.log
        assert [e['iteration'] for e in entries] == [2, 4, 6]
        for i, entry in enumerate(entries):
            for key in KEYS[:-1] + ('main/loss',):
                assert key in entry, (key, entry)
            if N > 1:
                assert entry['comm/straggler'] in range(-1, N)
                assert entry['comm/straggler_late'] >= 0
            else:
                assert 'comm/straggler' not in entry
            # At one rank nothing crosses a link: no bus bandwidth; with
            # double buffering the first averaging may end a step later.
            averaged = bool(i) or mode != 'double_buffering'
            if not averaged:
                continue
            if N > 1:
                assert entry['comm/busbw'] > 0
                assert entry['comm/busbw_fraction'] == pytest.approx(
                    entry['comm/busbw'] * 8 / 1e9)
            if N == 1:
                assert 'comm/busbw' not in entry
            assert entry['comm/exposed'] > 0
            assert entry['comm/hidden'] >= 0
            if mode in ('sync', 'sign', 'powersgd', 'zero'):
                assert entry['comm/hidden'] == 0, 'nothing in the background'
            assert (entry['comm/bytes_sent'] > 0) == (N > 1)
        assert report.last['steps'] == 2
    finally:
        comm.finalize()


class _EveryOrLast(object):
    """Fires every ``n`` iterations and at the last of ``length``."""

    def __init__(self, n, length):
        self.n, self.length = n, length

    def __call__(self, trainer):
        i = trainer.updater.iteration
        return i % self.n == 0 or i == self.length


@needs_chainer
def test_at_end_reports_the_last_steps_too(tmp_path):
    # 7 iterations, reports every 2: iteration 7 (the last) is reported
    # too, as a report of its one step, so a log line there has the keys.
    comm = mnopt.create_communicator('flat')
    try:
        trainer, _ = trainer_for(comm, {}, 7, tmp_path)
        report = CommunicationReport(comm, trigger=(2, 'iteration'),
                                     at_end=True)
        trainer.extend(report)
        log = extensions.LogReport(trigger=_EveryOrLast(2, 7))
        trainer.extend(log)
        trainer.run()
        assert [e['iteration'] for e in log.log] == [2, 4, 6, 7]
        assert 'comm/exposed' in log.log[-1], log.log[-1]
        assert report.last['steps'] == 1
        # This run's totals: every step, the payload with them.
        assert report.totals['steps'] == 7
        assert report.totals['bytes'] > 0
        assert report.totals['exposed'] > 0
    finally:
        comm.finalize()


@needs_chainer
@pytest.mark.skipif(N < 2, reason='a straggler needs two ranks')
def test_the_report_names_the_late_rank(tmp_path):
    comm = mnopt.create_communicator('flat')
    late, sleep = N - 1, 0.2
    try:
        trainer, _ = trainer_for(comm, {}, 5, tmp_path, Net(late, sleep))
        trainer.extend(CommunicationReport(comm, trigger=(4, 'iteration')))
        log = extensions.LogReport(trigger=(4, 'iteration'))
        trainer.extend(log)
        trainer.run()
        entry, = log.log
        assert entry['comm/straggler'] == late
        assert sleep * 0.5 <= entry['comm/straggler_late'] <= \
            sleep + slack(0.5)
    finally:
        comm.finalize()


def _counts(comm, optimizer_options, with_report, out, iterations=6):
    trainer, optimizer = trainer_for(comm, optimizer_options, iterations,
                                     out)
    if with_report:
        trainer.extend(CommunicationReport(comm, trigger=(3, 'iteration')))
    trainer.run()
    if optimizer_options.get('double_buffering'):
        optimizer.wait()
    return comm._monitor.counts()


@needs_chainer
@pytest.mark.parametrize('mode', ['sync', 'double_buffering'])
def test_no_collective_per_step(mode, tmp_path):
    """The figures cost no collective; the report one per interval."""
    counts = []
    for with_report in (False, True):
        comm = mnopt.create_communicator('flat')
        try:
            counts.append(_counts(comm, MODES[mode][1], with_report,
                                  tmp_path))
        finally:
            comm.finalize()
    without, with_ = counts
    assert set(with_) == set(without) | ({'agreement'} if N > 1 else set())
    extra = {k: with_[k] - without.get(k, 0) for k in with_
             if with_[k] != without.get(k, 0)}
    assert extra == ({'agreement': 2} if N > 1 else {})   # iterations 3, 6


class _Trainer(object):
    """What the extension reads of a trainer."""

    def __init__(self, iteration):
        self.updater = type('U', (), {'iteration': iteration})()
        self.observation = {}


@needs_chainer
@pytest.mark.skipif(N < 2, reason='needs two ranks to disagree')
def test_ranks_reporting_at_other_iterations_raise_together():
    comm = mnopt.create_communicator('flat')
    try:
        report = CommunicationReport(comm)
        report.initialize(_Trainer(0))
        # Rank 0 is called at iteration 2 only (another trigger), the
        # others at 1: their one exchange pairs up, and every rank raises.
        with pytest.raises(ValueError, match='different iterations'):
            report(_Trainer(2 if comm.rank == 0 else 1))
    finally:
        comm.finalize()


@needs_chainer
def test_only_iterations_are_accepted():
    comm = mnopt.create_communicator('flat')
    try:
        assert CommunicationReport(comm, trigger=5).interval == 5
        assert CommunicationReport(
            comm, trigger=chainer.training.triggers.IntervalTrigger(
                3, 'iteration')).interval == 3
        for bad in ((1, 'epoch'), (0, 'iteration'), (1.5, 'iteration')):
            with pytest.raises(ValueError, match='whole number of iter'):
                CommunicationReport(comm, trigger=bad)
        with pytest.raises(ValueError, match='link rate'):
            CommunicationReport(comm, link_rate='fast')
    finally:
        comm.finalize()


@needs_chainer
def test_one_report_per_communicator(tmp_path):
    """Each figure is taken once: a second report of the same
    communicator in one trainer is refused (it would report what the
    first left); another trainer's report may take them."""
    comm = mnopt.create_communicator('flat')
    try:
        trainer, _ = trainer_for(comm, {}, 2, tmp_path / 'a')
        trainer.extend(CommunicationReport(comm), name='first')
        trainer.extend(CommunicationReport(comm, trigger=3), name='second')
        with pytest.raises(ValueError, match='trainer already has a '
                                             'CommunicationReport'):
            trainer.run()
        trainer, _ = trainer_for(comm, {}, 2, tmp_path / 'b')
        report = CommunicationReport(comm)
        trainer.extend(report)
        trainer.run()
        assert report.last['steps'] == 1
        assert comm.step_stats.reader is None
    finally:
        comm.finalize()


def test_a_communicators_name_is_the_same_on_each_of_its_ranks():
    """Rank 0 first makes a communicator of its own (over COMM_SELF): the
    shared one still has one name on every rank, so its collectives are
    matched across ranks (the straggler), and the two differ on rank 0."""
    from mpi4py import MPI
    own = mnopt.create_communicator('flat', mpi_comm=MPI.COMM_SELF) \
        if WORLD.rank == 0 else None
    comm = mnopt.create_communicator('flat')
    try:
        names = comm.everyone(comm.timeline_name, 'the names')
        assert len(set(names)) == 1, names
        if own is not None:
            assert own.timeline_name != comm.timeline_name
    finally:
        comm.finalize()
        if own is not None:
            own.finalize()
