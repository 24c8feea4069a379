"""python -m mnopt.check: a launch described, and its problems found."""

import pytest

from conftest import run_mpi
from mnopt import check

ROW = {'host': 'a', 'python': '3.11.7', 'numpy': '2.4.6', 'mpi4py': '4.1.2',
       'mpi': 'MPICH Version: 5.0.2', 'chainer': '7.8.1', 'cupy': None,
       'nccl': None, 'gpus': 0}


def test_agreeing_ranks_have_no_problems():
    rows = [(r, r % 2, 2, r // 2, dict(ROW)) for r in range(4)]
    assert check.problems(rows) == []


def test_version_disagreement_is_a_problem():
    rows = [(r, 0, 1, r, dict(ROW)) for r in range(3)]
    rows[2][4]['numpy'] = '1.26.4'
    assert check.problems(rows) == [
        'ranks disagree on numpy: 2.4.6 on ranks [0, 1]; 1.26.4 on ranks [2]']


def test_more_ranks_than_gpus_is_a_problem():
    rows = [(r, r, 4, 0, dict(ROW, gpus=2, host='gpu1')) for r in range(4)]
    assert check.problems(rows) == [
        'node 0 (gpu1) runs 4 ranks but sees 2 GPU(s): one process per GPU '
        'for pure_nccl']


@pytest.mark.spawn
@pytest.mark.every_stack  # reports the MPI library's versions
def test_check_runs_under_mpiexec():
    proc = run_mpi(2, 'import runpy\nrunpy.run_module("mnopt.check", '
                      'run_name="__main__")\n', timeout=60,
                   env={'MNOPT_RANKS_PER_NODE': '1'})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'mnopt check: 2 ranks on 2 nodes' in proc.stdout
    assert 'averaging     flat, mean of 2 ranks ok' in proc.stdout
    assert proc.stdout.rstrip().endswith('mnopt check: OK')
