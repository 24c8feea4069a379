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
(mnopt/launch/elastic.py), before every attempt: a failure is relaunched on the
hosts still answering, as long as at least K do (waiting up to
``--wait-for-nodes`` seconds for them), the host the failure names (its
ranks failed first, or never started) is left out for a while where K
others answer, and a host that answers again is taken back at the next
attempt (with ``--take-back-after-snapshot DIR``, a running job is ended
on purpose after the next complete snapshot in DIR to take it back,
which is no failure).  It says which hosts it dropped, left out or took
back, and why.

It stops at the first success, at ``--max-restarts`` failures in a row, or
when interrupted: SIGINT/SIGTERM (SIGHUP/SIGQUIT too, passed on as
SIGTERM) are passed to every process of the attempt's process group (its
own: mnopt/launch/attempt.py), which is killed if it has not ended
``--stop-timeout`` seconds later, and the launcher exits with 128 + the
signal's number (with the last attempt's status where the signal came
between attempts).  Otherwise its exit status is the last attempt's (128
+ N where signal N ended it), or 1 where the last attempt never started:
an elastic attempt whose ranks do not all start (import mnopt) within
``--start-timeout`` seconds is ended the same way and counts as a
failure (an MPI launcher waits for ever for a host that died after its
probe).

After each failed attempt it prints one failure summary
(mnopt/common/failure_summary.py): which rank failed first, how, its traceback,
and what the other ranks were doing.  The ranks write their records to a
folder it gives them in ``MNOPT_FAILURE_DIR`` (made in the current
directory, which a cluster's nodes usually share; removed after the
attempt); a rank that a signal ended writes nothing, and is named from
what MPI's launcher says on stderr (which passes through this one).
"""

import argparse
import os
import signal
import sys
import threading
import time

from mnopt.launch import elastic
from mnopt.launch import probe as elastic_probe
from mnopt.launch.probe import SSH_PROBE
from mnopt.launch import hosts as elastic_hosts
from mnopt.common import failure_summary
from mnopt.launch import attempt as launch_attempt
from mnopt.common import log as _log

logger = _log.get('mnopt.launch')   # also when run as __main__


#: Seconds an attempt's processes have, after the launcher passed them a
#: signal, before it kills them (SIGKILL): under Slurm's default KillWait
#: of 30 s the launcher ends its job before Slurm ends the launcher.
STOP_TIMEOUT_S = 20.0
#: Seconds every rank of an elastic attempt has to note its start.
START_TIMEOUT_S = 300.0
#: Seconds an elastic launcher waits for --min-nodes hosts to answer
#: before an attempt (a node's reboot takes minutes).
WAIT_FOR_NODES_S = 300.0
#: The launcher's status where the last attempt never started (it ended
#: the attempt itself: not the job's status, nor a signal's).
NEVER_STARTED = 1
#: The signals that stop the launcher and its attempt; the attempt's
#: group gets SIGTERM for SIGHUP and SIGQUIT (which MPI's launchers may
#: not clean up after).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def describe(status):
    """``exited with status 3``, or ``was ended by SIGTERM`` for a
    process a signal ended (Popen's negative status)."""
    return 'exited with status %d' % status if status >= 0 else \
        'was ended by %s' % failure_summary.signal_name(-status)


def run(command, max_restarts=3, delay=1.0, log=None, plan=None,
        start_timeout=START_TIMEOUT_S, stop_timeout=STOP_TIMEOUT_S,
        wait_for_nodes=WAIT_FOR_NODES_S):
    """Run ``command`` (an argv list) until it succeeds or has failed
    ``max_restarts + 1`` times; returns the last exit status (Popen's:
    -N where signal N ended it; 128 + the signal's number where SIGINT,
    SIGTERM, SIGHUP or SIGQUIT stopped an attempt; ``NEVER_STARTED``
    where the last attempt never started).  With ``plan``
    (elastic.ElasticPlan) each attempt's command is the plan's, on the
    hosts that answer; too few of them, still after ``wait_for_nodes``
    seconds, end the launcher (status 1, or the last attempt's); an
    attempt whose ranks do not all note their start within
    ``start_timeout`` seconds (0: no limit) is ended and counts as a
    failure; the host a failure names is left out of the next attempts
    while enough others answer.  A signal is passed to the attempt's
    whole process group, which is killed ``stop_timeout`` seconds later.

    Each failure and an interruption are reported as WARNING records of
    logger ``mnopt.launch`` (mnopt/common/log.py: by default on stderr), or
    written to ``log`` (a text stream) where one is given."""
    def say(text):
        if log is None:
            logger.warning('%s', text)
        else:
            log.write(text + '\n')
            log.flush()

    stopping = threading.Event()
    running = []   # the attempt running now, if any

    def forward(signum, frame):
        if not stopping.is_set():
            stopping.signum, stopping.at = signum, time.monotonic()
            stopping.set()
        passed = signum if signum in (signal.SIGINT, signal.SIGTERM) \
            else signal.SIGTERM
        for attempt in running:
            attempt.signal_group(passed)

    status = 1
    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    if plan is not None:
        plan.pool.say, plan.pool.stopping = say, stopping
    try:
        attempt_number = failures = 0
        why = None
        while failures <= max_restarts:
            env = dict(os.environ, MNOPT_RESTART=str(attempt_number))
            attempt_number += 1
            argv = command if plan is None else plan.command_for_attempt(
                wait_for_nodes, stopping)
            if stopping.is_set():   # a signal while the hosts were probed
                say('mnopt.launch: interrupted; not starting the job')
                return 128 + stopping.signum
            if argv is None:
                return status
            if why == 'take back' and plan.missed_take_back:
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
            start = time.monotonic()
            attempt = launch_attempt.Attempt(argv, env)
            running.append(attempt)
            try:
                attempt.start()
                if stopping.is_set():   # a signal while it was started
                    forward(stopping.signum, None)
                status, why = launch_attempt.watch(
                    attempt, plan, stopping, start_timeout, stop_timeout,
                    say)
            finally:
                running.remove(attempt)
                # Nothing an attempt started outlives it: a rank MPI's
                # launcher left behind is killed before the next attempt.
                attempt.signal_group(signal.SIGKILL)
            missing = launch_attempt.never_started(
                attempt.started_ranks(), plan.hosts, plan.procs_per_node) \
                if why == 'never started' else None
            found = attempt.finish()
            if stopping.is_set():
                say('mnopt.launch: interrupted (%s); the job %s; not '
                    'restarting' % (signal.Signals(stopping.signum).name,
                                    describe(status)))
                return 128 + stopping.signum
            if status == 0:
                return status
            if why == 'take back':   # to take a host back: no failure
                continue
            failures += 1
            left = max_restarts + 1 - failures
            if why == 'never started':
                status = NEVER_STARTED
            elif found is not None:
                say('\n'.join(failure_summary.launcher_block(
                    found, status if status >= 0 else 128 - status,
                    failures, max_restarts + 1, attempt.ended or None)))
            say('mnopt.launch: the job %s after %.1f s (attempt %d of '
                '%d)%s' % (
                    'never started' if why == 'never started' else
                    describe(status),
                    time.monotonic() - start, failures, max_restarts + 1,
                    '; restarting in %g s' % delay if left else
                    '; no restarts left'))
            if left and plan is not None:
                launch_attempt.blame(plan, attempt, found, why, missing,
                                     say)
            # A signal during the delay ends the launcher: the user, or the
            # scheduler, asked it to stop, so no attempt may start after it.
            if left and stopping.wait(delay):
                say('mnopt.launch: interrupted; not restarting')
                return status   # the last attempt's: none was stopped
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
    from mnopt.common import cli
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
                   'the next complete snapshot written in DIR (an existing '
                   'folder) and relaunch with it')
    p.add_argument('--snapshot-pattern', default='snapshot*',
                   metavar='GLOB',
                   help='elastic: the names of the snapshots in '
                   '--take-back-after-snapshot DIR, without their suffixes '
                   '(.K, .npz, .rankK.npz) (default %(default)s)')
    p.add_argument('--probe-interval', type=cli.nonnegative_float,
                   default=30.0, metavar='S',
                   help='elastic: seconds between probes of the hosts left '
                   'out, with --take-back-after-snapshot, and while too '
                   'few hosts answer (default 30)')
    p.add_argument('--wait-for-nodes', type=cli.nonnegative_float,
                   default=WAIT_FOR_NODES_S, metavar='S',
                   help='elastic: seconds to wait, probing again, for '
                   '--min-nodes hosts to answer before an attempt; 0: end '
                   'at once (default %(default)g)')
    p.add_argument('--start-timeout', type=cli.nonnegative_float,
                   default=START_TIMEOUT_S, metavar='S',
                   help='elastic: seconds every rank of an attempt has to '
                   'start (import mnopt) before the attempt is ended, its '
                   'hosts probed again and it counts as a failure; 0: no '
                   'limit (default %(default)g)')
    p.add_argument('--stop-timeout', type=cli.nonnegative_float,
                   default=STOP_TIMEOUT_S, metavar='S',
                   help='seconds the job has to end after the launcher '
                   'passed it a signal (or ended it to take a host '
                   'back) before its processes are killed (default '
                   '%(default)g)')
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
    status = run(command, args.max_restarts, args.delay, plan=plan,
                 start_timeout=args.start_timeout,
                 stop_timeout=args.stop_timeout,
                 wait_for_nodes=args.wait_for_nodes)
    # A job a signal ended (Popen's -N): the shell's 128 + N.
    return status if status >= 0 else 128 - status


#: Launchers an elastic command must not start with: the launcher runs
#: mpiexec itself.
_LAUNCHERS = ('mpiexec', 'mpirun', 'srun', 'orterun')


def _elastic_plan(p, args, command):
    if os.path.basename(command[0]) in _LAUNCHERS:
        p.error('with --hosts/--hostfile/--min-nodes the command after -- '
                'is each process\'s (python train.py ...): the launcher '
                'starts %s itself' % args.mpiexec)
    try:
        hosts, slots = elastic_hosts.hosts_and_slots(args.hosts, args.hostfile)
    except (OSError, ValueError) as e:
        p.error(str(e))
    if slots and args.procs_per_node and slots < args.procs_per_node:
        p.error('%s gives each host %d slots, and --procs-per-node %d: give '
                'at most as many processes per host as slots' % (
                    args.hostfile, slots, args.procs_per_node))
    min_nodes = args.min_nodes or 1
    if min_nodes > len(hosts):
        p.error('--min-nodes %d is more than the %d hosts given (%s)'
                % (min_nodes, len(hosts), ','.join(hosts)))
    pool = elastic.HostPool(hosts, elastic_probe.command_probe(
        args.probe, args.probe_timeout), say=None)
    try:
        return elastic.ElasticPlan(
            pool, min_nodes, args.procs_per_node or slots or 1, command,
            mpiexec=args.mpiexec, rejoin_dir=args.take_back_after_snapshot,
            probe_interval=args.probe_interval,
            snapshot_pattern=args.snapshot_pattern)
    except ValueError as e:
        p.error(str(e))


if __name__ == '__main__':
    sys.exit(main())
