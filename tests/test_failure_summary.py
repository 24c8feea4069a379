"""One failure summary (mnopt/common/failure_summary.py): a job that fails
by an exception, an exit, a stall or a signal shows one block, once, at the
end, naming the first failing rank and how, with its traceback once and
what the other ranks were doing; under a plain mpiexec the job writes
it, under python -m mnopt.launch the launcher, for each failed attempt.
Every mnopt line a rank writes on stderr starts with its rank."""

import os
import re
import sys

import pytest

from conftest import REPO, mpiexec, python_path, run_job, run_mpi

pytestmark = pytest.mark.spawn

#: Far above every wait in these jobs, except the stall's own.
PATIENT = {'MNOPT_STALL_WARNING': '250', 'MNOPT_TIMEOUT': '300'}

#: Rank 1 fails, as argv[1] says, after one averaging; the others wait in
#: the second one.
JOB = r'''
import os, signal, sys, time
import numpy
import mnopt
comm = mnopt.create_communicator('flat')
grads = [('w', numpy.ones(4, 'f'))]
comm.mean_grads(grads)
if comm.rank == 1:
    time.sleep(0.3)
    how = sys.argv[1]
    if how == 'exception':
        raise ValueError('a bad batch on rank 1')
    if how == 'exit':
        sys.exit(3)
    if how == 'stall':
        time.sleep(200)
    if how == 'SIGKILL':
        os.kill(os.getpid(), signal.SIGKILL)
    if how == 'SIGSEGV':
        import ctypes
        ctypes.string_at(0)
if sys.argv[1] == 'two' and comm.rank in (1, 2):
    time.sleep(0.3)
    raise ValueError('a bad batch on rank %d' % comm.rank)
comm.mean_grads(grads)
'''

HEADER = 'mnopt: failure summary'


def _check_block(err, first, how, header=HEADER):
    """The block is there once, names ``first`` and ``how``; returns its
    lines (untagged)."""
    assert err.count(header) == 1, err
    assert err.count('end of the failure summary') == 1, err
    untagged = [re.sub(r'^\[rank \d+\] ', '', line)
                for line in err.split('\n')]
    start = next(i for i, line in enumerate(untagged) if header in line)
    block = untagged[start:]
    block = block[:next(i for i, line in enumerate(block)
                        if line == 'end of the failure summary') + 1]
    assert block[1].startswith('first failure: %s ' % first), block
    assert ': %s: ' % how in block[1], block
    return block


@pytest.mark.parametrize('ranks', [2, 3])
def test_an_exception_is_summed_up_once_by_the_failing_rank(ranks):
    proc = run_mpi(ranks, JOB, timeout=120, args=['exception'], env=PATIENT,
                   module_runner=False)
    assert proc.returncode != 0
    err = proc.stderr
    block = _check_block(err, 'rank 1', 'uncaught exception')
    assert err.count('ValueError: a bad batch on rank 1') == 1, err
    assert 'its traceback:' in block
    assert '[rank 1] mnopt: uncaught exception on rank 1' in err
    # Every line of the block carries the rank that wrote it.
    assert all(line.startswith('[rank 1] ') for line in err.split('\n')
               if 'failure summary' in line or 'first failure' in line)
    for r in set(range(ranks)) - {1}:
        assert any(line.startswith('  rank %d: in flat#0.mean_grads #2 '
                                   % r) for line in block), block


def test_an_exit_is_summed_up_once_by_a_rank_that_waited_for_it():
    proc = run_mpi(3, JOB, timeout=120, args=['exit'], env=PATIENT,
                   module_runner=False)
    assert proc.returncode != 0
    block = _check_block(proc.stderr, 'rank 1', 'exit')
    assert 'exited without entering flat#0.mean_grads #2' in block[1]
    assert '  rank 1: its process exited' in block


def test_a_stall_is_summed_up_once_though_two_ranks_time_out():
    proc = run_mpi(3, JOB, timeout=120, args=['stall'],
                   env={'MNOPT_STALL_WARNING': '2', 'MNOPT_TIMEOUT': '4'},
                   module_runner=False)
    assert proc.returncode != 0
    err = proc.stderr
    # Ranks 0 and 2 both time out; the lower one sums up.
    assert err.count('Timeout (4 s, MNOPT_TIMEOUT)') >= 1, err
    block = _check_block(err, 'rank 0', 'stall')
    assert 'past the timeout (4 s, MNOPT_TIMEOUT)' in block[1]
    assert any(line.startswith('  rank 1: busy outside flat#0')
               for line in block), block
    assert 'its traceback:' not in block


def test_ranks_failing_at_once_are_each_named_in_the_one_block():
    proc = run_mpi(3, JOB, timeout=120, args=['two'], env=PATIENT,
                   module_runner=False)
    assert proc.returncode != 0
    block = _check_block(proc.stderr, 'rank 1', 'uncaught exception')
    # Rank 1's traceback in full, once; rank 2's failure in one line.
    assert proc.stderr.count('ValueError: a bad batch on rank 1') == 1
    assert '  rank 2: also failed (uncaught exception): ValueError: ' \
        'a bad batch on rank 2' in block, block
    assert any(line.startswith('  rank 0: in flat#0.mean_grads #2 ')
               for line in block), block


#: Every rank refuses the same way before (or after) its communicator is
#: up, as mnopt's refused settings do.
REFUSED = r'''
import sys
from mpi4py import MPI
import mnopt
if sys.argv[1] == 'after':
    comm = mnopt.create_communicator('flat')
    comm.allreduce_obj(1)
raise ValueError('refused: pass the same setting on every rank')
'''


@pytest.mark.parametrize('when', ['before', 'after'])
def test_the_same_error_on_every_rank_is_one_block_that_says_so(when):
    proc = run_mpi(3, REFUSED, timeout=120, args=[when], env=PATIENT,
                   module_runner=False)
    assert proc.returncode != 0
    block = _check_block(proc.stderr, 'rank 0', 'uncaught exception')
    assert 'the other ranks: every rank raised the same error ' \
        '(rank 1, rank 2 too)' in block, block
    assert proc.stderr.count(
        'ValueError: refused: pass the same setting on every rank') == 1


def _launched(how, ranks=3, restarts=1, cwd=REPO):
    """The job under python -m mnopt.launch, once, started in ``cwd``
    (where the launcher makes its folder for the ranks' records); its
    stderr."""
    script = os.path.join(os.path.dirname(__file__),
                          '.spawned_launch_%d.py' % os.getpid())
    with open(script, 'w') as f:
        f.write(JOB)
    env = dict(os.environ, PYTHONPATH=python_path(), **PATIENT)
    try:
        proc = run_job([sys.executable, '-m', 'mnopt.launch',
                        '--max-restarts', str(restarts), '--delay', '0',
                        '--']
                       + mpiexec() + ['-n', str(ranks), sys.executable,
                                      script, how], 180, env, cwd)
    finally:
        os.remove(script)
    assert proc.returncode != 0
    return proc.stderr


@pytest.mark.parametrize('how,said', [
    ('exception', 'uncaught exception'), ('SIGKILL', 'signal'),
    ('SIGSEGV', 'signal')])
def test_the_launcher_sums_up_each_failed_attempt(how, said, tmp_path):
    # A folder of its own: other tests' launchers make theirs in REPO.
    err = _launched(how, cwd=str(tmp_path))
    for attempt in (1, 2):
        header = 'mnopt.launch: failure summary of attempt %d of 2' % attempt
        assert err.count(header) == 1, err
    # The ranks leave the block to the launcher: one per attempt.
    assert HEADER not in err, err
    assert err.count('end of the failure summary') == 2, err
    attempts = err.split('mnopt.launch: failure summary of attempt ')
    for text in attempts[1:]:
        lines = text.split('\n')
        # MPICH's mpiexec ends the other ranks by SIGKILL as well, and
        # names one of them: which one it saw end first.
        first = 'rank ' if how == 'SIGKILL' else 'rank 1 '
        assert lines[1].startswith('first failure: ' + first), text
        assert ': %s: ' % said in lines[1], text
    if how == 'exception':
        assert err.count('ValueError: a bad batch on rank 1') == 2, err
    if how == 'SIGKILL':
        assert 'killed by SIGKILL' in err, err
    if how == 'SIGSEGV':
        assert 'Segmentation fault' in attempts[1].split('\n')[1]
        assert 'string_at' in attempts[1], attempts[1]
    # Its folder for the ranks' records is gone.
    assert not [n for n in os.listdir(str(tmp_path))
                if n.startswith('.mnopt-failure-')]


def test_the_launcher_names_every_rank_that_failed():
    err = _launched('two', restarts=0)
    block = _check_block(err, 'rank 1', 'uncaught exception',
                         header='mnopt.launch: failure summary of attempt')
    assert '  rank 2: also failed (uncaught exception): ValueError: ' \
        'a bad batch on rank 2' in block, block
    assert '  rank 0: ended with the job' in block or any(
        line.startswith('  rank 0: in flat#0.mean_grads #2 ')
        for line in block), block


#: The user's own logging: every record to a file of its own.
USER_LOG = r'''
import logging, os, sys
logging.basicConfig(filename=sys.argv[1] + '.%s' % os.environ['PMI_RANK'],
                    level=logging.INFO)
import mnopt
comm = mnopt.create_communicator('flat')
comm.allreduce_obj(1)
if comm.rank == 1:
    raise ValueError('a bad batch on rank 1')
comm.allreduce_obj(2)
'''


def test_the_block_reaches_stderr_also_with_the_users_log_file(tmp_path):
    log = str(tmp_path / 'user.log')
    proc = run_mpi(2, USER_LOG, timeout=120, args=[log], env=PATIENT,
                   module_runner=False)
    assert proc.returncode != 0
    # On stderr, as Python prints a traceback whatever logging says...
    block = _check_block(proc.stderr, 'rank 1', 'uncaught exception')
    assert '  ValueError: a bad batch on rank 1' in block, block
    # ... and in the user's file too, untagged.
    with open(log + '.1') as f:
        assert 'ValueError: a bad batch on rank 1' in f.read()


def test_a_signal_on_a_rank_no_start_record_matches_is_said_of_rank_unknown():
    """mpiexec names a process (pid, host) that no rank's start record
    matches (another spelling of the host): the summary says 'rank ?'
    instead of failing the launcher (it raised TypeError)."""
    found = {'failure': {}, 'fault': {},
             'start': {0: {'pid': 11, 'host': 'localhost'}}}
    ended = {'pid': 99, 'host': '127.0.0.1', 'signal': 9}
    from mnopt.common import failure_summary
    rec = failure_summary.first_failure(found, ended)
    assert rec['who'] == 'rank ?'
    assert rec['what'].startswith('killed by SIGKILL'), rec
    assert rec['pid'] == 99 and rec['host'] == '127.0.0.1'
