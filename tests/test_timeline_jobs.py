"""The timeline of whole jobs, each with its own mpiexec: reduction server
processes (``mpiexec -n 2 python worker.py : -n 1 python -m mnopt.server``)
write their own files by their COMM_WORLD rank, which the report reads
beside the workers' without counting them as workers; and a rank late to
every averaging is the straggler the report names, by about its delay."""

import glob
import os

import pytest

from conftest import run_mpi
from mnopt.timeline import recorder as timeline
from mnopt.report import trace_analysis
from test_reduction_server import run_job

pytestmark = pytest.mark.spawn

AVERAGINGS = 6

SERVER_WORKER = r'''
import numpy, mnopt
comm = mnopt.create_communicator('reduction_server', chunk_bytes=4096)
for k in range(%d):
    comm.mean_grads([('/a', numpy.full(3000, comm.rank + k, numpy.float32)),
                     ('/b', numpy.ones(7, numpy.float32))])
comm.finalize()
print('worker %%d done' %% comm.rank)
''' % AVERAGINGS


def _threads(events):
    return {e['tid']: e['args']['name'] for e in events
            if e['ph'] == 'M' and e['name'] == 'thread_name'}


def test_server_processes_write_their_own_timeline(tmp_path, monkeypatch):
    template = str(tmp_path / 'trace.json')
    monkeypatch.setenv(timeline.ENV, template)
    proc = run_job(2, 1, worker_code=SERVER_WORKER, worker_args=[])
    assert proc.returncode == 0, proc.stderr[-3000:]
    paths = sorted(glob.glob(str(tmp_path / 'trace.rank*.json')))
    assert [os.path.basename(p) for p in paths] == [
        'trace.rank0.json', 'trace.rank1.json', 'trace.rank2.json']
    events = timeline.load(paths[2])
    names = {e['args']['name'] for e in events if e['ph'] == 'M'
             and e['name'] == 'process_name'}
    assert names == {'server 2'}
    threads = _threads(events)
    spans = [e for e in events if e['ph'] == 'X']
    assert spans and {threads[e['tid']] for e in spans} == {'server'}
    assert {e['name'] for e in spans} == {'sum', 'wire'}
    assert {e['args']['op'] for e in spans if e['name'] == 'wire'} == {
        'recv', 'send'}
    # Each averaging's payload (3007 floats from each of 2 workers) is
    # summed here: 2 * 3007 * 4 bytes an averaging.
    summed = sum(e['args']['bytes'] for e in spans if e['name'] == 'sum')
    assert summed == AVERAGINGS * 2 * 3007 * 4
    a = trace_analysis.analyze(paths)
    assert a['ranks'] == [0, 1, 2]
    assert trace_analysis.workers(trace_analysis.load_traces(paths)) == [0, 1]
    assert a['collectives']['count'] == a['collectives']['matched'] \
        == AVERAGINGS


STRAGGLER = r'''
import time, numpy, mnopt
comm = mnopt.create_communicator('flat')
for k in range(%d):
    if comm.rank == 1:
        time.sleep(%r)   # late to every averaging
    comm.mean_grads([('/g', numpy.ones(1000, numpy.float32))])
comm.finalize()
'''

LATE_S = 0.2


def test_a_rank_late_to_each_averaging_is_the_straggler(tmp_path):
    template = str(tmp_path / 'trace.json')
    proc = run_mpi(2, STRAGGLER % (AVERAGINGS, LATE_S),
                   env={timeline.ENV: template})
    assert proc.returncode == 0, proc.stderr[-3000:]
    paths = sorted(glob.glob(str(tmp_path / 'trace.rank*.json')))
    a = trace_analysis.analyze(paths)
    c = a['collectives']
    assert c['matched'] == AVERAGINGS
    straggler, = c['stragglers']
    # Rank 0 waits for it in the layout check, before any wire starts.
    assert straggler['rank'] == 1 and straggler['share'] >= 0.8
    assert 0.5 * LATE_S * 1e3 <= straggler['late_ms'] <= 2 * LATE_S * 1e3
