"""Relaunch a training job that died, up to a number of times (as torchrun
does), so a crashed rank or node costs only the work since the last
snapshot.

    python -m mnopt.launch --max-restarts 3 -- \\
        mpiexec -n 8 python -m mpi4py train.py --resume auto

The launcher starts the command (mpiexec, srun, or anything that runs the
whole job and exits non-zero when it fails), waits, and if it failed starts
it again, unchanged, with ``MNOPT_RESTART`` set to the attempt number (0
first).  The script resumes itself from the newest snapshot that every rank
holds completely (the ImageNet example: ``--resume auto``; see
docs/reliability.md).  It does not manage processes: MPI's launcher (or
Slurm) starts and ends the ranks, and ends them all when one dies.

Elastic (``--hosts h1,h2,...``, ``--hostfile F``, or inside a Slurm
allocation, with ``--min-nodes K --procs-per-node P``): the command after
``--`` is each process's (``python train.py --resume auto``), and the
launcher starts mpiexec itself, on the hosts that answer a short probe
(mnopt/elastic.py), before every attempt: a failure is relaunched on the
hosts still answering, as long as at least K do, and a host that answers
again is taken back at the next attempt (with
``--take-back-after-snapshot DIR``, a running job is ended on purpose
after the next snapshot in DIR to take it back, which is no failure).
It says which hosts it dropped or took back, and why.

It stops at the first success, at ``--max-restarts`` failures in a row, or
when interrupted (SIGINT/SIGTERM are passed to the job, which is then not
restarted).  Its exit status is the last attempt's.

After each failed attempt it prints one failure summary
(mnopt/failure_summary.py): which rank failed first, how, its traceback,
and what the other ranks were doing.  The ranks write their records to a
folder it gives them in ``MNOPT_FAILURE_DIR`` (made in the current
directory, which a cluster's nodes usually share; removed after the
attempt); a rank that a signal ended writes nothing, and is named from
what MPI's launcher says on stderr (which passes through this one).
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from mnopt import elastic
from mnopt.elastic import SSH_PROBE
from mnopt import failure_summary
from mnopt import log as _log

logger = _log.get('mnopt.launch')   # also when run as __main__


#: What MPI's launchers say of a rank that a signal ended: MPICH's Hydra
#: (its pid and host, then the signal), Open MPI's (all on one line).
HYDRA_PID = re.compile(rb'PID (\d+) RUNNING AT (\S+)')
HYDRA_SIGNAL = re.compile(rb'EXIT STRING: .*\(signal (\d+)\)')
OPEN_MPI = re.compile(rb'process rank (\d+) with PID (\d+) on node (\S+) '
                      rb'exited on signal (\d+)')


#: How long the job's stderr may stay open after the job ended (a rank
#: its launcher left behind holds it) before the summary is printed.
READ_S = 5.0


def _forward(source, into, ended):
    """Copy the job's stderr ``source`` to ``into`` line by line, noting
    in ``ended`` the rank a signal ended, as the MPI launcher says it."""
    where = {}
    for line in iter(source.readline, b''):
        try:
            into.write(line)
            into.flush()
        except (OSError, ValueError):
            pass
        found = HYDRA_PID.search(line)
        if found:
            where = {'pid': int(found.group(1)),
                     'host': found.group(2).decode(errors='replace')}
        found = HYDRA_SIGNAL.search(line)
        if found and where and not ended:
            ended.update(where, signal=int(found.group(1)))
        found = OPEN_MPI.search(line)
        if found and not ended:
            ended.update(rank=int(found.group(1)), pid=int(found.group(2)),
                         host=found.group(3).decode(errors='replace'),
                         signal=int(found.group(4)))


def _failure_folder():
    """A fresh folder for the ranks' records: in the current directory
    (shared by the nodes, usually), else the temporary one."""
    for where in (os.getcwd(), None):
        try:
            return tempfile.mkdtemp(prefix='.mnopt-failure-', dir=where)
        except OSError:
            pass
    return None


def _attempt(command, env):
    """Start one attempt; returns (the child, the folder for the ranks'
    records, {what the MPI launcher said of a rank a signal ended}, the
    threads forwarding the job's output)."""
    folder = _failure_folder()
    if folder is not None:
        env = dict(env, **{failure_summary.FOLDER_VARIABLE: folder})
    # MPICH's Hydra reports a rank's end on stdout, Open MPI on stderr.
    into = [getattr(stream, 'buffer', None)
            for stream in (sys.stdout, sys.stderr)]
    if None in into:   # a stream swapped for a text one: not followed
        return subprocess.Popen(command, env=env), folder, {}, []
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    ended = {}
    readers = [threading.Thread(target=_forward, daemon=True,
                                args=(source, out, ended))
               for source, out in zip((child.stdout, child.stderr), into)]
    for reader in readers:
        reader.start()
    return child, folder, ended, readers


def _wait(child, plan, stopping):
    """(the job's exit status, whether the launcher ended it on purpose to
    take a host back: elastic.ElasticPlan.time_to_take_back)."""
    if plan is None or not plan.takes_back():
        return child.wait(), False
    while True:
        try:
            return child.wait(timeout=plan.probe_interval), False
        except subprocess.TimeoutExpired:
            if not stopping.is_set() and plan.time_to_take_back():
                child.terminate()
                return child.wait(), True


def run(command, max_restarts=3, delay=1.0, log=None, plan=None):
    """Run ``command`` (an argv list) until it succeeds or has failed
    ``max_restarts + 1`` times; returns the last exit status.  With
    ``plan`` (elastic.ElasticPlan) each attempt's command is the plan's,
    on the hosts that answer; too few of them end the launcher (status
    1, or the last attempt's).

    Each failure and an interruption are reported as WARNING records of
    logger ``mnopt.launch`` (mnopt/log.py: by default on stderr), or
    written to ``log`` (a text stream) where one is given."""
    def say(text):
        if log is None:
            logger.warning('%s', text)
        else:
            log.write(text + '\n')
            log.flush()

    stopping = threading.Event()

    def forward(signum, frame):
        stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    child = None
    status = 1
    previous = {s: signal.signal(s, forward)
                for s in (signal.SIGINT, signal.SIGTERM)}
    if plan is not None:
        plan.pool.say = say
    try:
        attempt = failures = 0
        on_purpose = False
        while failures <= max_restarts:
            env = dict(os.environ, MNOPT_RESTART=str(attempt))
            attempt += 1
            argv = command if plan is None else plan.command_for_attempt()
            if argv is None:
                return status
            if on_purpose and plan.missed_take_back:
                # A restart that gained no host is a failure: a host that
                # flaps must not restart the job forever.
                failures += 1
                say('mnopt.launch: the restart to take %s back gained no '
                    'host: it counts as a failure (%d of %d)' % (
                        ','.join(plan.missed_take_back), failures,
                        max_restarts + 1))
                if failures > max_restarts:
                    say('mnopt.launch: no restarts left')
                    return status
            if stopping.is_set():   # a signal while the hosts were probed
                say('mnopt.launch: interrupted; not starting the job')
                return status
            start = time.monotonic()
            child, folder, ended, readers = _attempt(argv, env)
            status, on_purpose = _wait(child, plan, stopping)
            for reader in readers:   # its output out before the summary
                reader.join(READ_S)
            found = failure_summary.read_folder(folder) if folder else None
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            if status == 0 or stopping.is_set():
                return status
            if on_purpose:   # to take a host back: no failure
                continue
            failures += 1
            left = max_restarts + 1 - failures
            if found is not None:
                say('\n'.join(failure_summary.launcher_block(
                    found, status, failures, max_restarts + 1,
                    ended or None)))
            say('mnopt.launch: the job exited with status %d after '
                '%.1f s (attempt %d of %d)%s' % (
                    status, time.monotonic() - start, failures,
                    max_restarts + 1,
                    '; restarting in %g s' % delay if left else
                    '; no restarts left'))
            # A signal during the delay ends the launcher: the user, or the
            # scheduler, asked it to stop, so no attempt may start after it.
            if left and stopping.wait(delay):
                say('mnopt.launch: interrupted; not restarting')
                return status
        return status
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv=None):
    p = argparse.ArgumentParser(
        prog='python -m mnopt.launch',
        description='Relaunch a job that failed, so it resumes from its '
                    'newest complete snapshot.',
        usage='%(prog)s [--max-restarts N] [--delay S] -- COMMAND ...\n'
              '       %(prog)s [--hosts H1,H2,... | --hostfile F] '
              '--min-nodes K --procs-per-node P [--probe CMD] -- '
              'python train.py ...')
    from mnopt import cli
    p.add_argument('--max-restarts', type=cli.nonnegative_int, default=3,
                   metavar='N', help='restarts after failures (default 3)')
    p.add_argument('--delay', type=cli.nonnegative_float, default=1.0,
                   metavar='S', help='seconds between a failure and the '
                   'restart (default 1)')
    p.add_argument('--hosts', metavar='H1,H2,...',
                   help='elastic: the hosts to run on (each attempt on '
                   'those that answer the probe)')
    p.add_argument('--hostfile', metavar='FILE',
                   help='elastic: the hosts, one a line')
    p.add_argument('--min-nodes', type=cli.positive_int, metavar='K',
                   help='elastic: the fewest hosts to start an attempt on '
                   '(default 1)')
    p.add_argument('--procs-per-node', type=cli.positive_int, metavar='P',
                   help='elastic: processes per host (default 1)')
    p.add_argument('--probe', default=SSH_PROBE, metavar='CMD',
                   help='elastic: the command that tells whether {host} '
                   'answers (default: %(default)s)')
    p.add_argument('--probe-timeout', type=cli.positive_float,
                   default=15.0, metavar='S',
                   help='elastic: seconds a probe may take before its host '
                   'counts as not answering; hosts are probed at once '
                   '(default %(default)g)')
    p.add_argument('--mpiexec', default='mpiexec', metavar='PATH',
                   help='elastic: the MPI launcher to start (default '
                   'mpiexec)')
    p.add_argument('--take-back-after-snapshot', metavar='DIR',
                   help='elastic: while a host is left out, probe it every '
                   '--probe-interval; once it answers, end the job after '
                   'the next snapshot written in DIR and relaunch with it')
    p.add_argument('--probe-interval', type=cli.nonnegative_float,
                   default=30.0, metavar='S',
                   help='elastic: seconds between probes of the hosts left '
                   'out, with --take-back-after-snapshot (default 30)')
    p.add_argument('command', nargs=argparse.REMAINDER,
                   help='the job: mpiexec ..., srun ...')
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ['--'] \
        else args.command
    if not command:
        p.error('no command given (put it after --)')
    plan = None
    if args.hosts or args.hostfile or args.min_nodes or \
            args.procs_per_node or args.take_back_after_snapshot:
        plan = _elastic_plan(p, args, command)
    return run(command, args.max_restarts, args.delay, plan=plan)


#: Launchers an elastic command must not start with: the launcher runs
#: mpiexec itself.
_LAUNCHERS = ('mpiexec', 'mpirun', 'srun', 'orterun')


def _elastic_plan(p, args, command):
    if os.path.basename(command[0]) in _LAUNCHERS:
        p.error('with --hosts/--hostfile/--min-nodes the command after -- '
                'is each process\'s (python train.py ...): the launcher '
                'starts %s itself' % args.mpiexec)
    try:
        hosts = elastic.hosts_from(args.hosts, args.hostfile)
    except (OSError, ValueError) as e:
        p.error(str(e))
    min_nodes = args.min_nodes or 1
    if min_nodes > len(hosts):
        p.error('--min-nodes %d is more than the %d hosts given (%s)'
                % (min_nodes, len(hosts), ','.join(hosts)))
    pool = elastic.HostPool(hosts, elastic.command_probe(
        args.probe, args.probe_timeout),
                            say=None)
    return elastic.ElasticPlan(pool, min_nodes, args.procs_per_node or 1,
                               command, mpiexec=args.mpiexec,
                               rejoin_dir=args.take_back_after_snapshot,
                               probe_interval=args.probe_interval)


if __name__ == '__main__':
    sys.exit(main())
