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

It stops at the first success, at ``--max-restarts`` failures in a row, or
when interrupted (SIGINT/SIGTERM are passed to the job, which is then not
restarted).  Its exit status is the last attempt's.
"""

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from mnopt import log as _log

logger = _log.get('mnopt.launch')   # also when run as __main__


def run(command, max_restarts=3, delay=1.0, log=None):
    """Run ``command`` (an argv list) until it succeeds or has failed
    ``max_restarts + 1`` times; returns the last exit status.

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
    previous = {s: signal.signal(s, forward)
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for attempt in range(max_restarts + 1):
            env = dict(os.environ, MNOPT_RESTART=str(attempt))
            start = time.monotonic()
            child = subprocess.Popen(command, env=env)
            status = child.wait()
            if status == 0 or stopping.is_set():
                return status
            left = max_restarts - attempt
            say('mnopt.launch: the job exited with status %d after '
                '%.1f s (attempt %d of %d)%s' % (
                    status, time.monotonic() - start, attempt + 1,
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
        usage='%(prog)s [--max-restarts N] [--delay S] -- COMMAND ...')
    from mnopt import cli
    p.add_argument('--max-restarts', type=cli.nonnegative_int, default=3,
                   metavar='N', help='restarts after failures (default 3)')
    p.add_argument('--delay', type=cli.nonnegative_float, default=1.0,
                   metavar='S', help='seconds between a failure and the '
                   'restart (default 1)')
    p.add_argument('command', nargs=argparse.REMAINDER,
                   help='the job: mpiexec ..., srun ...')
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ['--'] \
        else args.command
    if not command:
        p.error('no command given (put it after --)')
    return run(command, args.max_restarts, args.delay)


if __name__ == '__main__':
    sys.exit(main())
