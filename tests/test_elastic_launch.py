"""Elastic relaunch (``python -m mnopt.launch --hosts ... --min-nodes K
--procs-per-node P -- python train.py``): the hosts given (a list, a host
file, Slurm's node list), a probe before every attempt, a host that stops
answering dropped and one that answers again taken back, each said with
its reason, and too few hosts an end with a clear message.  Hosts are
faked: this machine's two names, and a probe that reads a flag file."""

import os
import sys

import pytest

from conftest import mpiexec, process_state, python_path, run_job

from mnopt.launch import elastic
from mnopt.launch import hosts as elastic_hosts
from mnopt.launch import probe as elastic_probe

pytestmark = pytest.mark.one_rank


def test_slurm_node_lists_expand_as_scontrol_does():
    assert elastic_hosts.expand_slurm_nodelist('node[01-03,07],gpu5') == [
        'node01', 'node02', 'node03', 'node07', 'gpu5']
    assert elastic_hosts.expand_slurm_nodelist('a1') == ['a1']
    assert elastic_hosts.hosts_from(
        environ={'SLURM_JOB_NODELIST': 'n[8-10]'}) == ['n8', 'n9', 'n10']


def test_node_lists_with_several_brackets_expand_and_bad_ones_are_errors(
        tmp_path):
    assert elastic_hosts.expand_slurm_nodelist('rack[1-2]-node[01-02],x') == [
        'rack1-node01', 'rack1-node02', 'rack2-node01', 'rack2-node02', 'x']
    for bad in ('node[01-02', 'node[a-b]', 'n]'):
        with pytest.raises(ValueError, match='not a Slurm node list'):
            elastic_hosts.expand_slurm_nodelist(bad)
    f = tmp_path / 'hosts'
    f.write_text('h1\n[node4]\n')
    with pytest.raises(ValueError, match="'\\[node4\\]' is no host name"):
        elastic_hosts.read_hostfile(str(f))


def test_hosts_are_probed_at_once_within_the_probe_timeout():
    import threading
    everyone = threading.Barrier(3, timeout=60)   # all three at once
    pool = elastic.HostPool(['a', 'b', 'c'],
                            lambda h: (everyone.wait(), None)[1], None)
    assert pool.select() == ['a', 'b', 'c']
    probe = elastic_probe.command_probe('sleep 60', timeout=0.1)
    assert probe('a') == 'the probe took more than 0.1 s'


def test_a_hostfile_names_hosts_one_a_line(tmp_path):
    f = tmp_path / 'hosts'
    f.write_text('# the rack\nh1\nh2 # spare\n\nh3\n')
    assert elastic_hosts.read_hostfile(str(f)) == ['h1', 'h2', 'h3']
    assert elastic_hosts.read_hostfile_slots(str(f)) == (
        ['h1', 'h2', 'h3'], None)


def test_no_hosts_or_a_host_twice_is_an_error_saying_what_to_give():
    with pytest.raises(ValueError, match='give --hosts'):
        elastic_hosts.hosts_from(environ={})
    with pytest.raises(ValueError, match='h1 is named twice'):
        elastic_hosts.parse_host_list('h1,h2,h1')


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
    probe = elastic_probe.command_probe('test -e %s/{host}' % tmp_path)
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
                  '--wait-for-nodes', '0',
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
    assert 'a complete snapshot was written (snapshot_iter_10): ending the ' \
        'job to relaunch it with 127.0.0.1' in err, err
    assert 'took back 127.0.0.1' in err


def _take_back_plan(tmp_path, answers):
    """A plan on hosts a (always up) and b, whose probe answers as the
    list ``answers`` says, in turn (True: answers); with the messages."""
    said, turns = [], iter(answers)
    pool = elastic.HostPool(
        ['a', 'b'], lambda h: None if h == 'a' or next(turns) else 'down',
        said.append)
    plan = elastic.ElasticPlan(pool, 1, 1, ['python', 't.py'],
                               flavour='hydra', rejoin_dir=str(tmp_path),
                               probe_interval=0)
    return plan, said


def test_a_snapshot_taken_back_at_once_however_often_snapshots_come(
        tmp_path):
    plan, said = _take_back_plan(tmp_path, [False, True])
    assert plan.command_for_attempt()[2] == 'a:1'
    (tmp_path / 'snapshot_iter_1.0').write_text('')
    assert not plan.time_to_take_back()   # b answers
    (tmp_path / '.mnopt-partial.snapshot_iter_2.0').write_text('')
    assert not plan.time_to_take_back()   # a partial file is no snapshot
    # A new complete file: at once, though the listing changes at every
    # look (snapshots more often than --probe-interval).
    (tmp_path / 'snapshot_iter_2.0').write_text('')
    assert plan.time_to_take_back()
    assert 'a complete snapshot was written (snapshot_iter_2)' in said[-1]


def test_a_host_that_flaps_must_answer_longer_before_a_take_back(tmp_path):
    plan, said = _take_back_plan(
        tmp_path, [False, True, False, True, False, True, True])
    plan.command_for_attempt()
    assert not plan.time_to_take_back()
    (tmp_path / 'snapshot_iter_1.0').write_text('')
    assert plan.time_to_take_back()
    assert plan.command_for_attempt()[2] == 'a:1'   # b does not answer
    assert plan.missed_take_back == ['b']
    assert said[-1].startswith('mnopt.launch: b did not answer at the '
                               'relaunch: not taken back')
    assert plan.answers_needed('b') == 2
    assert not plan.time_to_take_back()   # answers once,
    assert not plan.time_to_take_back()   # not twice in a row
    assert not plan.time_to_take_back()
    assert not plan._back
    assert not plan.time_to_take_back()   # twice in a row: watched again
    assert plan._back[0] == ['b']


FLAPPING_JOB = '''#!/bin/sh
# Attempt 0 trains until it is ended; later ones for 2 s; a snapshot
# every 0.1 s.  Attempt 4 and later end at once (bounds a launcher that
# would restart forever).
echo "$MNOPT_RESTART" >> "$1/attempts"
[ "$MNOPT_RESTART" -ge 4 ] && exit 0
i=0; n=20; [ "$MNOPT_RESTART" = 0 ] && n=600
while [ $i -lt $n ]; do
    i=$((i+1)); touch "$1/snaps/snapshot_${MNOPT_RESTART}_$i"; sleep 0.1
done
'''


def test_a_host_that_flaps_does_not_restart_the_job_forever(tmp_path):
    import io
    from mnopt.launch import __main__ as launcher
    job, fake_mpiexec = tmp_path / 'job.sh', tmp_path / 'mpiexec'
    job.write_text(FLAPPING_JOB)
    fake_mpiexec.write_text('#!/bin/sh\nshift 4\nexec "$@"\n')
    for f in (job, fake_mpiexec):
        f.chmod(0o755)
    (tmp_path / 'snaps').mkdir()
    flaps = iter(i % 2 == 1 for i in range(10000))   # down, up, down, ...
    said = []
    pool = elastic.HostPool(
        ['a', 'b'], lambda h: None if h == 'a' or next(flaps) else 'down',
        said.append)
    plan = elastic.ElasticPlan(pool, 1, 1, [str(job), str(tmp_path)],
                               mpiexec=str(fake_mpiexec), flavour='hydra',
                               rejoin_dir=str(tmp_path / 'snaps'),
                               probe_interval=0.05)
    log = io.StringIO()
    status = launcher.run(None, max_restarts=1, delay=0, log=log, plan=plan)
    said = log.getvalue()
    attempts = (tmp_path / 'attempts').read_text().split()
    assert status == 0 and attempts == ['0', '1'], (attempts, said)
    assert 'b did not answer at the relaunch: not taken back' in said
    assert 'the restart to take b back gained no host: it counts as a ' \
        'failure (1 of 2)' in said, said


#: An MPI launcher that starts no rank (a host died after its probe: MPI's
#: launcher waits for its proxy for ever); with a rank given, that rank
#: notes its start as mnopt does at import, and no other.
NEVER_STARTS = '''#!/bin/sh
echo $$ >> "%(tmp)s/mpiexecs"
[ -n "%(rank)s" ] && : > "$MNOPT_FAILURE_DIR/rank-%(rank)s.start"
exec sleep 600
'''


@pytest.mark.parametrize('started', ['', '0'])
def test_an_attempt_that_never_starts_is_ended_and_counts_as_a_failure(
        tmp_path, started):
    import io
    from mnopt.launch import __main__ as launcher
    fake_mpiexec = tmp_path / 'mpiexec'
    fake_mpiexec.write_text(NEVER_STARTS % {'tmp': tmp_path,
                                            'rank': started})
    fake_mpiexec.chmod(0o755)
    probes = []
    pool = elastic.HostPool(['a', 'b'], lambda h: probes.append(h),
                            None)
    # --min-nodes 2: b, whose rank did not start, runs again all the same.
    plan = elastic.ElasticPlan(pool, 2, 1, ['python', 't.py'],
                               mpiexec=str(fake_mpiexec), flavour='hydra')
    log = io.StringIO()
    status = launcher.run(None, max_restarts=1, delay=0, log=log, plan=plan,
                          start_timeout=1, stop_timeout=60, wait_for_nodes=0)
    said = log.getvalue()
    # The launcher ended each: its own status, not SIGTERM's.
    assert status == launcher.NEVER_STARTED == 1, said
    if started:
        assert 'leaving b out: its ranks did not start within ' \
            '--start-timeout' in said, said
        assert 'running on b though it was left out' in said, said
    else:
        assert 'no host left out: no rank started on any host' in said
    assert said.count('the job started on a,b (1 process each) never '
                      'started: within 1 s (--start-timeout)') == 2, said
    missing = 'ranks 1 on b' if started else 'ranks 0 on a; ranks 1 on b'
    assert missing + ' noted no start in ' in said, said
    assert 'the job never started after' in said
    assert '(attempt 2 of 2); no restarts left' in said, said
    assert sorted(probes) == ['a', 'a', 'b', 'b']   # probed again
    for pid in (tmp_path / 'mpiexecs').read_text().split():
        assert not os.path.exists('/proc/%s' % pid) or \
            process_state(pid) == 'Z'


def test_the_launcher_sees_the_start_a_rank_notes_at_import(tmp_path):
    from mnopt.launch import attempt as launch_attempt
    import subprocess
    attempt = launch_attempt.Attempt(None, None)
    attempt.folder = str(tmp_path)
    env = dict(os.environ, PYTHONPATH=python_path(), PMI_RANK='1',
               PMI_SIZE='2', MNOPT_FAILURE_DIR=str(tmp_path))
    env.pop('MNOPT_LAUNCHED_PROCESS', None)
    subprocess.run([sys.executable, '-c', 'import mnopt'], env=env,
                   check=True, timeout=300)
    assert attempt.started_ranks() == {1}
    assert launch_attempt.never_started({1}, ['a', 'b'], 2) == {
        'a': [0], 'b': [2, 3]}


#: A job (what mpiexec would be) that notes it runs, then waits; it notes
#: a signal it receives, and exits on it unless told to ignore SIGTERM.
SIGNALLED = '''#!/bin/sh
trap 'echo INT >> "%(tmp)s/signalled"; exit 130' INT
trap '%(on_term)s' TERM
echo $$ > "%(tmp)s/running"
while :; do sleep 0.05; done
'''


def _launch_and_signal(tmp_path, signum, on_term, script=SIGNALLED):
    import signal
    import subprocess
    import time
    job = tmp_path / 'job.sh'
    job.write_text(script % {'tmp': tmp_path, 'on_term': on_term})
    job.chmod(0o755)
    launcher = subprocess.Popen(
        [sys.executable, '-m', 'mnopt.launch', '--stop-timeout', '1', '--',
         str(job)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=dict(os.environ, PYTHONPATH=python_path()),
        start_new_session=True)
    try:
        running = tmp_path / 'running'
        while not running.exists() or not running.read_text().strip():
            assert launcher.poll() is None, launcher.communicate()
            time.sleep(0.05)
        launcher.send_signal(signum)
        out, err = launcher.communicate(timeout=120)
    except BaseException:
        os.killpg(launcher.pid, signal.SIGKILL)
        raise
    return launcher.returncode, err, int(running.read_text())


@pytest.mark.parametrize('name,passed', [
    ('SIGINT', 'INT'), ('SIGTERM', 'TERM'),
    # The terminal or ssh session closed, or SIGQUIT: the job gets SIGTERM
    # (its own session hears no hangup), the launcher exits 129 or 131.
    ('SIGHUP', 'TERM'), ('SIGQUIT', 'TERM')])
def test_a_signal_reaches_the_job_and_the_launcher_exits_128_plus_it(
        tmp_path, name, passed):
    import signal
    signum = getattr(signal, name)
    status, err, pid = _launch_and_signal(
        tmp_path, signum,
        'echo TERM >> "%s/signalled"; exit 143' % tmp_path)
    assert status == 128 + signum, err
    # What the job heard: the passed signal, and nothing else (once, on a
    # loaded machine, it heard SIGTERM twice: harmless, cause not found).
    heard = (tmp_path / 'signalled').read_text().split()
    assert heard and set(heard) == {passed}, heard
    assert 'mnopt.launch: interrupted (%s)' % name in err, err
    assert 'not restarting' in err


def test_a_job_that_ignores_sigterm_is_killed_after_the_stop_timeout(
        tmp_path):
    import signal
    import time
    status, err, pid = _launch_and_signal(tmp_path, signal.SIGTERM, '')
    assert status == 128 + signal.SIGTERM, err
    assert not (tmp_path / 'signalled').exists()
    # Nothing of its process group is left (its sleeps, reaped by init).
    deadline = time.monotonic() + 60
    while any(process_state(p) not in (None, 'Z') and os.getpgid(int(p)) == pid
              for p in os.listdir('/proc') if p.isdigit()
              if _alive_pgid(p)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert process_state(pid) in (None, 'Z')


def _alive_pgid(pid):
    try:
        os.getpgid(int(pid))
        return True
    except OSError:
        return False


#: What MPI's launcher would be: it exits at once on SIGTERM, but its rank
#: (a child in its process group) ignores SIGTERM.
LEADER_EXITS = '''#!/bin/sh
sh -c 'trap "" TERM; echo $$ > "%(tmp)s/rank"; while :; do sleep 0.05; done' &
trap 'exit 143' TERM
while [ ! -s "%(tmp)s/rank" ]; do sleep 0.05; done
echo $$ > "%(tmp)s/running"
while :; do sleep 0.05; done
'''


def test_ranks_that_outlive_mpiexec_at_a_signal_are_killed(tmp_path):
    import signal
    import time
    status, err, pid = _launch_and_signal(tmp_path, signal.SIGTERM, '',
                                          script=LEADER_EXITS)
    assert status == 128 + signal.SIGTERM, err
    rank = (tmp_path / 'rank').read_text().strip()
    # Killed within --stop-timeout 1 (before the fix: never).
    deadline = time.monotonic() + 30
    while process_state(rank) not in (None, 'Z'):
        assert time.monotonic() < deadline, 'rank %s outlived it' % rank
        time.sleep(0.1)


def test_a_signal_kills_a_probe_that_hangs_and_is_not_waited_for():
    import threading
    import time
    stopping = threading.Event()
    probe = elastic_probe.command_probe('sleep 60', timeout=60)
    threading.Timer(0.5, stopping.set).start()
    begun = time.monotonic()
    said = elastic_probe.probe_all(probe, ['a', 'b'], stopping)
    assert time.monotonic() - begun < 30
    assert said == {'a': 'the launcher is stopping',
                    'b': 'the launcher is stopping'}
