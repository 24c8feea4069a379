"""Tuning in the job (``bucket_bytes='auto'``, ``segment_bytes='auto'``,
``chunk_bytes='auto'``, ``window='auto'``; mnopt/averaging/tuning.py):
every rank ends with the same choice even where each rank measured other
times (made-up times, per rank: nothing here depends on the machine's
speed), within the budget of averagings; each averaging has the bits of a
communicator with its settings fixed; what cannot be tuned is refused on
every rank.  Runs serially and under mpiexec -n 2 / -n 3."""

import logging

import numpy
import pytest
from mpi4py import MPI

import mnopt
from mnopt.averaging import tuning
from mnopt.transport import agreement
from mnopt.transport import allreduce
from conftest import chainer, needs_chainer

# At three ranks the bucket size can change the bits (which rank an
# element's sum starts from): the comparison with fixed settings must hold
# there too.
pytestmark = pytest.mark.many_ranks

WORLD = MPI.COMM_WORLD

#: Small candidates, so that small gradients make several buckets and
#: segments: (bucket, segment; chunk, window).
SMALL = {'bucket_bytes': (4096, 1024, 65536), 'segment_bytes': (512, 2048),
         'chunk_bytes': (4096, 1024, 32768), 'window': (6, 1, 3)}
SHAPES = [(3, 5), (700,), (40, 33), (7,), (2500,), (9, 9, 9)]


@pytest.fixture
def small_candidates(monkeypatch):
    monkeypatch.setattr(tuning, 'CANDIDATES', dict(SMALL))
    # Every averaging runs the whole path, also at one rank.
    monkeypatch.setenv('MNOPT_SINGLE_RANK_AVERAGING', '1')


def grads(step, rank):
    rng = numpy.random.RandomState(1000 * step + rank)
    return [('p%d' % i, rng.standard_normal(s).astype(numpy.float32))
            for i, s in enumerate(SHAPES)]


def made_up_times(rank, candidates):
    """Per candidate (by index): a time that makes this rank's own
    quickest another candidate than every other rank's: candidate i is
    slow on rank i (mod their number), and later candidates are slower."""
    return {c: 1.0 + 0.1 * i + (5.0 if i == rank % len(candidates) else 0)
            for i, c in enumerate(candidates)}


def expected_choice(candidates, size):
    """What every rank must choose from made_up_times: the candidate
    whose slowest rank is quickest."""
    slowest = [max(made_up_times(r, candidates)[c] for r in range(size))
               for c in candidates]
    return candidates[slowest.index(min(slowest))]


def tune(comm, steps, record=None):
    """Average ``steps`` gradient sets on ``comm`` with made-up times;
    ``record``: a list that gets, per averaging, the settings it ran
    with and its result."""
    tuner = comm.averaging.tuner
    times = {name: made_up_times(comm.rank, candidates)
             for name, candidates in tuner.plan}
    ran_with = []

    def measure(seconds, name, value):
        ran_with.append(dict(tuner.current()))
        return times[name][value]

    tuner.measure = measure
    for step in range(steps):
        named = grads(step, comm.rank)
        before = len(ran_with)
        comm.mean_grads(named)
        if record is not None:
            used = ran_with[-1] if len(ran_with) > before else \
                dict(tuner.current())
            record.append((used, [a.copy() for _, a in named]))


def timed_plan(comm, plan):
    """The settings of ``plan`` a tuning times: not the ring's segment
    where MPI's Allreduce sums (one rank, MNOPT_ALLREDUCE=mpi)."""
    across = comm.inter_size if comm.name == 'hierarchical' else comm.size
    ring = across > 1 and allreduce.allreduce_algorithm() != 'mpi'
    return [(n, c) for n, c in plan if n != 'segment_bytes' or ring]


def budget_of(comm):
    """Averagings the tuning takes (one more than those timed where a
    setting is skipped: the averaging that finds it unused)."""
    plan = comm.averaging.tuner.plan
    timed = timed_plan(comm, plan)
    return tuning.REPEATS * sum(len(c) for _, c in timed) + \
        (len(plan) - len(timed))


def test_the_budget_is_at_most_20_averagings():
    assert tuning.max_steps() <= 20
    for kind, names in tuning.TUNABLE.items():
        assert tuning.REPEATS * sum(len(tuning.CANDIDATES[n])
                                    for n in names) <= 20, kind


@pytest.mark.parametrize('kind,options', [
    ('flat', {'bucket_bytes': 'auto', 'segment_bytes': 'auto'}),
    ('flat', {'segment_bytes': 'auto'}),
    ('hierarchical', {'bucket_bytes': 'auto'}),
    ('reduction_server', {'chunk_bytes': 'auto', 'window': 'auto'}),
])
def test_every_rank_makes_the_same_choice(small_candidates, monkeypatch,
                                          caplog, kind, options):
    monkeypatch.setenv('MNOPT_ALLREDUCE', 'ring')
    caplog.set_level(logging.INFO, logger='mnopt')
    comm = mnopt.create_communicator(kind, **options)
    try:
        plan = comm.averaging.tuner.plan
        budget = budget_of(comm)
        timed = timed_plan(comm, plan)
        assert [n for n, _ in plan] == [n for n in tuning.TUNABLE[kind]
                                        if n in options]
        tune(comm, budget - 1)
        assert comm.tuned_settings is None      # one averaging short
        tune(comm, 1)
        chosen = comm.tuned_settings
        assert chosen == {name: expected_choice(candidates, comm.size)
                          if (name, candidates) in timed
                          else tuning.DEFAULTS[name]
                          for name, candidates in plan}
        assert comm.averaging.tuner.steps == tuning.REPEATS * sum(
            len(c) for _, c in timed)
        # Said once, on rank 0 (logger mnopt.communicators.tuning).
        said = [r.getMessage() for r in caplog.records
                if r.name == 'mnopt.communicators.tuning']
        assert said == (['mnopt: tuned in %d averagings: %s' % (
            comm.averaging.tuner.steps, ', '.join('%s=%r' % kv for kv in sorted(
                chosen.items())))] if comm.rank == 0 else [])
        # The same on every rank, though each rank's own times would
        # have picked another (made_up_times).
        assert agreement.everyone(WORLD, chosen, 'test') == \
            [chosen] * WORLD.size
        if WORLD.size > 1:
            own = min(made_up_times(comm.rank, plan[0][1]).items(),
                      key=lambda kv: kv[1])[0]
            assert own != chosen[plan[0][0]] or comm.rank != 0
        # After it: the choice is in force, nothing more is timed.
        steps = comm.averaging.tuner.steps
        tune(comm, 3)
        assert comm.averaging.tuner.steps == steps
        for name, value in chosen.items():
            assert getattr(comm, name) == value
    finally:
        comm.finalize()


@pytest.mark.parametrize('kind,options,algorithm', [
    ('flat', {'bucket_bytes': 'auto', 'segment_bytes': 'auto'}, 'ring'),
    ('flat', {'bucket_bytes': 'auto'}, 'mpi'),
    ('hierarchical', {'bucket_bytes': 'auto', 'segment_bytes': 'auto'},
     'ring'),
    ('reduction_server', {'chunk_bytes': 'auto', 'window': 'auto'}, 'auto'),
])
def test_each_averaging_has_the_bits_of_its_fixed_settings(
        small_candidates, monkeypatch, kind, options, algorithm):
    """During the tuning and after it, every averaging equals, bit for
    bit, that of a communicator made with the settings it ran with."""
    monkeypatch.setenv('MNOPT_ALLREDUCE', algorithm)
    comm = mnopt.create_communicator(kind, **options)
    record = []
    try:
        timed = timed_plan(comm, comm.averaging.tuner.plan)
        tune(comm, budget_of(comm) + 2, record)
    finally:
        comm.finalize()
    fixed = {}
    try:
        for step, (used, result) in enumerate(record):
            key = tuple(sorted((n, used[n]) for n in options))
            if key not in fixed:
                fixed[key] = mnopt.create_communicator(kind, **dict(key))
            named = grads(step, WORLD.rank)
            fixed[key].mean_grads(named)
            for (_, want), got in zip(named, result):
                assert numpy.array_equal(want.view(numpy.uint32),
                                         got.view(numpy.uint32)), (step, key)
        # The tuning tried more than one setting of each name it timed.
        for name in [n for n, _ in timed]:
            assert len({dict(k)[name] for k in fixed}) > 1, name
    finally:
        for c in fixed.values():
            c.finalize()


@pytest.mark.parametrize('kind,options,match', [
    ('naive', {'bucket_bytes': 'auto'}, 'naive communicator tunes nothing'),
    ('naive', {'segment_bytes': 'auto'}, 'naive communicator tunes nothing'),
    ('reduction_server', {'bucket_bytes': 'auto'},
     "tunes chunk_bytes='auto' and window='auto'"),
    ('flat', {'bucket_bytes': 'auto', 'compression': 'sign'},
     "does not combine with compression='sign'"),
    ('reduction_server', {'window': 'auto', 'compression': 'sign'},
     "does not combine with compression='sign'"),
    ('flat', {'bucket_bytes': 'fast'}, "whole number >= 1 or 'auto'"),
    ('flat', {'segment_bytes': 0}, "whole number >= 1, None or 'auto'"),
    ('reduction_server', {'segment_bytes': 65536},
     'reduction_server communicator has no ring.*chunk_bytes'),
])
def test_what_cannot_be_tuned_is_refused_on_every_rank(kind, options,
                                                       match):
    with pytest.raises(ValueError, match=match):
        mnopt.create_communicator(kind, **options)


@pytest.mark.skipif(WORLD.size == 1, reason='needs two ranks')
@pytest.mark.parametrize('kind,name,fixed', [
    ('flat', 'bucket_bytes', 1 << 20),
    ('reduction_server', 'window', 6),
    ('reduction_server', 'chunk_bytes', 1 << 18),
])
def test_auto_on_some_ranks_only_is_refused_on_every_rank(kind, name,
                                                          fixed):
    value = 'auto' if WORLD.rank == 0 else fixed
    # The window is each rank's own, but which settings are tuned is not.
    with pytest.raises(ValueError, match='ranks disagree on .*(%s|tuned)'
                       % name):
        mnopt.create_communicator(kind, **{name: value})


@needs_chainer
@pytest.mark.parametrize('mode', [{'overlap': True},
                                  {'shard_state': True},
                                  {'shard_state': True, 'overlap': True}])
def test_overlap_and_shard_state_refuse_tuning_on_every_rank(mode):
    comm = mnopt.create_communicator('flat', bucket_bytes='auto')
    try:
        with pytest.raises(ValueError, match="bucket_bytes='auto' tunes"):
            mnopt.create_multi_node_optimizer(
                chainer.optimizers.MomentumSGD(), comm, **mode)
        # Numbers are taken (as the error says to pass).
        fixed = mnopt.create_communicator('flat', bucket_bytes=1 << 20)
        mnopt.create_multi_node_optimizer(
            chainer.optimizers.MomentumSGD(), fixed, **mode)
        fixed.finalize()
    finally:
        comm.finalize()


@needs_chainer
@pytest.mark.parametrize('double_buffering', [False, True])
def test_training_with_tuning_ends_alike_on_every_rank(
        small_candidates, double_buffering):
    """The optimizer path (double buffering: timed in the background):
    the tuning finishes within its budget, every rank holds the same
    choice and the same parameters."""
    comm = mnopt.create_communicator('flat', bucket_bytes='auto',
                                     segment_bytes='auto')
    try:
        link = chainer.Link()
        with link.init_scope():
            for i, s in enumerate(SHAPES):
                setattr(link, 'p%d' % i, chainer.Parameter(
                    numpy.zeros(s, numpy.float32)))
        optimizer = mnopt.create_multi_node_optimizer(
            chainer.optimizers.MomentumSGD(lr=0.01), comm,
            double_buffering=double_buffering)
        optimizer.setup(link)
        budget = tuning.REPEATS * sum(
            len(c) for _, c in comm.averaging.tuner.plan)
        for step in range(budget + 3):
            for (_, g), p in zip(grads(step, comm.rank),
                                 [p for _, p in sorted(link.namedparams())]):
                p.grad = g.reshape(p.shape)
            optimizer.update()
        if double_buffering:
            optimizer.wait()
        chosen = comm.tuned_settings
        assert chosen is not None and set(chosen) == {'bucket_bytes',
                                                      'segment_bytes'}
        said = agreement.everyone(
            WORLD, (chosen, [p.array.tobytes() for _, p in
                             sorted(link.namedparams())]), 'test')
        assert all(s == said[0] for s in said)
    finally:
        comm.finalize()


@pytest.mark.parametrize('late', ['caller', 'background'])
def test_each_group_tunes_on_its_own_whoever_comes_first(
        small_candidates, monkeypatch, late):
    """A background averaging and one in the caller at once (a
    double-buffered model beside a plain one): each group tunes on its
    own averagings and exchanges over its own communicator, so the ranks
    agree whichever thread comes first on each (a rank's caller or its
    background late by turns); both finish, with the same choice on every
    rank, and the communicator reports the caller's."""
    import time
    monkeypatch.setenv('MNOPT_ALLREDUCE', 'ring')
    comm = mnopt.create_communicator('flat', bucket_bytes='auto',
                                     segment_bytes='auto', timeout=60)
    try:
        tuner = comm.averaging.tuner
        times = {name: made_up_times(comm.rank, candidates)
                 for name, candidates in tuner.plan}
        tuner.measure = lambda seconds, name, value: times[name][value]
        budget = budget_of(comm)
        odd = comm.rank % 2 == 1
        for step in range(budget):
            named = grads(step, comm.rank)
            if (late == 'caller') == odd:
                handle = comm.mean_grads_async(named)
                time.sleep(0.01)
                comm.mean_grads(named[:2])    # another set, in the caller
            else:
                named_async = named
                time.sleep(0.01)
                handle = comm.mean_grads_async(named_async)
                comm.mean_grads(named[:2])
            handle.wait()
        searches = tuner._searches
        assert set(searches) == {'sync', 'async'}
        results = {g: searches[g].result for g in searches}
        assert all(r is not None for r in results.values()), results
        assert comm.tuned_settings == results['sync']
        said = agreement.everyone(WORLD, results, 'test')
        assert said == [results] * WORLD.size
    finally:
        comm.finalize()


def test_a_set_that_never_comes_back_gives_way(small_candidates,
                                               monkeypatch):
    """The first gradient set averaged (one array short: a parameter
    without a gradient yet) never comes back: after REKEY_AFTER
    averagings of the other set, the tuning times that one and ends."""
    monkeypatch.setenv('MNOPT_ALLREDUCE', 'ring')
    comm = mnopt.create_communicator('flat', bucket_bytes='auto')
    try:
        comm.mean_grads(grads(0, comm.rank)[:-1])
        budget = budget_of(comm)
        for step in range(tuning.REKEY_AFTER + budget):
            assert comm.tuned_settings is None, step
            comm.mean_grads(grads(step, comm.rank))
        assert comm.tuned_settings is not None
    finally:
        comm.finalize()


@pytest.mark.skipif(WORLD.size == 1, reason='needs two ranks')
def test_a_failed_first_averaging_keys_nothing(small_candidates,
                                               monkeypatch):
    """A layout mismatch at the first averaging (every rank raises) must
    not leave a rank keyed on its own set: the tuning then runs alike."""
    monkeypatch.setenv('MNOPT_ALLREDUCE', 'ring')
    comm = mnopt.create_communicator('flat', bucket_bytes='auto')
    try:
        named = grads(0, comm.rank)
        with pytest.raises(Exception, match='[Ll]ayout|shape|differ'):
            comm.mean_grads(named[:-1] if comm.rank == 1 else named)
        budget = budget_of(comm)
        for step in range(budget):
            comm.mean_grads(grads(step, comm.rank))
        chosen = comm.tuned_settings
        assert chosen is not None
        assert agreement.everyone(WORLD, chosen, 'test') == \
            [chosen] * WORLD.size
    finally:
        comm.finalize()


@pytest.mark.parametrize('kind,options', [
    ('flat', {'bucket_bytes': 'auto', 'segment_bytes': 'auto'}),
    ('reduction_server', {'chunk_bytes': 'auto', 'window': 'auto'}),
])
def test_alone_there_is_nothing_to_time(kind, options):
    """A communicator of one rank (a split of one) does not average: its
    tuned_settings are the first candidates at once, not None forever."""
    comm = mnopt.create_communicator(kind, **options)
    try:
        one = comm.split(comm.rank, 0)
        assert one.size == 1
        want = {n: tuning.CANDIDATES[n][0] for n in options}
        assert one.tuned_settings == want
        one.mean_grads(grads(0, comm.rank))
        assert one.tuned_settings == want
        one.finalize()
    finally:
        comm.finalize()
