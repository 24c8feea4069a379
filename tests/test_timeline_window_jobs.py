"""A timeline window in whole jobs at 2 and 3 ranks, each with its own
mpiexec: a long job with MNOPT_TIMELINE_STEPS=100:120 writes only those
20 steps on every rank, files no bigger than a short job's; a window that
differs between ranks, or one a rank cannot read, is an error on every
rank naming the setting."""

import glob
import os

import pytest

from conftest import run_mpi
from mnopt.timeline import recorder as timeline, window as timeline_window
from mnopt.report import trace_analysis

pytestmark = pytest.mark.spawn

MEAN_GRADS = r'''
import os, sys, numpy
from mpi4py import MPI
if MPI.COMM_WORLD.rank == 1 and len(sys.argv) > 2:
    os.environ['MNOPT_TIMELINE_STEPS'] = sys.argv[2]   # this rank's own
import mnopt
comm = mnopt.create_communicator('flat')
tiny = numpy.ones(4, numpy.float32)
for k in range(int(sys.argv[1])):
    comm.mean_grads([('/a', tiny)])
comm.finalize()
'''


def job(n, tmp_path, name, steps, window='100:120', rank1=None):
    template = str(tmp_path / name / 'trace.json')
    env = {timeline.ENV: template, timeline_window.STEPS_ENV: window}
    args = [str(steps)] + ([rank1] if rank1 is not None else [])
    proc = run_mpi(n, MEAN_GRADS, timeout=120, args=args, env=env)
    return proc, sorted(glob.glob(str(tmp_path / name / 'trace.rank*.json')))


@pytest.mark.parametrize('n', [2, 3])
def test_a_long_job_writes_only_its_window(n, tmp_path):
    proc, paths = job(n, tmp_path, 'long', 2000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(paths) == n
    for path in paths:
        events = timeline.load(path)
        wires = sorted(e['args']['seq'] for e in events
                       if e['name'] == 'wire')
        assert wires == list(range(100, 120)), path
        assert sum(e['name'] == 'wait' for e in events) == 20
    proc, short = job(n, tmp_path, 'short', 200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for long_path, short_path in zip(paths, short):
        # The 1,880 steps past the window add nothing (timestamps may
        # take a digit more: a small margin).
        assert os.path.getsize(long_path) <= \
            1.1 * os.path.getsize(short_path)
    a = trace_analysis.analyze(paths)
    assert a['window'] == {'steps': '100:120'}
    assert a['collectives']['matched'] == 20


def test_a_window_that_differs_between_ranks_is_refused_everywhere(
        tmp_path):
    proc, _ = job(3, tmp_path, 'mixed', 3, rank1='100:130')
    assert proc.returncode != 0
    for rank in range(3):
        assert 'uncaught exception on rank %d' % rank in proc.stderr, \
            proc.stderr[-3000:]
    # Said once, in the failure summary, for every rank.
    assert ("MNOPT_TIMELINE_STEPS (rank 0: '100:120', rank 1: '100:130', "
            "rank 2: '100:120')") in proc.stderr, proc.stderr[-3000:]
    assert 'every rank raised the same error' in proc.stderr, \
        proc.stderr[-3000:]


def test_a_bad_window_on_one_rank_is_an_error_on_every_rank(tmp_path):
    proc, _ = job(2, tmp_path, 'bad', 3, rank1='120:100')
    assert proc.returncode != 0
    assert proc.stderr.count("MNOPT_TIMELINE_STEPS='120:100'") >= 2, \
        proc.stderr[-3000:]
