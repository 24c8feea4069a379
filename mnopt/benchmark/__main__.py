"""Benchmark gradient averaging, side by side in one run.

    mpiexec -n 2 python -m mpi4py -m mnopt.benchmark [--quick] [--json FILE]

Times gradient averaging (``mean_grads``) on ResNet-50's gradient set
(162 arrays, 25,557,096 float32) for each communicator and wire dtype, next to:

- the limit: raw mpi4py ``Allreduce`` of one pre-packed float32 buffer, at
  the best of several chunk sizes (no packing, no casting, no scaling);
- ChainerMN's own ``naive`` communicator, when ChainerMN is importable.

Cases run round-robin within each repetition so drift on a shared machine
hits all of them alike; each time is the slowest rank's.
"""

import argparse
import json

from mpi4py import MPI

from mnopt.common import cli
from mnopt.benchmark import cases, harness, sizes, training


def parser():
    """The command line: every option with its help, bad values refused by
    argparse (usage and an ``error:`` line, exit status 2)."""
    from mnopt import communicators
    from mnopt.codecs import grad_buffer
    p = argparse.ArgumentParser(
        prog='python -m mnopt.benchmark',
        description=__doc__.split('\n')[0],
        epilog=cli.help_epilog(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--communicators', nargs='+', metavar='NAME',
                   choices=[n for n in communicators.NAMES if n != 'auto'],
                   help='the mnopt communicators to time, of %(choices)s '
                        '(default: naive flat hierarchical; flat with '
                        '--scaling or --double-buffering)')
    p.add_argument('--dtypes', nargs='+', metavar='WIRE',
                   default=['float32', 'float16', 'bfloat16'],
                   choices=list(grad_buffer.WIRE_DTYPES) + ['sign'],
                   help='the wires to time, of %(choices)s (sign: sign '
                        'compression, a majority vote) (default: float32 '
                        'float16 bfloat16)')
    p.add_argument('--votes', nargs='+', default=['ring'],
                   choices=['ring', 'alltoall'],
                   help="how --dtypes sign counts votes (ring "
                        "communicators; default: ring)")
    p.add_argument('--reps', type=cli.positive_int, default=15,
                   help='repetitions of each case (default 15; at most 5 '
                        'with --quick)')
    p.add_argument('--only-mnopt', action='store_true',
                   help='time the mnopt communicators only (not the '
                        'raw-Allreduce limit nor ChainerMN)')
    p.add_argument('--link-bytes', action='store_true',
                   help='record the bytes each node\'s interfaces sent '
                        'per averaging (JSON: link_tx_bytes)')
    p.add_argument('--bucket-bytes', type=cli.positive_int, default=None,
                   help='bucket size of the mnopt communicators, in bytes '
                        '(default: theirs)')
    p.add_argument('--through-model', action='store_true',
                   help='average through a Chainer model, as a ChainerMN '
                        'user does (multi_node_mean_grad on a Link '
                        'holding the gradients), not mean_grads on the '
                        'arrays')
    p.add_argument('--quick', action='store_true',
                   help='fewer cases and repetitions (a smoke run)')
    p.add_argument('--compare-checks', action='store_true',
                   help='time each case also with stall detection and '
                        'the overflow check off (stall_warning=0, '
                        'timeout=0, on_overflow=ignore)')
    p.add_argument('--json', metavar='FILE',
                   help='write the results to this file')
    p.add_argument('--sizes', action='store_true',
                   help='sweep message sizes from 1 KiB to --max-size')
    p.add_argument('--max-size', type=cli.positive_int, default=256 << 20,
                   metavar='BYTES',
                   help='largest message of --sizes (default 256 MiB)')
    p.add_argument('--plot', metavar='PNG',
                   help='write a PNG figure here (--sizes)')
    p.add_argument('--scaling', action='store_true',
                   help='step time with --compute-ms of simulated '
                        'compute: plain float32 vs double buffering + '
                        'float16')
    p.add_argument('--compute-ms', type=cli.nonnegative_float,
                   default=1000.0,
                   help='simulated compute per step, in ms (--scaling; '
                        'default 1000)')
    p.add_argument('--steps', type=cli.positive_int, default=None,
                   help='steps per timed block (--scaling, '
                        '--double-buffering)')
    p.add_argument('--double-buffering', action='store_true',
                   help='measure the overlap of double buffering (with '
                        'the first of --communicators and --dtypes)')
    return p


def main(argv=None):
    parser_ = parser()
    args = cli.parse_args(parser_, argv)
    if args.quick:
        args.reps = min(args.reps, 5)
        args.dtypes = args.dtypes[:2]
    world = MPI.COMM_WORLD
    from mnopt.server import job as server_job
    if server_job.job().servers:
        # Servers take no part in the timing: time over the workers, with
        # the reduction_server communicator and, where asked for, the
        # others over the workers alone (the same run's ring beside it).
        import mnopt
        first = mnopt.create_communicator('reduction_server')
        world = first.mpi_comm
        args.communicators = ['reduction_server'] + [
            n for n in args.communicators or () if n != 'reduction_server']
    if args.steps:
        training.STEPS_PER_BLOCK = args.steps
    if args.scaling:
        args.communicators = args.communicators or ['flat']
        result = training.scaling(args, world)
        if args.json and world.rank == 0:
            with open(args.json, 'w') as f:
                json.dump(result, f, indent=1)
        return
    if args.double_buffering:
        args.communicators = args.communicators or ['flat']
        result = training.double_buffering(args, world)
        if args.json and result is not None:
            with open(args.json, 'w') as f:
                json.dump(result, f, indent=1)
        return
    args.communicators = args.communicators or ['naive', 'flat',
                                                'hierarchical']
    if args.sizes:
        rows = sizes.sweep(args, world)
        if world.rank == 0:
            sizes.print_sweep(rows, world)
            if args.json:
                with open(args.json, 'w') as f:
                    json.dump({'n_ranks': world.size, 'rows': rows}, f,
                              indent=1)
            if args.plot:
                sizes.plot_sweep(rows, args.plot,
                                 'allreduce bus bandwidth, N=%d' % world.size)
        return
    timed, total = cases.build_cases(args, world)
    if args.link_bytes:
        timed, link_bytes_per_call = harness.counting_link_bytes(timed)
    times = harness.run_cases(timed, world, args.reps)
    link_bytes = harness.gather_link_bytes(world, link_bytes_per_call()) \
        if args.link_bytes else None
    if world.rank == 0:
        cases.report(timed, times, total, world, args, link_bytes)


if __name__ == '__main__':
    main()
