"""The elastic launcher's relaunch decisions, with fake hosts, probes and
MPI launchers (no MPI job is started): host files as schedulers write
them, a probe that leaves a child behind, the host a failure names left
out for a while, the wait for --min-nodes hosts, a take-back only on a
complete snapshot, and the exit status of an attempt that never
started."""

import io
import os
import sys
import threading
import time

import numpy
import pytest

from conftest import process_state, python_path, run_job

from mnopt.launch import elastic
from mnopt.launch import hosts as elastic_hosts
from mnopt.launch import probe as elastic_probe
from mnopt.launch import snapshots as elastic_snapshots
from mnopt.launch import __main__ as launcher
from mnopt.launch import attempt as launch_attempt

pytestmark = pytest.mark.one_rank


def launch(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=python_path())
    return run_job([sys.executable, '-m', 'mnopt.launch'] + list(args),
                   120, env, **({'cwd': cwd} if cwd else {}))


# -- host files and node lists ----------------------------------------------

@pytest.mark.parametrize('text', [
    'n1\nn1\nn1\nn1\nn2\nn2\nn2\nn2\n',   # $PBS_NODEFILE: a line per slot
    'n1 slots=4\nn2 slots=4\n',           # Open MPI
    'n1:4\nn2:4\n',                       # MPICH's Hydra
    'n1 slots=4 max_slots=8\r\nn2\tslots=4\r\n',   # CRLF and a tab
    'n1:2\nn2 slots=4\nn1 slots=2\n',     # counts add up
])
def test_a_host_files_slots_are_the_processes_per_host(tmp_path, text):
    f = tmp_path / 'hosts'
    f.write_bytes(text.encode())
    assert elastic_hosts.read_hostfile_slots(str(f)) == (['n1', 'n2'], 4)


@pytest.mark.parametrize('text,message', [
    ('n1 slots=2\nn2 slots=4\n', 'different numbers of slots (n1: 2, '
     'n2: 4)'),
    ('n1:4\nn2\n', 'different numbers of slots (n1: 4, n2: 1)'),
    ('n1 slots=0\n', "'0' is no number of slots"),
    ('n1:x\n', "'x' is no number of slots"),
])
def test_host_files_the_launcher_cannot_follow_are_errors(tmp_path, text,
                                                          message):
    f = tmp_path / 'hosts'
    f.write_text(text)
    with pytest.raises(ValueError, match=message.replace('(', r'\(')
                       .replace(')', r'\)')):
        elastic_hosts.read_hostfile_slots(str(f))


def test_the_launcher_runs_a_host_files_slots_on_each_host(tmp_path):
    f = tmp_path / 'hosts'
    f.write_text('n1\nn1\nn1\nn1\nn2\nn2\nn2\nn2\n')
    common = ['--hostfile', str(f), '--probe', 'true', '--mpiexec', 'echo',
              '--max-restarts', '0']
    done = launch(*common + ['--', 'python', 'train.py'])
    assert done.returncode == 0, done.stderr
    assert '-hosts n1:4,n2:4 -n 8 python train.py' in done.stdout, done
    assert 'starting on 2 hosts (n1,n2), 4 processes each' in done.stderr
    done = launch(*common + ['--procs-per-node', '2', '--', 'python', 'x'])
    assert '-hosts n1:2,n2:2 -n 4 python x' in done.stdout, done  # fewer
    done = launch(*common + ['--procs-per-node', '5', '--', 'python', 'x'])
    assert done.returncode == 2
    assert 'gives each host 4 slots, and --procs-per-node 5: give at most ' \
        'as many processes per host as slots' in done.stderr, done.stderr
    f.write_text('fe80::1 slots=2\nfe80::2 slots=2\n')   # IPv6
    assert elastic_hosts.read_hostfile_slots(str(f)) == (
        ['fe80::1', 'fe80::2'], 2)
    f.write_text('n1 slots=2\nn2 slots=4\n')
    done = launch(*common + ['--', 'python', 'x'])
    assert done.returncode == 2 and 'different numbers of slots' in \
        done.stderr, done.stderr


def test_a_reversed_range_in_a_node_list_is_an_error():
    with pytest.raises(ValueError, match='the range 3-1 is reversed'):
        elastic_hosts.expand_slurm_nodelist('node[3-1]')
    assert elastic_hosts.expand_slurm_nodelist('node[1-1]') == ['node1']


# -- probes -----------------------------------------------------------------

def test_a_probe_that_leaves_a_child_holding_its_stderr_answers():
    probe = elastic_probe.command_probe(
        "sh -c 'sleep 30 >/dev/null & exit 0'", timeout=20)
    start = time.monotonic()
    assert probe('a') is None
    assert time.monotonic() - start < 15
    failing = elastic_probe.command_probe(
        "sh -c 'echo no route >&2; exit 255'")
    assert failing('a') == 'the probe exited with status 255: no route'


def test_a_probe_that_hangs_is_killed_with_its_children(tmp_path):
    pid = tmp_path / 'pid'
    probe = elastic_probe.command_probe(
        "sh -c 'sleep 60 & echo $! > %s; wait'" % pid, timeout=1)
    assert probe('a') == 'the probe took more than 1 s'
    child = int(pid.read_text())
    deadline = time.monotonic() + 30
    while os.path.exists('/proc/%d' % child) and process_state(child) != 'Z':
        assert time.monotonic() < deadline, 'the probe\'s child lives on'
        time.sleep(0.05)


# -- the host a failure names is left out -----------------------------------

def _plan(hosts, min_nodes, answers=None, **kwargs):
    """A plan on ``hosts``; ``answers(host)``: whether it answers (all do
    where not given); with its messages."""
    said = []
    pool = elastic.HostPool(hosts, lambda h: None if answers is None or
                            answers(h) else 'down', said.append)
    plan = elastic.ElasticPlan(pool, min_nodes, 1, ['python', 't.py'],
                               flavour='hydra', **kwargs)
    return plan, said


def _hosts(command):
    return None if command is None else command[2]


def test_a_host_left_out_runs_again_after_twice_as_many_probes_each_time():
    plan, said = _plan(['a', 'b', 'c'], 2)
    assert _hosts(plan.command_for_attempt()) == 'a:1,b:1,c:1'
    plan.leave_out(['c'], 'rank 2 failed first there')
    assert said[-1] == ('mnopt.launch: leaving c out: rank 2 failed first '
                        'there; it runs again once it has answered 2 probes '
                        '(before that, only where fewer than --min-nodes 2 '
                        'other hosts answer after --wait-for-nodes)')
    runs = [_hosts(plan.command_for_attempt()) for _ in range(2)]
    assert runs == ['a:1,b:1', 'a:1,b:1,c:1'], said
    assert 'mnopt.launch: c has answered 2 probes since it was left out ' \
        '(rank 2 failed first there): it may run again' in said
    plan.leave_out(['c'], 'rank 2 failed first there')   # again: 4 probes
    runs = [_hosts(plan.command_for_attempt()) for _ in range(4)]
    assert runs == ['a:1,b:1'] * 3 + ['a:1,b:1,c:1'], said


def test_a_host_left_out_still_runs_where_too_few_others_answer():
    plan, said = _plan(['a', 'b', 'c'], 3)
    plan.command_for_attempt()
    plan.leave_out(['c'], 'its ranks did not start within --start-timeout')
    assert _hosts(plan.command_for_attempt()) == 'a:1,b:1,c:1'
    assert 'running on c though it was left out (its ranks did not start ' \
        'within --start-timeout): without it fewer than --min-nodes 3 ' \
        'hosts answer' in said[-1], said


def test_a_host_left_out_for_a_failure_is_not_taken_back_on_purpose(
        tmp_path):
    down = {'c'}
    plan, said = _plan(['a', 'b', 'c', 'd'], 2, lambda h: h not in down,
                       rejoin_dir=str(tmp_path), probe_interval=0)
    plan.command_for_attempt()
    plan.leave_out(['b'], 'rank 1 failed first there')
    assert _hosts(plan.command_for_attempt()) == 'a:1,d:1'  # b: 1 of 2
    assert plan.takes_back()   # c, which did not answer
    assert not plan.time_to_take_back()   # b: 2 of 2, not taken back
    assert not any('answers again' in s for s in said), said
    down.clear()
    assert not plan.time_to_take_back()
    assert 'c answers again: the job restarts to take it back' in said[-1]
    # Only c: b runs again at a failure's relaunch, once it waited.
    assert _hosts(plan.command_for_attempt()) == 'a:1,b:1,c:1,d:1'


def test_hosts_are_left_out_in_turn_where_no_rank_started_anywhere():
    plan, said = _plan(['a', 'b', 'c'], 2)

    def nothing_started():
        missing = launch_attempt.never_started(set(), plan.hosts, 1)
        launch_attempt.blame(plan, None, None, 'never started', missing,
                             said.append)
    runs = [_hosts(plan.command_for_attempt())]
    for _ in range(3):
        nothing_started()
        runs.append(_hosts(plan.command_for_attempt()))
    assert runs == ['a:1,b:1,c:1', 'b:1,c:1', 'a:1,c:1', 'a:1,b:1'], said
    assert 'leaving a out: no rank started on any host: one host\'s MPI ' \
        'daemon may hang, so hosts are left out in turn, one per attempt' \
        in said[1], said
    assert any('a may run again: without it no rank started either' in s
               for s in said), said
    plan, said = _plan(['a', 'b'], 2)   # no more than --min-nodes
    plan.command_for_attempt()
    nothing_started()
    assert said[-1] == 'mnopt.launch: no host left out: no rank started ' \
        'on any host', said


def test_a_host_left_out_for_a_failure_waits_for_the_others_first():
    down = {'b'}
    plan, said = _plan(['a', 'b', 'c'], 2, lambda h: h not in down,
                       probe_interval=0)
    plan.command_for_attempt()
    plan.leave_out(['c'], 'rank 2 failed first there')
    plan._cooling['c'] = 100   # it would not be done waiting soon
    import threading
    threading.Timer(1.5, down.clear).start()
    assert _hosts(plan.command_for_attempt(wait=120)) == 'a:1,b:1'
    assert any('2 of 3 hosts answer (1 not left out for a failure)' in s
               for s in said), said
    assert not any('though it was left out' in s for s in said), said
    down.add('b')   # gone for good: after the wait, c runs
    plan.leave_out(['c'], 'rank 2 failed first there')
    assert _hosts(plan.command_for_attempt(wait=1)) == 'a:1,c:1'
    assert 'running on c though it was left out (rank 2 failed first ' \
        'there): without it fewer than --min-nodes 2 hosts answer after ' \
        'waiting 1 s (--wait-for-nodes)' in said[-2], said


#: A fake MPI launcher: ``-hosts h1:1,h2:1,... -n N CMD``; the ranks on
#: the hosts named in $FAKE_BAD say, as mnopt does, that they exited
#: before MPI started, and the job fails; else it succeeds.  Each
#: attempt's host list is added to $FAKE_LOG.
FAKE_MPIEXEC = '''#!/bin/sh
echo "$2" >> "$FAKE_LOG"
rank=0; bad=
for item in $(echo "$2" | tr ',' ' '); do
    case " $FAKE_BAD " in *" ${item%%:*} "*)
        echo "[rank $rank] mnopt: rank $rank exited with status 3 before \
MPI started; ending the job (a signal)" >&2; bad=1;;
    esac
    rank=$((rank + 1))
done
[ -n "$bad" ] && exit 142
exit 0
'''


def _run_fake(tmp_path, monkeypatch, hosts, bad, min_nodes=2,
              max_restarts=2):
    fake = tmp_path / 'mpiexec'
    fake.write_text(FAKE_MPIEXEC)
    fake.chmod(0o755)
    monkeypatch.setenv('FAKE_LOG', str(tmp_path / 'attempts'))
    monkeypatch.setenv('FAKE_BAD', bad)
    pool = elastic.HostPool(hosts, lambda h: None, None)
    plan = elastic.ElasticPlan(pool, min_nodes, 1, ['python', 't.py'],
                               mpiexec=str(fake), flavour='hydra')
    log = io.StringIO()
    status = launcher.run(None, max_restarts=max_restarts, delay=0, log=log,
                          plan=plan, start_timeout=0, stop_timeout=60)
    return status, (tmp_path / 'attempts').read_text().split(), \
        log.getvalue()


def test_the_host_whose_rank_failed_first_is_left_out(tmp_path,
                                                      monkeypatch):
    # c answers its probe, but its ranks fail at once (its GPU fell off
    # the bus): the relaunch runs on a and b.
    status, attempts, said = _run_fake(tmp_path, monkeypatch,
                                       ['a', 'b', 'c'], 'c')
    assert status == 0, said
    assert attempts == ['a:1,b:1,c:1', 'a:1,b:1'], said
    assert 'leaving c out: rank 2 failed first there (it exited before ' \
        'MPI started)' in said, said


def test_no_host_is_left_out_where_ranks_failed_on_every_host(
        tmp_path, monkeypatch):
    status, attempts, said = _run_fake(tmp_path, monkeypatch,
                                       ['a', 'b', 'c'], 'a b c',
                                       max_restarts=1)
    assert status == 142 and attempts == ['a:1,b:1,c:1'] * 2, said
    assert 'no host left out: ranks failed on every host (a,b,c): the ' \
        'job\'s own error, not a host\'s' in said, said


def test_blamed_hosts_reads_the_ranks_records():
    found = {'start': {}, 'fault': {}, 'failure': {
        3: {'rank': 3, 'who': 'rank 3', 'how': 'uncaught exception',
            'what': 'CUDA error', 'time': 1.0},
        0: {'rank': 0, 'who': 'rank 0', 'how': 'stall', 'what': 'waits',
            'time': 0.5}}}
    hosts = ['a', 'b']
    assert launch_attempt.blamed_hosts(found, {}, [], hosts, 2) == (
        ['b'], 'rank 3 failed first there (uncaught exception)')
    # MPICH names a process a signal ended, not its rank: not taken.
    assert launch_attempt.blamed_hosts(
        None, {'pid': 9, 'host': 'b', 'signal': 9}, [], hosts, 2)[0] == []
    # Open MPI names the rank.
    assert launch_attempt.blamed_hosts(
        None, {'rank': 1, 'pid': 9, 'host': 'a', 'signal': 9}, [], hosts,
        2)[0] == ['a']
    assert launch_attempt.never_started_hosts({'b': [2, 3]}, hosts) == (
        ['b'], 'its ranks did not start within --start-timeout')
    assert launch_attempt.never_started_hosts(
        {'a': [0], 'b': [2]}, hosts)[0] == []


# -- waiting for --min-nodes hosts ------------------------------------------

def test_the_launcher_waits_for_min_nodes_hosts_to_answer():
    probes = []

    def answers(host):   # b answers from its third probe on
        probes.append(host)
        return host == 'a' or probes.count('b') >= 3
    plan, said = _plan(['a', 'b'], 2, answers, probe_interval=0)
    start = time.monotonic()
    assert _hosts(plan.command_for_attempt(60, threading.Event())) == \
        'a:1,b:1'
    assert time.monotonic() - start < 30
    assert '1 of 2 hosts answer, fewer than --min-nodes 2: waiting up to ' \
        '60 s (--wait-for-nodes) for more, probing every 1 s' in said[1], \
        said
    assert 'took back b: it answers again' in said[-2], said


def test_the_wait_for_nodes_ends_at_its_limit_or_at_a_signal():
    plan, said = _plan(['a', 'b'], 2, lambda h: h == 'a', probe_interval=0)
    assert plan.command_for_attempt(1.5) is None
    assert said[-1].startswith('mnopt.launch: 1 of 2 hosts answer, fewer '
                               'than --min-nodes 2: not starting the job')
    assert said[-1].endswith('after waiting 1.5 s (--wait-for-nodes)')
    stopping = threading.Event()
    threading.Timer(0.5, stopping.set).start()
    start = time.monotonic()
    assert plan.command_for_attempt(600, stopping) is None
    assert time.monotonic() - start < 30


# -- take back only on a complete snapshot ----------------------------------

def _touch(folder, *names):
    for name in names:
        with open(os.path.join(folder, name), 'w') as f:
            f.write('x')


def _sets_file(path, n_sets):
    with open(path, 'wb') as f:
        numpy.savez(f, **{elastic_snapshots.N_SETS_KEY: numpy.asarray(n_sets)})


def test_the_recorded_sets_key_is_multi_node_snapshots():
    records = pytest.importorskip('mnopt.extensions.snapshot_records')
    bw = pytest.importorskip('mnopt.extensions.background_writer')
    assert elastic_snapshots.N_SETS_KEY == records.N_SETS_KEY
    assert elastic_snapshots.PARTIAL_PREFIX == bw.PARTIAL_PREFIX


def test_only_complete_snapshots_are_new(tmp_path):
    d = str(tmp_path)
    _touch(d, 'log', 'snapshot_iter_100.npz', 'snapshot_iter_100.rank0.npz',
           'snapshot_iter_100.rank1.npz')
    before = elastic_snapshots.listing(d)
    assert elastic_snapshots.complete(d, 2) == {'snapshot_iter_100': [
        'snapshot_iter_100.npz', 'snapshot_iter_100.rank0.npz',
        'snapshot_iter_100.rank1.npz']}
    time.sleep(0.01)
    # LogReport's log, temporary files, the shared file before the ranks'
    _touch(d, 'log', 'log.tmp', 'snapshot_iter_200.rank0.npz.tmp4242',
           'snapshot_iter_200.npz', 'snapshot_iter_200.rank0.npz',
           '.mnopt-partial.snapshot_iter_200.rank1.npz')
    assert elastic_snapshots.new_since(d, before, 2) == []
    os.replace(os.path.join(d, '.mnopt-partial.snapshot_iter_200.rank1.npz'),
               os.path.join(d, 'snapshot_iter_200.rank1.npz'))
    assert elastic_snapshots.new_since(d, before, 2) == ['snapshot_iter_200']


def test_a_multi_node_snapshot_is_complete_with_every_sets_file(tmp_path):
    d = str(tmp_path)
    # Sharded: each of 2 ranks writes its file, the first records 2 sets.
    _sets_file(os.path.join(d, 'snapshot_iter_300.0'), 2)
    assert elastic_snapshots.new_since(d, {}, 2) == []
    _touch(d, 'snapshot_iter_300.1')
    assert elastic_snapshots.new_since(d, {}, 2) == ['snapshot_iter_300']
    # One replica set: rank 0's file is the snapshot.
    _sets_file(os.path.join(d, 'snapshot_iter_400.0'), 1)
    assert 'snapshot_iter_400' in elastic_snapshots.new_since(d, {}, 2)
    # An earlier run's file of the same name completes nothing.
    before = elastic_snapshots.listing(d)
    time.sleep(0.01)
    _sets_file(os.path.join(d, 'snapshot_iter_300.0'), 2)
    assert elastic_snapshots.new_since(d, before, 2) == []
    # A partial file a crash left, older than the file: no write in flight.
    _touch(d, '.mnopt-partial.snapshot_iter_500')
    time.sleep(0.01)
    _touch(d, 'snapshot_iter_500')
    assert elastic_snapshots.new_since(d, before, 2) == ['snapshot_iter_500']


def test_a_take_back_waits_for_a_complete_snapshot(tmp_path):
    answers = iter([False, True] + [True] * 20)
    said = []
    pool = elastic.HostPool(['a', 'b'], lambda h: None if h == 'a' or
                            next(answers) else 'down', said.append)
    plan = elastic.ElasticPlan(pool, 1, 2, ['python', 't.py'],
                               flavour='hydra', rejoin_dir=str(tmp_path),
                               probe_interval=0)
    assert _hosts(plan.command_for_attempt()) == 'a:2'
    assert not plan.time_to_take_back()   # b answers: the watch begins
    time.sleep(0.01)
    _touch(str(tmp_path), 'log', 'snapshot_iter_1.npz',
           'snapshot_iter_1.rank0.npz')
    assert not plan.time_to_take_back()
    _touch(str(tmp_path), 'snapshot_iter_1.rank1.npz')
    assert plan.time_to_take_back()
    assert 'a complete snapshot was written (snapshot_iter_1)' in said[-1]


def test_snapshots_named_as_the_user_picked_and_names_with_dots(tmp_path):
    d = str(tmp_path)
    # Chainer's snapshot_epoch_{.updater.epoch_detail}: dots in the name.
    _touch(d, 'snapshot_epoch_1.5')
    assert elastic_snapshots.new_since(d, {}, 2) == ['snapshot_epoch_1.5']
    _touch(d, 'snapshot_1.5.0', 'snapshot_1.5.1')   # multi_node_snapshot
    assert 'snapshot_1.5' in elastic_snapshots.new_since(d, {}, 2)
    # Names the user picked: --snapshot-pattern.
    _touch(d, 'model_iter_8.0', 'model_iter_8.tmp42')
    assert 'model_iter_8' not in elastic_snapshots.new_since(d, {}, 2)
    assert elastic_snapshots.new_since(d, {}, 2, 'model_iter_*') == [
        'model_iter_8']


def test_files_but_no_snapshot_named_as_the_pattern_are_said_once(
        tmp_path):
    plan, said = _plan(['a', 'b'], 1, lambda h: h == 'a' or len(said) > 1,
                       rejoin_dir=str(tmp_path), probe_interval=0)
    assert _hosts(plan.command_for_attempt()) == 'a:1'
    assert not plan.time_to_take_back()   # b answers: the watch begins
    assert 'b answers again' in said[-1], said
    for i in range(5):
        time.sleep(0.01)
        _touch(str(tmp_path), 'model_iter_%d' % i)
        assert not plan.time_to_take_back()
    warned = [s for s in said if 'files keep appearing' in s]
    assert len(warned) == 1 and 'none a snapshot named as ' \
        '--snapshot-pattern snapshot*' in warned[0], said


def test_a_take_back_folder_that_is_not_there_is_an_error(tmp_path):
    with pytest.raises(ValueError, match='no such folder'):
        _plan(['a', 'b'], 1, rejoin_dir=str(tmp_path / 'reslt'))
    done = launch('--hosts', 'a,b', '--probe', 'true',
                  '--take-back-after-snapshot', str(tmp_path / 'reslt'),
                  '--', 'python', 'x.py')
    assert done.returncode == 2 and 'no such folder' in done.stderr, done


# -- exit statuses ----------------------------------------------------------

def test_statuses_are_said_with_signal_names():
    assert launcher.describe(3) == 'exited with status 3'
    assert launcher.describe(-15) == 'was ended by SIGTERM'
    probe = elastic_probe.command_probe("sh -c 'kill -KILL $$'")
    assert probe('a') == 'the probe was ended by SIGKILL'


def test_the_launcher_exits_1_where_the_last_attempt_never_started(
        tmp_path):
    fake = tmp_path / 'mpiexec'
    fake.write_text('#!/bin/sh\nexec sleep 600\n')
    fake.chmod(0o755)
    done = launch('--hosts', 'a,b', '--probe', 'true', '--mpiexec',
                  str(fake), '--start-timeout', '1', '--stop-timeout', '5',
                  '--max-restarts', '0', '--', 'python', 'x.py',
                  cwd=str(tmp_path))
    assert done.returncode == 1, done.stderr
    assert 'the job never started after' in done.stderr
    assert 'status -' not in done.stderr
