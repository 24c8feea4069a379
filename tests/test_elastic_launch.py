"""Elastic relaunch (``python -m mnopt.launch --hosts ... --min-nodes K
--procs-per-node P -- python train.py``): the hosts given (a list, a host
file, Slurm's node list), a probe before every attempt, a host that stops
answering dropped and one that answers again taken back, each said with
its reason, and too few hosts an end with a clear message.  Hosts are
faked: this machine's two names, and a probe that reads a flag file."""

import os
import sys

import pytest

from conftest import mpiexec, python_path, run_job

from mnopt import elastic

pytestmark = pytest.mark.one_rank


def test_slurm_node_lists_expand_as_scontrol_does():
    assert elastic.expand_slurm_nodelist('node[01-03,07],gpu5') == [
        'node01', 'node02', 'node03', 'node07', 'gpu5']
    assert elastic.expand_slurm_nodelist('a1') == ['a1']
    assert elastic.hosts_from(environ={'SLURM_JOB_NODELIST': 'n[8-10]'}) \
        == ['n8', 'n9', 'n10']


def test_a_hostfile_names_hosts_one_a_line(tmp_path):
    f = tmp_path / 'hosts'
    f.write_text('# the rack\nh1:4\nh2 slots=4\n\nh3\n')
    assert elastic.read_hostfile(str(f)) == ['h1', 'h2', 'h3']


def test_no_hosts_or_a_host_twice_is_an_error_saying_what_to_give():
    with pytest.raises(ValueError, match='give --hosts'):
        elastic.hosts_from(environ={})
    with pytest.raises(ValueError, match='h1 is named twice'):
        elastic.parse_host_list('h1,h2,h1')


def test_the_pool_drops_and_takes_back_hosts_saying_why():
    said, down = [], {'h2'}
    pool = elastic.HostPool(
        ['h1', 'h2', 'h3'],
        lambda h: 'no route to host' if h in down else None, said.append)
    assert pool.select() == ['h1', 'h3']
    assert said == ['mnopt.launch: dropped h2: no route to host']
    assert pool.select() == ['h1', 'h3']   # said once
    down.clear()
    assert pool.select() == ['h1', 'h2', 'h3']
    assert said[-1] == ('mnopt.launch: took back h2: it answers again (it '
                        'did not: no route to host)')


def test_an_attempt_below_min_nodes_does_not_start():
    said = []
    pool = elastic.HostPool(['h1', 'h2', 'h3'],
                            lambda h: None if h == 'h1' else 'timed out',
                            said.append)
    plan = elastic.ElasticPlan(pool, 2, 4, ['python', 't.py'],
                               flavour='hydra')
    assert plan.command_for_attempt() is None
    assert '1 of 3 hosts answer, fewer than --min-nodes 2' in said[-1]
    assert 'h2: timed out; h3: timed out' in said[-1]


@pytest.mark.parametrize('flavour,option', [('hydra', '-hosts'),
                                            ('openmpi', '--host')])
def test_the_command_runs_procs_per_node_on_each_host(flavour, option):
    assert elastic.mpiexec_command('mpiexec', flavour, ['a', 'b'], 4,
                                   ['python', 't.py']) == [
        'mpiexec', option, 'a:4,b:4', '-n', '8', 'python', 't.py']


def test_a_command_probe_reports_the_exit_status(tmp_path):
    probe = elastic.command_probe('test -e %s/{host}' % tmp_path)
    (tmp_path / 'up').write_text('')
    assert probe('up') is None
    assert probe('gone') == 'the probe exited with status 1'


def launch(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=python_path())
    return run_job([sys.executable, '-m', 'mnopt.launch'] + list(args),
                   timeout, env)


@pytest.mark.parametrize('flags,message', [
    (['--min-nodes', '3', '--hosts', 'a,b'], '--min-nodes 3 is more than '
     'the 2 hosts given'),
    (['--hosts', 'a,b', '--', 'mpiexec', '-n', '2'], 'the command after -- '
     'is each process'),
])
def test_bad_elastic_arguments_are_clear_errors(flags, message):
    if '--' not in flags:
        flags = flags + ['--', 'python', 'x.py']
    done = launch(*flags)
    assert done.returncode == 2 and message in done.stderr, done.stderr


#: Attempt 0 on 2 hosts: rank 1 "loses its node" (the flag file makes the
#: probe fail) and the job fails; attempt 1 on the 1 host left: the node
#: comes back (the flag goes) and the job fails again; attempt 2: both
#: hosts, success.
SCRIPT = r'''
import os, sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
attempt, flag = os.environ['MNOPT_RESTART'], sys.argv[1]
print('ATTEMPT %s SIZE %d' % (attempt, comm.size), flush=True)
if attempt == '0':
    if comm.rank == 1:
        open(flag, 'w').close()
    comm.Barrier()
    sys.exit(3)
if attempt == '1':
    os.remove(flag)
    sys.exit(4)
'''


@pytest.mark.spawn
def test_a_lost_host_is_dropped_then_taken_back(tmp_path):
    script = tmp_path / 'job.py'
    script.write_text(SCRIPT)
    flag = tmp_path / 'down-127.0.0.1'
    done = launch('--hosts', 'localhost,127.0.0.1', '--min-nodes', '1',
                  '--procs-per-node', '1', '--delay', '0',
                  '--probe', 'test ! -e %s/down-{host}' % tmp_path,
                  '--mpiexec', mpiexec()[0], '--',
                  sys.executable, str(script), str(flag), timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count('ATTEMPT 0 SIZE 2') == 2
    assert done.stdout.count('ATTEMPT 1 SIZE 1') == 1
    assert done.stdout.count('ATTEMPT 2 SIZE 2') == 2
    err = done.stderr
    assert 'dropped 127.0.0.1: the probe exited with status 1' in err, err
    assert 'starting on 1 host (localhost)' in err
    assert 'took back 127.0.0.1: it answers again' in err
    assert err.index('dropped') < err.index('took back')


@pytest.mark.spawn
def test_too_few_hosts_after_a_failure_end_the_launcher(tmp_path):
    script = tmp_path / 'job.py'
    script.write_text(SCRIPT)
    flag = tmp_path / 'down-127.0.0.1'
    done = launch('--hosts', 'localhost,127.0.0.1', '--min-nodes', '2',
                  '--procs-per-node', '1', '--delay', '0',
                  '--probe', 'test ! -e %s/down-{host}' % tmp_path,
                  '--mpiexec', mpiexec()[0], '--',
                  sys.executable, str(script), str(flag), timeout=180)
    assert done.returncode == 3, done.stderr[-3000:]
    assert '1 of 2 hosts answer, fewer than --min-nodes 2: not starting ' \
        'the job (127.0.0.1: the probe exited with status 1)' in done.stderr
    assert 'ATTEMPT 1' not in done.stdout


@pytest.mark.spawn
def test_a_signal_while_the_hosts_are_probed_starts_nothing(tmp_path):
    script = tmp_path / 'job.py'
    script.write_text('print("STARTED")\n')
    # The probe itself sends the launcher SIGTERM (the user's Ctrl-C, or
    # the scheduler ending the allocation), then answers.
    done = launch('--hosts', 'localhost,127.0.0.1', '--delay', '0',
                  '--probe', "sh -c 'kill -TERM $PPID'",
                  '--mpiexec', mpiexec()[0], '--', sys.executable,
                  str(script), timeout=120)
    assert 'STARTED' not in done.stdout
    assert done.returncode != 0
    assert 'interrupted; not starting the job' in done.stderr, done.stderr


#: Attempt 0 on 2 hosts: rank 1's node is lost.  Attempt 1 on 1 host: the
#: node comes back, a snapshot is written a moment later, and the job
#: would train on for a minute: the launcher ends it to take the host
#: back.  Attempt 2 on both, success.
TAKE_BACK = r'''
import os, sys, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
attempt, flag, snapshots = os.environ['MNOPT_RESTART'], sys.argv[1], \
    sys.argv[2]
print('ATTEMPT %s SIZE %d' % (attempt, comm.size), flush=True)
if attempt == '0':
    if comm.rank == 1:
        open(flag, 'w').close()
    comm.Barrier()
    sys.exit(3)
if attempt == '1':
    os.remove(flag)
    time.sleep(1)
    open(os.path.join(snapshots, 'snapshot_iter_10'), 'w').close()
    time.sleep(60)
    print('NOT TAKEN BACK', flush=True)
'''


@pytest.mark.spawn
def test_a_host_back_is_taken_back_after_the_next_snapshot(tmp_path):
    script = tmp_path / 'job.py'
    script.write_text(TAKE_BACK)
    snapshots = tmp_path / 'out'
    snapshots.mkdir()
    done = launch('--hosts', 'localhost,127.0.0.1', '--delay', '0',
                  '--max-restarts', '1',
                  '--take-back-after-snapshot', str(snapshots),
                  '--probe-interval', '0.2',
                  '--probe', 'test ! -e %s/down-{host}' % tmp_path,
                  '--mpiexec', mpiexec()[0], '--', sys.executable,
                  str(script), str(tmp_path / 'down-127.0.0.1'),
                  str(snapshots), timeout=180)
    # One failure (attempt 0) of the one restart allowed: the restart to
    # take the host back counted none.
    assert done.returncode == 0, done.stderr[-3000:]
    assert 'NOT TAKEN BACK' not in done.stdout
    assert done.stdout.count('ATTEMPT 2 SIZE 2') == 2, done.stdout
    err = done.stderr
    assert '127.0.0.1 answers again: the job restarts to take it back ' \
        'after the next snapshot' in err, err
    assert 'a snapshot was written (snapshot_iter_10): ending the job to ' \
        'relaunch it with 127.0.0.1' in err, err
    assert 'took back 127.0.0.1' in err
