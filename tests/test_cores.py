"""Each rank's share of the node's cores for NumPy's BLAS threads
(mnopt/common/cores.py).  Runs serially and under mpiexec -n 2/3."""

import os

import pytest
from mpi4py import MPI

import mnopt
from mnopt.common import cores
from mnopt import netsim
from mnopt.transport import buffers

threadpoolctl = pytest.importorskip('threadpoolctl')


def blas_threads():
    return [p['num_threads'] for p in threadpoolctl.threadpool_info()
            if p.get('user_api') == 'blas']


@pytest.fixture
def restored_blas_threads():
    """Put the process's BLAS threads back as they were."""
    before = blas_threads()
    yield
    if before:
        threadpoolctl.threadpool_limits(limits=max(before), user_api='blas')


@pytest.fixture
def no_user_setting(monkeypatch):
    for name in cores.USER_SETTINGS + ('MNOPT_BLAS_THREADS',):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize('ranks, usable, machine, expected', [
    (1, 2, 2, 2), (2, 2, 2, 1), (3, 2, 2, 1), (2, 16, 16, 8),
    (3, 16, 16, 5),
    # bound by the launcher to fewer cores than the machine has: those
    (4, 4, 16, 4), (8, 1, 16, 1)])
def test_share(ranks, usable, machine, expected):
    assert cores.share(ranks, usable, machine) == expected


def test_a_communicator_gives_each_rank_its_share(no_user_setting,
                                                   restored_blas_threads):
    if not blas_threads():
        pytest.skip('NumPy runs on no BLAS that threadpoolctl knows')
    comm = mnopt.create_communicator('flat')
    try:
        share = cores.share(buffers.ranks_on_node(MPI.COMM_WORLD))
        assert max(blas_threads()) <= share
    finally:
        comm.finalize()


@pytest.mark.parametrize('name', cores.USER_SETTINGS)
def test_the_users_setting_stands(monkeypatch, no_user_setting,
                                  restored_blas_threads, name):
    monkeypatch.setenv(name, '1')
    before = blas_threads()
    assert cores.limit_blas_threads(64) is None
    assert blas_threads() == before


def test_mnopt_blas_threads_sets_the_number(monkeypatch, no_user_setting,
                                            restored_blas_threads):
    if not blas_threads():
        pytest.skip('NumPy runs on no BLAS that threadpoolctl knows')
    monkeypatch.setenv('MNOPT_BLAS_THREADS', '1')
    assert cores.limit_blas_threads(1) == 1
    assert blas_threads() == [1] * len(blas_threads())
    monkeypatch.setenv('MNOPT_BLAS_THREADS', '0')
    threadpoolctl.threadpool_limits(limits=2, user_api='blas')
    assert cores.limit_blas_threads(64) is None   # 0: the library's own


def test_a_bad_setting_is_an_error(monkeypatch, no_user_setting):
    monkeypatch.setenv('MNOPT_BLAS_THREADS', 'two')
    with pytest.raises(ValueError, match='MNOPT_BLAS_THREADS'):
        cores.limit_blas_threads(1)


def test_netsim_shares_the_machines_cores(no_user_setting, monkeypatch):
    # Its nodes have their own hostnames, so MPI sees one rank per node;
    # netsim passes the share of the processes on this machine.
    assert netsim.blas_threads_env(4) == [
        ('MNOPT_BLAS_THREADS', str(cores.share(4)))]
    monkeypatch.setenv('OMP_NUM_THREADS', '3')
    assert netsim.blas_threads_env(4) == []


def test_a_limit_the_script_set_stands(no_user_setting,
                                        restored_blas_threads):
    if not blas_threads():
        pytest.skip('NumPy runs on no BLAS that threadpoolctl knows')
    # Neither the library's default (a thread per usable core) nor a
    # share mnopt would set: the script's own choice.
    mine = cores.usable_cores() + 1
    threadpoolctl.threadpool_limits(limits=mine, user_api='blas')
    assert cores.limit_blas_threads(64) is None
    comm = mnopt.create_communicator('flat')
    try:
        assert blas_threads() == [mine] * len(blas_threads())
    finally:
        comm.finalize()
