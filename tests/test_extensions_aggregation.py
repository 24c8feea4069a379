"""ObservationAggregator keeps the reported type (a Variable stays a
Variable) and runs the aggregator once, on rank 0; the early stopping
trigger takes Chainer's arguments.  Serially and under mpiexec -n 2 / -n 3."""

import types

import numpy
import pytest

from conftest import naive_comm as comm  # NOQA: the comm fixture
from conftest import chainer, needs_chainer

pytestmark = needs_chainer

import mnopt  # NOQA


def trainer_at(iteration):
    return types.SimpleNamespace(observation={}, updater=types.SimpleNamespace(
        iteration=iteration, epoch=0, epoch_detail=iteration / 100.0,
        previous_epoch_detail=None, is_new_epoch=False))


def test_a_variable_stays_a_variable(comm):
    agg = mnopt.extensions.ObservationAggregator(comm, 'rank', 'mean')
    trainer = trainer_at(1)
    trainer.observation['rank'] = chainer.Variable(
        numpy.asarray(comm.rank, numpy.float32))
    agg(trainer)
    mean = trainer.observation['mean']
    assert isinstance(mean, chainer.Variable)
    assert float(mean.array) == (comm.size - 1) / 2.0


def test_the_aggregator_runs_once_on_rank_0_and_every_rank_gets_it(comm):
    calls = []

    def aggregator(histories):
        calls.append(histories)
        return [sum(h) for h in histories]
    agg = mnopt.extensions.ObservationAggregator(
        comm, 'x', comm_trigger=(2, 'iteration'), aggregator=aggregator)
    for i in (1, 2):
        trainer = trainer_at(i)
        trainer.observation['x'] = comm.rank * 10 + i
        agg(trainer)
    assert trainer.observation['x'] == [r * 20 + 3 for r in range(comm.size)]
    assert len(calls) == (1 if comm.rank == 0 else 0)


def test_a_failing_aggregator_is_an_error_on_every_rank(comm):
    agg = mnopt.extensions.ObservationAggregator(
        comm, 'x', aggregator=lambda h: 1 / 0)
    trainer = trainer_at(1)
    trainer.observation['x'] = 1.0
    with pytest.raises(ValueError, match='ZeroDivisionError'):
        agg(trainer)


def test_early_stopping_takes_chainers_patients_alias(comm):
    trig = mnopt.extensions.MultiNodeEarlyStoppingTrigger(
        comm, check_trigger=(1, 'iteration'), patients=1,
        max_trigger=(100, 'iteration'))
    stops = []
    for i, loss in enumerate([3.0, 2.0, 2.5, 2.6], 1):
        trainer = trainer_at(i)
        trainer.observation['main/loss'] = loss + comm.rank
        stops.append(trig(trainer))
    assert stops == [False, False, True, True]
