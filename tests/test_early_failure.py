"""A rank that fails early, or is interrupted while a peer is late, ends
the job within seconds, with its traceback once: before MPI has started
(``import mnopt`` installs the abort hook in a launched process), before
its first create_communicator, in a reduction server's wrapper, at the
first background averaging's set-up and in ``split``.  Every job is a
plain ``python script.py`` (``python -m mpi4py`` aborts by itself) with
MNOPT_TIMEOUT far above the bound asserted: the stall timeout is not what
ends it."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, mpiexec, python_path, run_job, run_mpi, slack

pytestmark = pytest.mark.spawn

#: Far above every bound asserted below.
PATIENT = {'MNOPT_STALL_WARNING': '250', 'MNOPT_TIMEOUT': '300'}
MESSAGE = 'a data set is missing on rank 1'

RANK_1_FAILS = r'''
import os, sys, time
import mnopt
rank = int(os.environ.get('PMI_RANK') or os.environ['OMPI_COMM_WORLD_RANK'])
if rank == 1:
    if sys.argv[1] == 'after-mpi':
        from mpi4py import MPI
    raise RuntimeError(%r)
if sys.argv[1] == 'peer-busy':
    time.sleep(200)          # still loading when rank 1 fails
mnopt.create_communicator('flat')
print('rank 0 should never get past create_communicator')
''' % MESSAGE


@pytest.mark.parametrize('when', ['before-mpi', 'after-mpi', 'peer-busy'])
def test_a_rank_failing_before_create_communicator_ends_the_job(when):
    start = time.monotonic()
    proc = run_mpi(2, RANK_1_FAILS, timeout=120, args=[when], env=PATIENT,
                   module_runner=False)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert proc.stderr.count('RuntimeError: ' + MESSAGE) == 1, proc.stderr
    assert 'mnopt: uncaught exception on rank 1' in proc.stderr
    assert 'should never get' not in proc.stdout
    # 'peer-busy': MPI cannot start while rank 0 sleeps; rank 1 gives it
    # START_MPI_SECONDS (10 s), then ends by a signal.
    assert elapsed < slack(40), elapsed


def test_the_hook_is_installed_only_in_a_launched_process(tmp_path):
    check = (
        'import multiprocessing as mp, sys\n'
        'def child(queue):\n'
        '    import mnopt\n'
        '    queue.put(sys.excepthook is sys.__excepthook__)\n'
        'if __name__ == "__main__":\n'
        '    import mnopt\n'
        '    print("parent", sys.excepthook is sys.__excepthook__)\n'
        '    print("mpi started", "mpi4py.MPI" in sys.modules)\n'
        '    ctx = mp.get_context("spawn")\n'
        '    queue = ctx.Queue()\n'
        '    p = ctx.Process(target=child, args=(queue,))\n'
        '    p.start()\n'
        '    print("child", queue.get(timeout=120))\n'
        '    p.join()\n')
    script = tmp_path / 'check.py'
    script.write_text(check)

    def run(**variables):
        env = {k: v for k, v in os.environ.items()
               if k not in ('PMI_SIZE', 'OMPI_COMM_WORLD_SIZE', 'SLURM_NTASKS',
                            'SLURM_NPROCS', 'MV2_COMM_WORLD_SIZE')}
        env.update(variables, PYTHONPATH=python_path())
        return subprocess.run([sys.executable, str(script)], env=env,
                              capture_output=True, text=True, cwd=REPO,
                              timeout=slack(120)).stdout

    launched = run(PMI_SIZE='2')
    # Installed (sys.excepthook replaced), MPI not started, and not in a
    # process that multiprocessing started with the same environment.
    assert 'parent False' in launched and 'child True' in launched, launched
    assert 'mpi started False' in launched
    assert 'parent True' in run(PMI_SIZE='1')
    assert 'parent True' in run()


def test_abort_on_exception_false_removes_the_hook_import_installed():
    code = ('import sys, mnopt\n'
            'print("installed", sys.excepthook is not sys.__excepthook__)\n'
            'mnopt.create_communicator("flat", abort_on_exception=False)\n'
            'print("kept", sys.excepthook is not sys.__excepthook__)\n')
    # One process whose environment says it is one of two: MPI starts
    # alone (with a warning), which this check does not mind.
    out = subprocess.run(
        [sys.executable, '-c', code], capture_output=True, text=True,
        cwd=REPO, timeout=slack(120),
        env=dict(os.environ, PMI_SIZE='2', PYTHONPATH=python_path())).stdout
    assert 'installed True' in out and 'kept False' in out, out


WORKER = r'''
import mnopt
mnopt.create_communicator('reduction_server')
print('the worker should never get past create_communicator')
'''

SERVER_WRAPPER = r'''
import mnopt.server
raise RuntimeError('the server wrapper failed')
mnopt.server.main()
'''


def test_a_server_wrapper_that_fails_before_main_ends_the_job(tmp_path):
    worker, wrapper = tmp_path / 'worker.py', tmp_path / 'wrapper.py'
    worker.write_text(WORKER)
    wrapper.write_text(SERVER_WRAPPER)
    start = time.monotonic()
    proc = run_job(mpiexec() + ['-n', '2', sys.executable, str(worker), ':',
                                '-n', '1', sys.executable, str(wrapper)],
                   120, dict(os.environ, PYTHONPATH=python_path(), **PATIENT))
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert proc.stderr.count('RuntimeError: the server wrapper failed') == 1, \
        proc.stderr
    assert 'should never get' not in proc.stdout
    assert elapsed < slack(40), elapsed


def test_servers_alone_are_told_there_are_no_workers():
    proc = run_job(mpiexec() + ['-n', '2', sys.executable, '-m',
                                'mnopt.server'], 60,
                   dict(os.environ, PYTHONPATH=python_path()))
    assert proc.returncode != 0
    assert proc.stderr.count('error: no workers') == 1, proc.stderr
    assert 'python train.py : -n S python -m mnopt.server' in proc.stderr


# --------------------------------------------- Ctrl-C while a peer is late
# Rank 0 enters the operation at once; rank 1 arrives 200 s later.  Rank
# 0 says where it waits (its own stall warning at 1 s) by writing its pid,
# and the test then interrupts it.
LATE_PEER = r'''
import logging, os, sys, time
import numpy
import mnopt
comm = mnopt.create_communicator('flat')
op, marker = sys.argv[1], sys.argv[2]


class SayWhereIWait(logging.Handler):
    def emit(self, record):
        if op in record.getMessage() and not os.path.exists(marker):
            with open(marker + '.tmp', 'w') as f:
                f.write(str(os.getpid()))
            os.rename(marker + '.tmp', marker)


logging.getLogger('mnopt.stall').addHandler(SayWhereIWait())
if comm.rank == 1:
    time.sleep(200)
if op == 'mean_grads_async':
    comm.mean_grads_async([('w', numpy.ones(1000, numpy.float32))]).wait()
else:
    comm.split(0, comm.rank)
print('rank %d should never get past %s' % (comm.rank, op))
'''


@pytest.mark.parametrize('op', ['mean_grads_async', 'split'])
def test_ctrl_c_while_a_peer_is_late_ends_the_job(tmp_path, op):
    script, marker = tmp_path / 'late_peer.py', tmp_path / 'waiting'
    script.write_text(LATE_PEER)
    env = dict(os.environ, PYTHONPATH=python_path(), **dict(
        PATIENT, MNOPT_STALL_WARNING='1'))
    job = subprocess.Popen(
        mpiexec() + ['-n', '2', sys.executable, str(script), op,
                     str(marker)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
        start_new_session=True)
    try:
        deadline = time.monotonic() + slack(90)
        while not marker.exists():
            assert job.poll() is None and time.monotonic() < deadline, \
                'rank 0 never said it waits in %s' % op
            time.sleep(0.05)
        os.kill(int(marker.read_text()), signal.SIGINT)
        interrupted = time.monotonic()
        out, err = job.communicate(timeout=slack(60))
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert job.returncode != 0
    # Its traceback once: in the failure summary, which names it too.
    assert err.count('Traceback (most recent call last)') == 1, err
    assert err.count('\n[rank 0]   KeyboardInterrupt') == 1, err
    assert 'mnopt: uncaught exception on rank 0' in err
    assert 'should never get' not in out
    # Rank 1 sleeps for 200 s, the timeout is 300 s: neither ended it.
    assert time.monotonic() - interrupted < slack(30)


# ------------------------------- a non-zero exit before create_communicator
# sys.excepthook never sees SystemExit: rank 1 exits with a failure before
# MPI started, and rank 0 would wait in MPI's start for ever.
RANK_1_EXITS = r'''
import argparse, os, sys
import mnopt
if int(os.environ['PMI_RANK']) == 1:
    how = sys.argv[1]
    if how == 'sys.exit':
        sys.exit(3)
    if how == 'raise':
        raise SystemExit(3)
    if how == 'message':
        sys.exit('data not found')
    argparse.ArgumentParser().parse_args(['--no-such-option'])
mnopt.create_communicator('flat')
print('rank 0 should never get past create_communicator')
'''


@pytest.mark.parametrize('how,status', [('sys.exit', 3), ('raise', 3),
                                        ('message', 1), ('argparse', 2)])
def test_a_rank_exiting_with_a_failure_before_mpi_ends_the_job(how, status):
    start = time.monotonic()
    proc = run_mpi(2, RANK_1_EXITS, timeout=120, args=[how], env=PATIENT,
                   module_runner=False)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert proc.stderr.count(
        'mnopt: rank 1 exited with status %d' % status) == 1, proc.stderr
    assert 'should never get' not in proc.stdout
    assert elapsed < slack(40), elapsed


def test_a_successful_exit_before_mpi_ends_nothing():
    code = ('import mnopt, sys\n'
            'print("imported")\n'
            'sys.exit(0)\n')
    proc = run_mpi(2, code, timeout=120, module_runner=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count('imported') == 2
    assert 'mnopt:' not in proc.stderr, proc.stderr


# -------------------------------------------- a deadline on MPI's start
# Rank 1 leaves without a failure (exit status 0) and without starting
# MPI: nothing ends the job but rank 0's own deadline in MPI's start.
RANK_1_LEAVES = r'''
import os, sys
import mnopt
if int(os.environ['PMI_RANK']) == 1:
    sys.exit(0)
mnopt.create_communicator('flat')
print('rank 0 should never get past create_communicator')
'''


def test_a_rank_waiting_in_mpis_start_ends_the_job_at_the_timeout():
    start = time.monotonic()
    proc = run_mpi(2, RANK_1_LEAVES, timeout=180, module_runner=False,
                   env={'MNOPT_STALL_WARNING': '2', 'MNOPT_TIMEOUT': '20'})
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    said = proc.stderr
    waiting = ("[rank 0] mnopt: rank 0 has been waiting in MPI's start at "
               'create_communicator for %d s: not every rank has arrived '
               '(one may have exited or failed before it)')
    assert said.count(waiting % 2) == 1, said      # the stall warning
    assert said.count(waiting % 20) == 1, said     # the end
    assert 'MNOPT_TIMEOUT' in said
    assert 'should never get' not in proc.stdout
    # Ended by its deadline (20 s), long before anything else would.
    assert elapsed < slack(90), elapsed


def test_without_the_c_watch_the_fault_handler_ends_the_wait():
    # mnopt.stall._startwatch not built: said before MPI's start, and Python's
    # fault handler ends the wait at the timeout.
    start = time.monotonic()
    proc = run_mpi(2, "import sys\n"
                   "sys.modules['mnopt.stall._startwatch'] = None\n"
                   + RANK_1_LEAVES, timeout=180, module_runner=False,
                   env={'MNOPT_STALL_WARNING': '2', 'MNOPT_TIMEOUT': '10'})
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert proc.stderr.count(
        "[rank 0] mnopt: rank 0 starts MPI at create_communicator, which "
        'waits for every rank') == 1, proc.stderr
    assert 'Timeout (0:00:10)!' in proc.stderr, proc.stderr
    assert 'should never get' not in proc.stdout
    assert elapsed < slack(90), elapsed


# ---------------------------------- helpers a rank starts are not ranks
# A process a rank starts (os.system, subprocess) inherits the launcher's
# variables; a failure in it is the rank's business, not the job's end.
HELPER = ('import mnopt; raise ValueError("the helper fails")')

HELPER_BEFORE_MPI = r'''
import os, shlex, sys
import mnopt
if os.environ['PMI_RANK'] == '0':
    status = os.system(sys.executable + ' -c ' + shlex.quote(%r))
    print('helper status', status, flush=True)
comm = mnopt.create_communicator('flat')
comm.mpi_comm.Barrier()
print('rank {} OK'.format(comm.rank), flush=True)
''' % HELPER

HELPER_AFTER_MPI = r'''
import subprocess, sys
import mnopt
comm = mnopt.create_communicator('flat')
if comm.rank == 0:
    helper = subprocess.run([sys.executable, '-c', %r], capture_output=True,
                            text=True)
    print('helper status', helper.returncode, flush=True)
    print(helper.stderr, flush=True)
comm.mpi_comm.Barrier()
print('rank {} OK'.format(comm.rank), flush=True)
''' % HELPER


@pytest.mark.parametrize('when', ['before-mpi', 'after-mpi'])
def test_a_helper_process_a_rank_starts_does_not_end_the_job(when):
    proc = run_mpi(2, HELPER_BEFORE_MPI if when == 'before-mpi'
                   else HELPER_AFTER_MPI, timeout=120, env=PATIENT,
                   module_runner=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert 'rank 0 OK' in proc.stdout and 'rank 1 OK' in proc.stdout, out
    assert 'ValueError: the helper fails' in out
    assert 'helper status 0' not in proc.stdout, out
    assert 'aborting the MPI job' not in out, out


# Ctrl-C to a rank in MPI's start, whose peer is still busy: Python cannot
# see it until MPI's start returns; mnopt's C handler ends the job at once.
LATE_TO_START = r'''
import os, sys, time
import mnopt
if os.environ['PMI_RANK'] == '1':
    time.sleep(200)
with open(sys.argv[1], 'w') as f:
    f.write(str(os.getpid()))
mnopt.create_communicator('flat')
print('rank 0 should never get past create_communicator')
'''


def test_ctrl_c_in_mpis_start_ends_the_job(tmp_path):
    import threading
    script, pid = tmp_path / 'late_to_start.py', tmp_path / 'rank_0_pid'
    script.write_text(LATE_TO_START)
    env = dict(os.environ, PYTHONPATH=python_path(), **dict(
        PATIENT, MNOPT_STALL_WARNING='1'))
    job = subprocess.Popen(
        mpiexec() + ['-n', '2', sys.executable, str(script), str(pid)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=REPO, start_new_session=True)
    said = []
    reader = threading.Thread(target=lambda: said.extend(job.stderr),
                              daemon=True)
    reader.start()
    try:
        # Rank 0's stall warning says it waits in MPI's start.
        deadline = time.monotonic() + slack(90)
        while not any("rank 0 has been waiting in MPI's start" in line
                      for line in list(said)):
            assert job.poll() is None and time.monotonic() < deadline, said
            time.sleep(0.05)
        os.kill(int(pid.read_text()), signal.SIGINT)
        interrupted = time.monotonic()
        job.wait(timeout=slack(60))
        reader.join(timeout=slack(30))
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    err = ''.join(said)
    assert job.returncode != 0
    assert err.count("mnopt: rank 0 interrupted (SIGINT) while waiting in "
                     "MPI's start at create_communicator") == 1, err
    assert 'before MPI started' not in err
    assert 'should never get' not in job.stdout.read()
    # Rank 1 sleeps for 200 s, the timeout is 300 s: neither ended it.
    assert time.monotonic() - interrupted < slack(30)
