"""tests/conformance_mpiexec.sh, the launcher the conformance run gives
ChainerMN's kit: the job's last line is a whole summary line, whatever
the ranks wrote and in whichever order they finished."""

import os
import subprocess
import sys

import pytest

import conftest

LAUNCHER = os.path.join(conftest.REPO, 'tests', 'conformance_mpiexec.sh')

# Each rank writes its summary in two pieces (as pytest writes a line: the
# text, then its newline), the newline late, while the other rank writes:
# through one pipe, the job's last line would be a piece.
RANKS_WRITE = r'''
import sys, time
from mpi4py import MPI
rank = MPI.COMM_WORLD.rank
print('progress of rank %d' % rank)
print('from rank %d' % rank, file=sys.stderr)
sys.stdout.write('%d failed, %d passed in 1.0s' % (rank, 10 - rank))
sys.stdout.flush()
MPI.COMM_WORLD.Barrier()
time.sleep(0.2 * (1 - rank))
sys.stdout.write('\n')
sys.exit(EXIT_STATUS)
'''


def launch(tmp_path, rc=0, log=None, code=RANKS_WRITE, temp=None):
    script = tmp_path / 'ranks.py'
    script.write_text(code.replace('EXIT_STATUS', str(rc)))
    real = conftest.mpiexec()
    if len(real) != 1 or 'HYDRA' not in subprocess.run(
            real + ['--version'], capture_output=True, text=True).stdout:
        pytest.skip('the launcher writes a file per rank with MPICH\'s '
                    'hydra only; this mpiexec is another')
    env = dict(os.environ, MNOPT_CONFORMANCE_MPIEXEC=real[0],
               PYTHONPATH=conftest.python_path())
    if log:
        env['MNOPT_CONFORMANCE_LOG'] = str(log)
    if temp:
        env['TMPDIR'] = str(temp)
    return subprocess.run([LAUNCHER, '-n', '2', sys.executable, str(script)],
                          capture_output=True, text=True, env=env,
                          timeout=conftest.slack(60))


@pytest.mark.spawn
def test_last_line_is_the_summary_of_the_rank_that_passed_fewest(tmp_path):
    log = tmp_path / 'job.log'
    job = launch(tmp_path, log=log)
    assert job.returncode == 0, job.stdout + job.stderr
    lines = job.stdout.splitlines()
    assert lines[-1] == '1 failed, 9 passed in 1.0s'
    # Every rank's output, whole and in rank order, before it; in the log
    # too.
    body = '\n'.join(lines[:-1]) + '\n'
    assert body == ('progress of rank 0\n0 failed, 10 passed in 1.0s\n'
                    'from rank 0\n'
                    'progress of rank 1\n1 failed, 9 passed in 1.0s\n'
                    'from rank 1\n')
    assert log.read_text() == body


@pytest.mark.spawn
def test_the_jobs_exit_status_is_kept(tmp_path):
    job = launch(tmp_path, rc=3)
    assert job.returncode != 0
    assert job.stdout.splitlines()[-1] == '1 failed, 9 passed in 1.0s'


@pytest.mark.spawn
def test_a_rank_that_wrote_no_summary_is_the_summary(tmp_path):
    # Rank 1 silent (killed, say): its missing summary is what the kit
    # reads, not rank 0's.  The rank files in a folder with a space.
    (tmp_path / 'with space').mkdir()
    job = launch(tmp_path, temp=tmp_path / 'with space', code=(
        'from mpi4py import MPI\n'
        'if MPI.COMM_WORLD.rank == 0:\n'
        '    print("12 passed in 1.0s")\n'))
    assert job.returncode == 0, job.stdout + job.stderr
    assert job.stdout.splitlines()[-2:] == ['12 passed in 1.0s',
                                           '(rank 1 wrote no summary)']
