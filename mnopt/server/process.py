"""The reduction server (Herring / Fairring / Optcast): protocol and loop.

    mpiexec -n W python train.py : -n S python -m mnopt.server [--memory B]

Workers (``create_communicator('reduction_server')``) pack their gradients
divided by W (in the cast to the wire dtype, as every communicator does;
the servers' float32 sums then leave only gradient / W and the mean to fit
a 16-bit wire), split them into one near-equal
contiguous shard per server, cut each shard into chunks, and push them; a
server sums each chunk's shares over the workers in float32, in worker
order (bitwise deterministic), rounds once to the wire dtype and pushes
the mean back.  Each worker sends S bytes and
receives S bytes, against 2(N-1)/N S for a ring.

Every request starts with a header from each worker to each server; the
server answers a status as soon as it has all headers, so a disagreement
(protocol version, number of workers, sizes, dtype, layout) is an error on
every worker at once, which the server also reports.  Staging memory is
bounded (``--memory``, like FAIRRING_TOTAL_MEMORY): at least one chunk's
worth of slots is always available, so any bound makes progress.

Launched without servers, the communicator runs this same loop on a thread
in every worker (colocated, as Fairring does).

This module is the server process (``python -m mnopt.server``, run by
mnopt/server/__main__.py; ``mnopt.server.main()`` in a script that wraps
it); beside it: the protocol (protocol.py), the job's roles and channels
(job.py) and the loop (loop.py).
"""

import argparse
import sys
import threading
import time

from mnopt.stall import launched

# MPI's start waits for every rank (a worker that exited before it would
# keep the servers there for ever): under the stall warning and timeout.
launched.start_mpi('python -m mnopt.server')

from mpi4py import MPI

from mnopt.common import log
from mnopt.stall import settings as stall_settings
from mnopt.timeline import recorder as timelines
from mnopt.server.job import CHANNEL_NAMES, job
from mnopt.server.loop import Stats, serve
from mnopt.server.protocol import DEFAULT_MEMORY
from mnopt.transport import waiting

logger = log.get('mnopt.server')   # the name of the command


def main(argv=None):
    from mnopt.common import cli
    p = argparse.ArgumentParser(prog='python -m mnopt.server',
                                description=__doc__.split('\n')[0])
    p.add_argument('--memory', type=cli.positive_int, default=DEFAULT_MEMORY,
                   metavar='BYTES',
                   help='bytes of staging memory per channel (default 64 MiB)')
    p.add_argument('--stats', action='store_true',
                   help='print per-phase statistics when the job ends')
    from mnopt import global_except_hook
    # First: a bad option or setting must end the job, not leave the
    # workers waiting for this process.
    global_except_hook.add_hook()
    args = cli.parse_args(p, argv)
    # A bad MNOPT_STALL_WARNING / MNOPT_TIMEOUT / MNOPT_WAIT raises.
    stall_settings.settings()
    waiting.kind()
    world = MPI.COMM_WORLD
    the_job = job(default_role='server')
    if not the_job.workers:
        # Every process sees the same roles: each exits, the first says why.
        if world.rank == the_job.servers[0]:
            print('python -m mnopt.server: error: no workers: every process '
                  'of the job is a reduction server.  Launch the training '
                  'script beside the servers, as in mpiexec -n W python '
                  'train.py : -n S python -m mnopt.server (workers first)',
                  file=sys.stderr, flush=True)
        sys.exit(2)
    # Mirror the workers' start-up: the split and the two channels.
    _, chans = the_job.channels()
    index = the_job.servers.index(world.rank)
    stats = Stats() if args.stats else None

    def report(problem):
        # An ERROR record of logger mnopt.server (mnopt/common/log.py): the
        # worker that sent it fails; the server goes on serving.
        logger.error('mnopt.server %d: refused a reduction: %s', index,
                     problem)

    # $MNOPT_TIMELINE: this process's own file, by its COMM_WORLD rank
    # (the workers' rule), its threads named 'server'.
    tl = timelines.open_from_environment(world.rank, role='server')

    def serve_channel(chan, name):
        tl.name_thread('server')
        serve(chan, the_job.workers, index, len(the_job.servers),
              args.memory, stats, report, the_job.monitor(), 'serve.' + name,
              timeline=tl, pace=waiting.PATIENT)

    from mnopt.global_except_hook import run_or_abort
    threads = [threading.Thread(target=run_or_abort, args=(
        serve_channel, chan, name))
        for chan, name in zip(chans, CHANNEL_NAMES)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tl.close()
    if stats is not None:
        elapsed = time.perf_counter() - start
        print(stats.format('server %d' % index))
        print('server %d: %.1f MB moved, %.3f GB/s over the job' % (
            index, stats.bytes / 1e6, stats.bytes / max(elapsed, 1e-9) / 1e9))

