"""GenericMultiNodeEvaluator as ChainerMN's: the target by default, every
rank's results on root round by round, errors on every rank.  Serially and
under mpiexec -n 2 / -n 3."""

import numpy
import pytest

from conftest import naive_comm as comm  # NOQA: the comm fixture
from conftest import chainer, needs_chainer

pytestmark = needs_chainer

import mnopt  # NOQA


def rank_iterator(comm, n_batches, batch_size=2):
    """Rank r's examples are r * 100 + k, k < n_batches * batch_size."""
    x = numpy.arange(n_batches * batch_size, dtype=numpy.float32) \
        + 100 * comm.rank
    return chainer.iterators.SerialIterator(x, batch_size, repeat=False,
                                            shuffle=False)


def test_defaults_call_the_target_and_list_results_round_by_round(comm):
    # Rank r has r + 1 batches: round i holds the ranks that have one.
    it = rank_iterator(comm, comm.rank + 1)
    ev = mnopt.extensions.GenericMultiNodeEvaluator(
        comm, it, lambda x: float(x.sum()), root=comm.size - 1)
    results = ev(None)
    if comm.rank != comm.size - 1:
        assert results is None
        return
    expected = [100 * r * 2 + 4 * i + 1
                for i in range(comm.size) for r in range(comm.size)
                if i < r + 1]
    assert results == expected


def test_none_results_are_left_out(comm):
    ev = mnopt.extensions.GenericMultiNodeEvaluator(
        comm, rank_iterator(comm, 2), lambda x: None)
    assert ev(None) == ([] if comm.rank == 0 else None)


def test_an_error_on_one_rank_is_raised_on_every_rank(comm):
    last = comm.size - 1

    def target(x):
        if comm.rank == last:
            raise ArithmeticError('bad batch')
        return 1
    ev = mnopt.extensions.GenericMultiNodeEvaluator(
        comm, rank_iterator(comm, 1), target)
    if comm.rank == last:
        with pytest.raises(ArithmeticError, match='bad batch'):
            ev(None)
    else:
        with pytest.raises(RuntimeError, match='rank %d: ArithmeticError: '
                                               'bad batch' % last):
            ev(None)


def test_a_root_outside_the_communicator_is_a_value_error(comm):
    with pytest.raises(ValueError, match='not a rank'):
        mnopt.extensions.GenericMultiNodeEvaluator(
            comm, rank_iterator(comm, 1), None, root=comm.size)
