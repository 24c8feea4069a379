#!/usr/bin/env python
"""Lose a node, keep training, measured on the simulated cluster
(mnopt/netsim.py): the ImageNet example under ``python -m mnopt.launch
--hosts <the nodes> --min-nodes K``; once the job is past its k-th
snapshot, every process of one node is killed and the node's link taken
down (its probe then fails); the launcher relaunches on the nodes left,
which resume mid-epoch from the newest complete snapshot.  Once the new
attempt has stepped, the node's link comes back up, and the launcher
(``--take-back-after-snapshot``) restarts the job after the next snapshot
to take it back.

Measured per scenario: seconds from the kill to the first step of the
new attempt, the iterations redone (the iteration rank 0 had reached at
the kill minus the one the new attempt resumed from), the hosts of each
attempt, and the final validation accuracy, against an uninterrupted run
on every node that saw the same samples (the same epochs).

The real run (root; 80 training images per class, 20 iterations an
epoch at 4 ranks, 40 epochs, a snapshot every 4 iterations, each kill
after the attempt's 3rd snapshot and half an interval; about 12 minutes
on a quiet 2-core machine):

    sudo .venv/numpy2/bin/python benchmarks/elastic_kill.py --epochs 40 \\
        --json docs/results/netsim/elastic_kill.json

(the table goes beside the JSON, the same name ending in ``.md``, unless
``--markdown PATH`` says where).

The smallest check (2 nodes, one kill, a few iterations; prints, writes
nothing): ``... benchmarks/elastic_kill.py --dry-run``.

How the launcher reaches the simulated nodes: ``--mpiexec`` is a script
that enters node 0's namespace and runs hydra's mpiexec there with
``-launcher ssh -launcher-exec`` a script that enters the namespace of the
host named (its address, 10.231.7.10 + k), as ``netsim exec`` does; the
probe connects from node 0 to the node (a refused connection: up; no
answer: down).  mpiexec runs in node 0, so node 0 is never the one lost.
Everything is bounded by timeouts; the cluster is torn down at the end
(also on errors and interruptions).
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, 'examples', 'imagenet', 'train_imagenet.py')
WAIT_S = int(os.environ.get('ELASTIC_KILL_WAIT_S', 600))  # any one wait
STEPS_NAME = 'steps.txt'

#: hydra's ssh launcher calls: SCRIPT [ssh options] HOST COMMAND...; enter
#: the namespace of node HOST (10.231.7.(10 + k)) with its own hostname.
LAUNCHER = '''#!/bin/sh
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
k=$(( ${host##*.} - %(first)d ))
exec ip netns exec %(prefix)sn$k unshare --uts sh -c \\
    'hostname "$0" && eval "exec $1"' %(prefix)sn$k "$*"
'''

#: What mnopt.launch runs as mpiexec: hydra's, inside node 0.
MPIEXEC = '''#!/bin/sh
exec ip netns exec %(node0)s unshare --uts sh -c \\
    'hostname "$0" && exec "$@"' %(node0)s %(mpiexec)s -launcher ssh \\
    -launcher-exec %(launcher)s -iface eth0 -genv UCX_TLS tcp %(env)s "$@"
'''


def as_rank(steps, argv):
    """Each process: the example, rank 0 appending 'attempt iteration
    time ranks' to ``steps`` after every step."""
    import runpy
    from mpi4py import MPI
    import chainer
    comm = MPI.COMM_WORLD
    attempt = os.environ.get('MNOPT_RESTART', '0')
    run = chainer.training.Trainer.run

    def record(trainer):
        with open(steps, 'a') as f:
            f.write('%s %d %.6f %d\n' % (attempt, trainer.updater.iteration,
                                         time.time(), comm.size))

    def run_recorded(self, *args, **kwargs):
        if comm.rank == 0:
            self.extend(record, trigger=(1, 'iteration'),
                        name='elastic_kill_steps')
        return run(self, *args, **kwargs)
    chainer.training.Trainer.run = run_recorded
    sys.argv = [TRAIN] + argv
    runpy.run_path(TRAIN, run_name='__main__')


def probe(host, marks):
    """Exit status 0 if ``host`` answers (a connection refused), from
    inside node 0's namespace, and is not marked down in ``marks`` (the
    mark comes before the kill: a relaunch that probes before the link
    is down must not pick the node)."""
    if os.path.exists(os.path.join(marks, 'down-' + host)):
        return 1
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((host, 9))
    except ConnectionRefusedError:
        return 0
    except OSError:
        return 1
    finally:
        s.close()
    return 0


def read_steps(path):
    """[(attempt, iteration, time, ranks)] rank 0 recorded so far."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    steps = []
    for line in lines:
        parts = line.split()
        if len(parts) == 4:
            steps.append((int(parts[0]), int(parts[1]), float(parts[2]),
                          int(parts[3])))
    return steps


def wait_for(what, done, deadline, child):
    while not done():
        if child.poll() is not None:
            raise RuntimeError('the job ended (status %d) while waiting for '
                               '%s' % (child.returncode, what))
        if time.monotonic() > deadline:
            raise RuntimeError('timed out waiting for %s' % what)
        time.sleep(0.05)


def lose_node(netsim, k):
    """Kill every process in node k's namespace, then take its link down
    (the FIN of its sockets leaves first, as at a crash of the processes;
    the link down keeps the probe from answering)."""
    ns = netsim.node_name(k)
    kill_all(ns)
    time.sleep(0.5)
    set_link(netsim, k, 'down')


def kill_all(ns):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = subprocess.run(['ip', 'netns', 'pids', ns], capture_output=True,
                              text=True, timeout=30).stdout.split()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.05)
    else:
        raise RuntimeError('processes left in %s' % ns)


def set_link(netsim, k, state):
    subprocess.run(['ip', '-n', netsim.SWITCH, 'link', 'set', 'p%d' % k,
                    state], check=True, timeout=30)


def scenario(netsim, tools, name, nodes, min_nodes, lose, flags, args, work):
    """Run one job; ``lose``: the nodes to lose, one after the other, each
    once the job (on its newest attempt) is past ``args.kill_after``
    snapshots and half an interval.  Returns the measurements."""
    out = os.path.join(work, name)
    os.makedirs(out)   # --take-back-after-snapshot's folder must exist
    steps = os.path.join(work, name + '-' + STEPS_NAME)
    interval = args.snapshot_interval
    hosts = [netsim.node_address(k) for k in range(nodes)]
    py = sys.executable
    launch = [
        py, '-m', 'mnopt.launch', '--hosts', ','.join(hosts),
        '--min-nodes', str(min_nodes), '--procs-per-node', '1',
        '--delay', '0', '--max-restarts', str(len(lose) + 1),
        '--probe', 'ip netns exec %s %s %s --probe {host} %s' % (
            netsim.node_name(0), py, os.path.abspath(__file__), work),
        '--probe-timeout', '10', '--mpiexec', tools['mpiexec'],
        '--take-back-after-snapshot', out, '--probe-interval', '1', '--',
        py, '-m', 'mpi4py', os.path.abspath(__file__), '--as-rank', steps,
        '--', '--out', out, '--data-cache', tools['data'], '--arch',
        'smallcnn', '--batchsize', str(args.batchsize), '--cpu', '--noplot',
        '--epoch', str(args.epochs), '--snapshot-interval', str(interval),
        '--resume', 'auto', '--async-snapshots', '--seed', '0'] + flags
    log_path = os.path.join(work, name + '.log')
    result = {'scenario': name, 'nodes': nodes, 'min_nodes': min_nodes,
              'flags': ' '.join(flags), 'losses': []}
    began = time.monotonic()
    with open(log_path, 'wb') as log:
        child = subprocess.Popen(launch, stdout=log, stderr=subprocess.STDOUT,
                                 cwd=work, env=dict(
                                     os.environ, PYTHONPATH=REPO))
        try:
            deadline = time.monotonic() + WAIT_S
            for k in lose:
                attempt = max([s[0] for s in read_steps(steps)] or [0])
                first = [s[1] for s in read_steps(steps) if s[0] == attempt]
                start = first[0] - 1 if first else 0
                kill_at = start + args.kill_after * interval + interval // 2
                wait_for('iteration %d' % kill_at, lambda: any(
                    s[0] == attempt and s[1] >= kill_at
                    for s in read_steps(steps)), deadline, child)
                open(os.path.join(work, 'down-' + hosts[k]), 'w').close()
                killed = time.time()   # the kill's start: the clock runs
                lose_node(netsim, k)
                reached = max(s[1] for s in read_steps(steps)
                              if s[0] == attempt)
                wait_for('the relaunch', lambda: any(
                    s[0] > attempt for s in read_steps(steps)),
                    deadline, child)
                new = [s for s in read_steps(steps) if s[0] > attempt][0]
                result['losses'].append({
                    'node': k, 'iteration_at_kill': reached,
                    'resumed_at': new[1] - 1, 'redone': reached - new[1] + 1,
                    'seconds_to_first_step': round(new[2] - killed, 2),
                    'ranks_after': new[3]})
            for k in lose:
                set_link(netsim, k, 'up')
                os.remove(os.path.join(work, 'down-' + hosts[k]))
            child.wait(timeout=max(1, deadline - time.monotonic()))
        except BaseException:
            child.terminate()
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            raise
    result['seconds'] = round(time.monotonic() - began, 1)
    result['status'] = child.returncode
    attempts = {}
    for s in read_steps(steps):
        attempts.setdefault(s[0], s[3])
    result['ranks_per_attempt'] = [attempts[a] for a in sorted(attempts)]
    result['accuracy'] = final_accuracy(out)
    result['log'] = log_path
    return result


def final_accuracy(out):
    try:
        with open(os.path.join(out, 'log')) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        return None
    found = [e['validation/main/accuracy'] for e in entries
             if 'validation/main/accuracy' in e]
    return round(found[-1], 4) if found else None


#: Training images per class (8 classes): the real run's 640 make 20
#: iterations an epoch at 4 ranks x batch 8, so that the kill (a snapshot
#: interval of 4, plus half of one) and the take-back (a snapshot after
#: the node is back) both land inside the run; the dry run's 10 only
#: prove the machinery.
IMAGES_PER_CLASS = 80
DRY_RUN_IMAGES_PER_CLASS = 10


def tools_in(work, netsim, dry_run=False):
    launcher = os.path.join(work, 'launch.sh')
    with open(launcher, 'w') as f:
        f.write(LAUNCHER % {'first': netsim.FIRST_HOST,
                            'prefix': netsim.PREFIX})
    mpiexec = os.path.join(work, 'mpiexec.sh')
    env = ' '.join('-genv %s %s' % kv
                   for kv in netsim.blas_threads_env(4))
    with open(mpiexec, 'w') as f:
        f.write(MPIEXEC % {'node0': netsim.node_name(0), 'env': env,
                           'mpiexec': netsim.hydra_mpiexec(),
                           'launcher': launcher})
    for path in (launcher, mpiexec):
        os.chmod(path, 0o755)
    sys.path.insert(0, os.path.join(REPO, 'examples', 'imagenet'))
    import embedded_data
    data = os.path.join(work, 'embedded')
    embedded_data.build(data, n_train=DRY_RUN_IMAGES_PER_CLASS if dry_run
                        else IMAGES_PER_CLASS, n_val=10)
    return {'launcher': launcher, 'mpiexec': mpiexec, 'data': data}


def plan(dry_run):
    """(name, nodes, min nodes, nodes lost in turn, example flags)."""
    if dry_run:
        return [('dry-run-kill-1-of-2', 2, 1, [1], ['--double-buffering'])]
    db, ss = ['--double-buffering'], ['--shard-state']
    return [('uninterrupted-4-double-buffering', 4, 3, [], db),
            ('lose-1-of-4-double-buffering', 4, 3, [3], db),
            ('uninterrupted-4-shard-state', 4, 3, [], ss),
            ('lose-1-of-4-shard-state', 4, 3, [3], ss),
            ('lose-2-of-4-double-buffering', 4, 2, [3, 2], db)]


def markdown(results, command):
    lines = ['# Losing a node on the simulated cluster', '',
             'Command: `%s`' % command, '',
             '| scenario | ranks per attempt | node lost | iteration at '
             'kill | resumed at | redone | s from kill to first step | '
             'final accuracy |', '|---|---|---|---|---|---|---|---|']
    for r in results:
        losses = r['losses'] or [{}]
        for i, loss in enumerate(losses):
            lines.append('| %s | %s | %s | %s | %s | %s | %s | %s |' % (
                r['scenario'] if i == 0 else '',
                ' > '.join(map(str, r['ranks_per_attempt'])) if i == 0
                else '', loss.get('node', '-'),
                loss.get('iteration_at_kill', '-'),
                loss.get('resumed_at', '-'), loss.get('redone', '-'),
                loss.get('seconds_to_first_step', '-'),
                r['accuracy'] if i == 0 else ''))
    return '\n'.join(lines) + '\n'


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ['--as-rank']:
        return as_rank(argv[1], argv[3:] if argv[2:3] == ['--'] else argv[2:])
    if argv[:1] == ['--probe']:
        return probe(argv[1], argv[2])
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--dry-run', action='store_true',
                   help='2 nodes, one kill, a few iterations; writes nothing')
    p.add_argument('--epochs', type=int, default=None)
    p.add_argument('--batchsize', type=int, default=8)
    p.add_argument('--snapshot-interval', type=int, default=None)
    p.add_argument('--kill-after', type=int, default=3,
                   help='snapshots of the attempt before each kill')
    p.add_argument('--rate', default='1gbit')
    p.add_argument('--json')
    p.add_argument('--markdown')
    p.add_argument('--keep', action='store_true',
                   help='keep the work folder (logs, snapshots)')
    args = p.parse_args(argv)
    if args.dry_run and (args.json or args.markdown):
        p.error('a dry run writes no results')
    if args.json and not args.markdown:
        args.markdown = os.path.splitext(args.json)[0] + '.md'
    args.epochs = args.epochs or (1 if args.dry_run else 40)
    args.snapshot_interval = args.snapshot_interval or (2 if args.dry_run
                                                        else 4)
    sys.path.insert(0, REPO)
    from mnopt import netsim
    scenarios = plan(args.dry_run)
    work = tempfile.mkdtemp(prefix='mnopt-elastic-kill-')
    results = []
    try:
        netsim.up(max(s[1] for s in scenarios), rate=args.rate)
        tools = tools_in(work, netsim, args.dry_run)
        for name, nodes, min_nodes, lose, flags in scenarios:
            r = scenario(netsim, tools, name, nodes, min_nodes, lose, flags,
                         args, work)
            print(json.dumps(r), flush=True)
            results.append(r)
    finally:
        for ns in netsim.namespaces():   # nothing left running in them
            kill_all(ns)
        netsim.down()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    command = 'sudo .venv/numpy2/bin/python benchmarks/elastic_kill.py ' + \
        ' '.join(argv)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'command': command, 'rate': args.rate,
                       'results': results}, f, indent=1)
    text = markdown(results, command)
    if args.markdown:
        with open(args.markdown, 'w') as f:
            f.write(text)
    print(text)
    return 0 if all(r['status'] == 0 for r in results) else 1


if __name__ == '__main__':
    sys.exit(main())
