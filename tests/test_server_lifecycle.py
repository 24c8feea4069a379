"""The reduction server's start-up, idle time and exit, as whole jobs
(``mpiexec -n W python worker.py : -n S python -m mnopt.server``, and
colocated): a process that never arrives ends the job at the timeout, a
bad setting ends it at once, a worker that finishes early is not a
stall, and means that fit the wire come out finite."""

import os
import sys
import time

import pytest

from conftest import mpiexec, python_path, run_job as run_launcher, slack
from test_reduction_server import run_job

pytestmark = pytest.mark.spawn

SHORT = {'MNOPT_STALL_WARNING': '2', 'MNOPT_TIMEOUT': '4'}


def _job(monkeypatch, env, code, workers=2, servers=1, timeout=90,
         server_code=None):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    start = time.time()
    proc = run_job(workers, servers, worker_code=code, timeout=timeout,
                   worker_args=[], server_code=server_code)
    return proc, time.time() - start


# MPI started (as by any import of mnopt), but no communicator.  A worker
# that never starts MPI at all leaves the servers in MPI_Init, before any
# of mnopt's code can run.
NO_COMMUNICATOR = '''
from mpi4py import MPI
print('worker done without a communicator')
'''


def test_servers_end_when_workers_never_create_a_communicator(monkeypatch):
    proc, elapsed = _job(monkeypatch, SHORT, NO_COMMUNICATOR)
    assert proc.returncode != 0
    assert proc.stdout.count('worker done') == 2
    # The servers report their wait at the warning time, then abort.
    assert 'has waited' in proc.stderr and 'in the job start-up' \
        in proc.stderr, proc.stderr[-3000:]
    assert 'Timeout (4 s, MNOPT_TIMEOUT): aborting the MPI job' \
        in proc.stderr
    assert elapsed < 4 + slack(40)


ONE_WORKER_FAILS_FIRST = '''
import sys, mnopt
from mpi4py import MPI
if MPI.COMM_WORLD.rank == 1:
    sys.exit(0)    # gone before create_communicator, without an error
mnopt.create_communicator('reduction_server')
print('should never get here')
'''


def test_a_worker_gone_before_create_communicator_ends_the_job(
        monkeypatch):
    proc, elapsed = _job(monkeypatch, SHORT, ONE_WORKER_FAILS_FIRST)
    assert proc.returncode != 0
    assert 'should never get here' not in proc.stdout
    assert 'Timeout (4 s, MNOPT_TIMEOUT): aborting the MPI job' \
        in proc.stderr, proc.stderr[-3000:]
    assert elapsed < 4 + slack(40)


AVERAGE_ONCE = '''
import numpy, mnopt
comm = mnopt.create_communicator('reduction_server')
grads = [('w', numpy.full(10, comm.rank, numpy.float32))]
comm.mean_grads(grads)
print('averaged')
'''


@pytest.mark.parametrize('where', ['everywhere', 'one worker', 'servers'])
def test_a_bad_timeout_setting_ends_the_job_with_a_message(where,
                                                           monkeypatch):
    code = AVERAGE_ONCE
    server_code = None
    bad = "os.environ['MNOPT_TIMEOUT'] = 'abc'\n"
    if where == 'everywhere':
        monkeypatch.setenv('MNOPT_TIMEOUT', 'abc')
    elif where == 'one worker':
        code = ('import os\nfrom mpi4py import MPI\nif MPI.COMM_WORLD.rank '
                '== 1:\n    ' + bad + code)
    else:
        server_code = 'import os\n' + bad + \
            'from mnopt import server\nserver.main()\n'
    monkeypatch.setenv('MNOPT_STALL_WARNING', '2')
    start = time.time()
    proc = run_job(2, 1, worker_code=code, timeout=90, worker_args=[],
                   server_code=server_code)
    assert proc.returncode != 0
    assert 'averaged' not in proc.stdout
    assert "MNOPT_TIMEOUT='abc': a number of seconds" in proc.stderr, \
        proc.stderr[-3000:]
    assert time.time() - start < 40


EARLY_FINISH = '''
import sys, time, numpy, mnopt
comm = mnopt.create_communicator('reduction_server')
grads = [('w', numpy.full(1000, comm.rank, numpy.float32))]
comm.mean_grads(grads)
comm.mean_grads_async(grads).wait()
if comm.rank == 1:
    time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 5)
print('worker %d done' % comm.rank)
'''


@pytest.mark.parametrize('servers', [1, 0])
def test_a_worker_finishing_early_is_not_a_stall(servers, monkeypatch):
    """Worker 0 says goodbye 5 s before worker 1: the servers (and worker
    0's colocated server threads) wait idle, past the warning time and
    the timeout, without a report.  (A shorter warning time could fire
    in the job's start-up on a busy machine.)"""
    proc, _ = _job(monkeypatch, {'MNOPT_STALL_WARNING': '2',
                                 'MNOPT_TIMEOUT': '3'}, EARLY_FINISH,
                   servers=servers)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('done') == 2
    assert 'has waited' not in proc.stderr, proc.stderr[-3000:]


FITS_IN_FLOAT16 = '''
import numpy, mnopt
comm = mnopt.create_communicator('reduction_server',
                                 allreduce_grad_dtype='float16',
                                 on_overflow='error')
for pair in ((70000.0, 0.0), (100000.0, 0.0), (70000.0, 50000.0)):
    g = [('w', numpy.full(9, pair[comm.rank], numpy.float32))]
    comm.mean_grads(g)
    assert numpy.isfinite(g[0][1]).all(), (pair, g)
    numpy.testing.assert_allclose(g[0][1], sum(pair) / 2, rtol=1e-3)
comm = mnopt.create_communicator('reduction_server',
                                 allreduce_grad_dtype='float32')
g = [('w', numpy.full(9, 3.4e38, numpy.float32))]
comm.mean_grads(g)
assert numpy.isfinite(g[0][1]).all(), g
print('finite on worker %d' % comm.rank)
'''


def test_means_that_fit_are_finite_with_server_processes(monkeypatch):
    proc, _ = _job(monkeypatch, {}, FITS_IN_FLOAT16, servers=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('finite on worker') == 2


TWO_IN_THE_BACKGROUND = '''
import numpy, mnopt
a = mnopt.create_communicator('reduction_server')
b = mnopt.create_communicator('reduction_server')
grads = [('w', numpy.full(100, a.rank, numpy.float32))]
a.mean_grads_async(grads).wait()
b.mean_grads(grads)   # synchronous: fine
try:
    b.mean_grads_async(grads)
except RuntimeError as e:
    print('worker %d refused: %s' % (a.rank, e))
a.finalize()
b.mean_grads_async(grads).wait()   # a is done: b may now
assert (grads[0][1] == 0.5).all(), grads
print('worker %d ok' % a.rank)
'''


def test_two_communicators_never_interleave_in_the_background(
        monkeypatch):
    proc, _ = _job(monkeypatch, SHORT, TWO_IN_THE_BACKGROUND)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for w in (0, 1):
        assert 'worker %d refused: with reduction servers, one ' \
            'reduction_server communicator per process averages in the ' \
            'background at a time' % w in proc.stdout, proc.stdout
        assert 'worker %d ok' % w in proc.stdout


MPMD_SCRIPT = '''
import os, mnopt
comm = mnopt.create_communicator('flat')
print('rank %d of %d, BLAS threads %s' % (
    comm.rank, comm.size, os.environ['MNOPT_BLAS_THREADS']), flush=True)
'''


@pytest.mark.every_mpi
def test_an_mpmd_launch_of_one_script_has_no_servers(tmp_path):
    # The usual way to give ranks their own environments: each command of
    # the launch runs the training script, so none is a reduction server.
    script = tmp_path / 'train.py'
    script.write_text(MPMD_SCRIPT)
    cmd = []
    for threads in ('1', '2'):
        cmd += [':'] if cmd else []
        cmd += ['-n', '1', 'env', 'MNOPT_BLAS_THREADS=' + threads,
                sys.executable, '-m', 'mpi4py', str(script)]
    proc = run_launcher(mpiexec() + cmd, 90,
                        dict(os.environ, PYTHONPATH=python_path()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'rank 0 of 2, BLAS threads 1' in proc.stdout
    assert 'rank 1 of 2, BLAS threads 2' in proc.stdout


def test_servers_launched_before_the_workers_are_an_error_everywhere(
        tmp_path):
    script = tmp_path / 'train.py'
    script.write_text("import mnopt\nmnopt.create_communicator("
                      "'reduction_server')\n")
    cmd = mpiexec() + ['-n', '1', sys.executable, '-m', 'mpi4py', '-m',
                       'mnopt.server', ':', '-n', '2', sys.executable,
                       '-m', 'mpi4py', str(script)]
    proc = run_launcher(cmd, 90, dict(os.environ, PYTHONPATH=python_path()))
    assert proc.returncode != 0
    assert 'reduction servers must come after the workers in the job ' \
        '(servers at ranks [0], workers at [1, 2])' in proc.stderr, \
        proc.stderr[-3000:]


def test_a_bad_server_option_ends_the_job(tmp_path):
    # Launched without ``-m mpi4py``: argparse's exit is no exception any
    # hook sees, so the server must end the job itself, or the workers
    # wait in the start-up for their timeout.
    script = tmp_path / 'train.py'
    script.write_text("import mnopt\nmnopt.create_communicator("
                      "'reduction_server')\n")
    start = time.time()
    cmd = mpiexec() + ['-n', '1', sys.executable, str(script), ':', '-n',
                       '1', sys.executable, '-m', 'mnopt.server',
                       '--memory', '0']
    proc = run_launcher(cmd, 90, dict(os.environ, PYTHONPATH=python_path(),
                                      MNOPT_TIMEOUT='600'))
    assert proc.returncode != 0
    assert "argument --memory: '0' is not an integer > 0" in proc.stderr
    assert 'a bad command line for python -m mnopt.server' in proc.stderr, \
        proc.stderr[-3000:]
    assert time.time() - start < slack(40)
