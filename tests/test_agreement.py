"""mnopt/transport/agreement.py: every rank sees what every rank said,
and decides alike.  Runs serially and under mpiexec -n 2 / -n 3 (the rank-dependent
answers are checked against what they must be), plus one spawned job."""

import time

import pytest
from mpi4py import MPI

from conftest import run_mpi, slack

import mnopt
from mnopt.transport import agreement

# Also under mpiexec -n 3: a middle rank (neither first nor last) disagrees.
pytestmark = pytest.mark.many_ranks

WORLD = MPI.COMM_WORLD


@pytest.fixture
def comm():
    c = mnopt.create_communicator('flat')
    yield c
    c.finalize()


def test_everyone_lists_every_ranks_value_in_rank_order(comm):
    said = comm.everyone({'rank': comm.rank, 'name': 'r%d' % comm.rank},
                         'a test')
    assert said == [{'rank': r, 'name': 'r%d' % r} for r in range(comm.size)]


def test_common_is_what_every_rank_holds(comm):
    # Rank r holds 0..4 and 10 + r: only 0..4 are everyone's (at N=1 the
    # rank's own too).
    held = comm.common(list(range(5)) + [10 + comm.rank], 'files')
    assert held == list(range(5)) + ([10] if comm.size == 1 else [])


def test_same_names_the_setting_and_every_ranks_value(comm):
    assert comm.same({'a': 1}, 'settings') == {'a': 1}
    if comm.size == 1:
        return
    with pytest.raises(ValueError) as e:
        comm.same({'a': 1, 'b': comm.rank}, 'the settings')
    assert str(e.value) == 'ranks disagree on the settings: b (%s)' % (
        ', '.join('rank %d: %d' % (r, r) for r in range(comm.size)))


def test_raise_together_raises_on_every_rank(comm):
    comm.raise_together(None, 'nothing')   # no problem anywhere: no error
    last = comm.size - 1
    problem = ValueError('bad value') if comm.rank == last else None
    if comm.rank == last:
        with pytest.raises(ValueError, match='bad value'):
            comm.raise_together(problem, 'a step')
    else:
        with pytest.raises(RuntimeError) as e:
            comm.raise_together(problem, 'a step')
        assert str(e.value) == ('a step failed on rank %d: ValueError: bad '
                                'value' % last)


def test_a_value_that_does_not_pickle_on_one_rank_fails_on_every_rank(comm):
    # Not a wait for the timeout on the ranks whose value pickled.
    last = comm.size - 1
    value = (lambda: 1) if comm.rank == last else 1.0
    start = time.monotonic()
    with pytest.raises(Exception) as e:
        comm.everyone(value, 'a test')
    if comm.rank != last:
        assert isinstance(e.value, RuntimeError)
        assert str(e.value) == ('a test: the value of rank(s) %d could not '
                                'be pickled' % last)
    assert time.monotonic() - start < slack(20)
    # The next exchange still lines up.
    assert comm.everyone(comm.rank, 'after') == list(range(comm.size))


def test_ranks_in_different_exchanges_fail_on_every_rank(comm):
    """The last rank is in another exchange (its own trigger fired, say):
    every rank raises, naming each rank's exchange, instead of taking the
    other exchange's values for its own.  Alone, the names agree."""
    last = comm.size - 1
    what = 'the report' if comm.rank == last else "the optimizer's step"
    if comm.size == 1:
        assert comm.everyone(7, what) == [7]
        return
    with pytest.raises(RuntimeError) as error:
        comm.everyone((comm.rank, 'payload'), what)
    message = str(error.value)
    assert 'different exchanges' in message
    for r in range(comm.size):
        name = 'the report' if r == last else "the optimizer's step"
        assert 'rank %d in %r' % (r, name) in message, message
    # Out of step no longer: the next exchange, the same on every rank,
    # goes through.
    assert comm.everyone(comm.rank, 'after') == list(range(comm.size))


def test_disagreement_reads_settings_one_rank_lacks():
    assert agreement.disagreement([{'a': 1}, {'a': 1}], 'x') is None
    assert agreement.disagreement([{'a': 1}, {}], 'x') == \
        'ranks disagree on x: a (rank 0: 1, rank 1: not set)'


EXITS_EARLY = r'''
import time
import mnopt
comm = mnopt.create_communicator('flat', stall_warning=300, timeout=600)
if comm.rank == 0:
    time.sleep(0.5)
    comm.everyone(1, 'the last evaluation')
'''


@pytest.mark.spawn
def test_an_agreement_with_a_rank_that_exited_ends_the_job_at_once():
    # Watched like every collective: the rank that ended its script said
    # so, and the one waiting aborts at once instead of at the timeout.
    start = time.monotonic()
    proc = run_mpi(2, EXITS_EARLY, timeout=120)
    assert proc.returncode != 0
    assert 'agreement #1; rank 1' in proc.stderr, proc.stderr[-2000:]
    assert 'so it cannot finish. Aborting the MPI job.' in proc.stderr
    assert time.monotonic() - start < slack(40)
