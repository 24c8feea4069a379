"""Stall detection (mnopt/stall/monitor.py), as whole mpiexec jobs with short
times: a stopped rank is named within the warning time by every waiting
rank, and the job ends at the timeout."""

import threading
import time

import pytest

from conftest import run_mpi, slack, untagged
from mnopt.stall import report as stall_report, settings as stall_settings
from mnopt.transport import stall_wait

pytestmark = pytest.mark.spawn

# argv: communicator, what rank 1 does before the second averaging.
STALLS = r'''
import os, signal, sys, time, numpy, mnopt
name, how = sys.argv[1], sys.argv[2]
comm = mnopt.create_communicator(name)
grads = [('w', numpy.ones(1000, numpy.float32))]
comm.mean_grads(grads)
# Everyone's first averaging is over before rank 1 acts: with colocated
# reduction servers, rank 1's server may still be answering another rank.
comm.mpi_comm.Barrier()
if comm.rank == 1:
    if how == 'stop':
        os.kill(os.getpid(), signal.SIGSTOP)   # a frozen node
    elif how == 'busy':
        time.sleep(float(sys.argv[3]))          # a long step
    elif how == 'desync':
        comm.bcast_obj('x')                     # a different collective
if how == 'async':
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    comm.mean_grads_async(grads).wait()
else:
    comm.mean_grads(grads)
print('rank %d finished at %.1f' % (comm.rank, time.time()))
'''


def stalled_job(n, name, how, warning, timeout, *extra, env=None):
    start = time.time()
    proc = run_mpi(n, STALLS, timeout=timeout + 60, args=[name, how] +
                   list(extra), env=dict({'MNOPT_STALL_WARNING': str(warning),
                                          'MNOPT_TIMEOUT': str(timeout)},
                                         **(env or {})))
    return proc, time.time() - start


def reports(proc, rank):
    return [line for line in untagged(proc.stderr)
            if line.startswith('mnopt: rank %d has waited' % rank)]


@pytest.mark.parametrize('name,env', [
    ('flat', {}),
    ('hierarchical', {'MNOPT_RANKS_PER_NODE': '2'}),
    ('reduction_server', {}),   # colocated: every worker also serves
], ids=['flat', 'hierarchical', 'reduction_server'])
@pytest.mark.every_mpi  # the launcher ends the job
def test_a_stopped_rank_is_named_then_the_job_ends(name, env):
    proc, elapsed = stalled_job(3, name, 'stop', 2, 5, env=env)
    assert proc.returncode != 0
    assert 'finished' not in proc.stdout
    for r in (0, 2):
        warning, final = reports(proc, r)
        assert ' in %s#0.mean_grads #2; not arrived: rank 1 (no answer: ' \
            'stopped' % name in warning, warning
        assert 'arrived: rank 0, rank 2. Still waiting; the job is aborted ' \
            'after 5 s' in warning
        waited = float(warning.split('has waited ')[1].split(' s')[0])
        # At the warning time (a 0.2 s tick; margin for a loaded machine).
        assert 2.0 <= waited < 2.0 + slack(1.5), warning
        assert 'Timeout (5 s, MNOPT_TIMEOUT): aborting the MPI job' in final
        waited = float(final.split('has waited ')[1].split(' s')[0])
        assert 5.0 <= waited < 5.0 + slack(1.5), final
    assert elapsed < 5 + slack(15), elapsed  # start-up, the report, the abort


def test_a_busy_rank_is_told_from_a_stopped_one():
    proc, _ = stalled_job(2, 'flat', 'busy', 2, 0, '4')
    assert proc.returncode == 0, proc.stderr[-3000:]   # timeout 0: no abort
    assert proc.stdout.count('finished') == 2
    (warning,) = reports(proc, 0)
    assert 'not arrived: rank 1 (busy outside flat#0: computing, or stuck ' \
        'before its next call); arrived: rank 0. Still waiting.' in warning


def test_a_desynchronised_rank_says_where_it_is():
    proc, _ = stalled_job(2, 'naive', 'desync', 2, 4)
    assert proc.returncode != 0
    warning = reports(proc, 0)[0]
    assert 'in naive#0.mean_grads #2; not arrived: rank 1 (in ' \
        'naive#0.bcast_obj #1 for ' in warning, warning
    # Rank 1 waits in its bcast_obj and reports rank 0 in mean_grads.
    assert 'in naive#0.bcast_obj #1; not arrived: rank 0 (in ' \
        'naive#0.mean_grads #2 for ' in reports(proc, 1)[0]


def test_background_averaging_is_watched():
    proc, _ = stalled_job(2, 'flat', 'async', 2, 4)
    assert proc.returncode != 0
    warning = reports(proc, 0)[0]
    assert 'in flat#0.mean_grads_async #1; not arrived: rank 1 (no ' \
        'answer' in warning, warning


SERVER_STOPS_AFTER_ONE_REDUCTION = '''
import os, signal
from mnopt import server
from mnopt.server import loop as server_loop
serve_one = server_loop._reduce
def serve_then_stop(*args, **kwargs):
    serve_one(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGSTOP)
server_loop._reduce = serve_then_stop
server.main()
'''


@pytest.mark.parametrize('who', ['worker', 'server'])
def test_reduction_server_job_names_a_stopped_process(who, monkeypatch):
    from test_reduction_server import run_job
    worker = STALLS.replace('name, how = sys.argv[1], sys.argv[2]',
                            'name, how = "reduction_server", %r'
                            % ('stop' if who == 'worker' else 'none'))
    monkeypatch.setenv('MNOPT_STALL_WARNING', '2')
    monkeypatch.setenv('MNOPT_TIMEOUT', '4')
    proc = run_job(2, 1, worker_code=worker, timeout=60, worker_args=[],
                   server_code=SERVER_STOPS_AFTER_ONE_REDUCTION
                   if who == 'server' else None)
    assert proc.returncode != 0
    lines = [line for line in untagged(proc.stderr)
             if line.startswith('mnopt: worker 0 has waited')]
    assert lines, proc.stderr[-3000:]
    if who == 'worker':
        assert 'in job.mean_grads #2; not arrived: worker 1 (no answer' \
            in lines[0], lines[0]
        # Worker 0 waits in the layout check among the workers, before
        # any header reaches the server.
        assert '; servers: server 0 (idle: no request in progress)' \
            in lines[0]
    else:
        assert 'in job.mean_grads #2; every rank has arrived (worker 0, ' \
            'worker 1): it waits on the servers' in lines[0], lines[0]
        assert 'servers: server 0 (no answer' in lines[0]
    assert 'Timeout (4 s, MNOPT_TIMEOUT): aborting' in lines[-1]


def test_settings_from_arguments_then_environment(monkeypatch):
    monkeypatch.delenv('MNOPT_STALL_WARNING', raising=False)
    monkeypatch.delenv('MNOPT_TIMEOUT', raising=False)
    assert stall_settings.settings() == (60.0, 600.0)
    monkeypatch.setenv('MNOPT_STALL_WARNING', '5')
    monkeypatch.setenv('MNOPT_TIMEOUT', '0')
    assert stall_settings.settings() == (5.0, None)
    assert stall_settings.settings(stall_warning=1, timeout=2) == (1.0, 2.0)
    monkeypatch.setenv('MNOPT_TIMEOUT', 'soon')
    with pytest.raises(ValueError, match="MNOPT_TIMEOUT='soon'"):
        stall_settings.settings()
    with pytest.raises(ValueError, match='stall_warning=-1'):
        stall_settings.settings(stall_warning=-1, timeout=1)


def test_a_bool_is_not_a_number_of_seconds():
    for name in ('stall_warning', 'timeout'):
        with pytest.raises(ValueError, match='%s=True: a number of seconds'
                           % name):
            stall_settings.settings(**{name: True})
        with pytest.raises(ValueError, match='%s=False' % name):
            stall_settings.settings(**{name: False})


def _never_completing_request():
    """(an Irecv on a private communicator, and a function that completes
    it by sending it its message)."""
    import numpy
    from mpi4py import MPI
    comm = MPI.COMM_SELF.Dup()
    box = numpy.zeros(1, numpy.int32)
    request = comm.Irecv([box, MPI.INT], source=0, tag=7)

    def complete():
        comm.Send([numpy.ones(1, numpy.int32), MPI.INT], dest=0, tag=7)
    return request, complete


def test_wait_or_abort_warns_then_aborts(monkeypatch, capfd):
    request, complete = _never_completing_request()
    aborted = []

    def abort():   # instead of MPI_Abort: end the wait
        aborted.append(time.monotonic())
        complete()
    monkeypatch.setattr(stall_report, 'abort', abort)
    start = time.monotonic()
    stall_wait.wait_or_abort([request], 'the start-up (test)', 0.3, 1.0)
    assert len(aborted) == 1 and aborted[0] - start >= 1.0
    from mpi4py import MPI
    lines = [line for line in untagged(capfd.readouterr().err)
             if line.startswith('mnopt: rank %d has waited'
                                % MPI.COMM_WORLD.rank)]
    assert len(lines) == 2, lines
    assert ' in the start-up (test); not every rank has arrived (one may ' \
        'have failed, exited or not reached it). Still waiting; the job ' \
        'is aborted after 1 s (MNOPT_TIMEOUT).' in lines[0]
    assert lines[1].endswith('. Timeout (1 s, MNOPT_TIMEOUT): aborting the '
                             'MPI job.')


def test_wait_or_abort_returns_when_done_and_reads_the_environment(
        monkeypatch, capfd):
    request, complete = _never_completing_request()
    complete()
    monkeypatch.setattr(stall_report, 'abort', lambda: pytest.fail('aborted'))
    monkeypatch.setenv('MNOPT_TIMEOUT', '0.2')
    stall_wait.wait_or_abort([request], 'nothing')   # already complete
    stall_wait.wait_or_abort([], 'nothing')
    # A bad setting waits with the defaults (whoever checks it reports it).
    monkeypatch.setenv('MNOPT_TIMEOUT', 'abc')
    request, complete = _never_completing_request()
    threading.Timer(0.5, complete).start()
    stall_wait.wait_or_abort([request], 'a late message')
    assert 'has waited' not in capfd.readouterr().err


def test_bad_settings_fail_in_create_communicator():
    import mnopt
    with pytest.raises(ValueError, match='timeout'):
        mnopt.create_communicator('flat', timeout='never')


SERVER_THREAD_RAISES = '''
from mnopt import server
from mnopt.server import loop as server_loop
def broken(*args, **kwargs):
    raise RuntimeError('the server fell over')
server_loop._reduce = broken
server.main()
'''


def test_an_exception_in_a_server_thread_ends_the_job(monkeypatch):
    """Not left to the stall timeout (disabled here): the thread's
    exception aborts the job at once."""
    from test_reduction_server import run_job
    worker = STALLS.replace('name, how = sys.argv[1], sys.argv[2]',
                            'name, how = "reduction_server", "none"')
    monkeypatch.setenv('MNOPT_STALL_WARNING', '0')
    monkeypatch.setenv('MNOPT_TIMEOUT', '0')
    start = time.time()
    proc = run_job(2, 1, worker_code=worker, timeout=60, worker_args=[],
                   server_code=SERVER_THREAD_RAISES)
    assert proc.returncode != 0
    assert 'the server fell over' in proc.stderr
    assert 'uncaught exception in thread' in proc.stderr
    assert time.time() - start < 30
