"""How close the in-job tuning (``bucket_bytes='auto'``, ...;
mnopt/averaging/tuning.py) lands to the best hand-picked setting:
a Chainer link with ResNet-50's gradient shapes averaged by
``multi_node_mean_grad``, on a grid of fixed settings and on tuned
communicators (after their tuning), round-robin in one run.  For
docs/tuning.md (issue 40, item 4).

    python -m mnopt.netsim run --nodes 2 --rate 1gbit -- \\
        .venv/numpy2/bin/python -m mpi4py benchmarks/tune_bench.py flat \\
        --reps 5 --json docs/results/netsim/tune_flat_2_1gbit.json

With server processes (``--servers 4``: 4 workers + 4 servers), the
reduction server as the published figures and the hand-picked
``chunk_bytes=131072, window=4`` were measured::

    python -m mnopt.netsim run --nodes 4 --servers 4 --rate 250mbit -- \\
        .venv/numpy2/bin/python -m mpi4py benchmarks/tune_bench.py \\
        reduction_server --reps 3 --json tune_rs_4+4_250mbit.json

The grid is every combination of the tuning's own candidates
(``tuning.CANDIDATES``: bucket size x ring segment for ``flat``, chunk x
window for ``reduction_server``), so the best of the grid is the best
that any choice of the tuning could give.  A grid case runs on a
communicator with the case's values in force: one communicator per bucket
size, its segment set for each case; one reduction_server communicator,
its chunk and window set for each case (the values a communicator made
with them holds: tests/test_tune.py shows the averaging is the same).
``--tunings K`` tuned communicators are made and tuned one after the
other (each with its own first averagings, the time of which is
reported), then averaged round-robin with the grid.

Times: the slowest rank's, min / median / max over the repetitions (after
one warm-up repetition).  Ratio: a tuned communicator's median over the
best grid case's median.
"""

import argparse
import itertools
import json
import os
import sys
import time

import numpy
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                '..'))
import mnopt  # NOQA
from mnopt.averaging import tuning  # NOQA
from mnopt.benchmark.workloads import grad_model  # NOQA
from mnopt.benchmark.workloads import resnet50_grad_shapes  # NOQA
from ring_bench import run_cases, spread  # NOQA


def label(values):
    return ', '.join('%s %s' % (n, _size(n, v)) for n, v in values.items())


def _size(name, value):
    if name == 'window':
        return str(value)
    return '%d KiB' % (value >> 10) if value < (1 << 20) else \
        '%d MiB' % (value >> 20)


def pin(comm, values):
    """Put ``values`` in force on ``comm`` (see the module's docstring)."""
    comm.averaging.tuner.values.update(values)


def grid_cases(kind, model):
    names = tuning.TUNABLE[kind]
    cases, comms = [], {}
    for combo in itertools.product(*(tuning.CANDIDATES[n] for n in names)):
        values = dict(zip(names, combo))
        if kind == 'reduction_server':
            key = None   # chunk and window need no buffer of their own
            made = {}
        else:
            key = values['bucket_bytes']
            made = {'bucket_bytes': key}
        if key not in comms:
            comms[key] = mnopt.create_communicator(kind, **made)
        comm = comms[key]

        def run(comm=comm, values=values):
            pin(comm, values)
            comm.multi_node_mean_grad(model)
        cases.append((label(values), run))
    return cases, list(comms.values())


def tuned_cases(kind, model, n, world):
    """``n`` tuned communicators, each tuned now; their cases and what
    each tuning chose and took."""
    auto = {name: 'auto' for name in tuning.TUNABLE[kind]}
    cases, comms, tunings = [], [], []
    for k in range(n):
        comm = mnopt.create_communicator(kind, **auto)
        world.Barrier()
        start = time.perf_counter()
        steps = 0
        while comm.tuned_settings is None:
            comm.multi_node_mean_grad(model)
            steps += 1
        took = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
        chosen = comm.tuned_settings
        tunings.append({'chosen': chosen, 'averagings': steps,
                        'seconds': took,
                        'history': [list(h) for h in
                                    comm.averaging.tuner.history]})
        if world.rank == 0:
            sys.stderr.write('tuning %d: %s in %d averagings, %.1f s\n'
                             % (k, label(chosen), steps, took))
        cases.append(('tuned %d (%s)' % (k + 1, label(chosen)),
                      lambda comm=comm: comm.multi_node_mean_grad(model)))
        comms.append(comm)
    return cases, comms, tunings


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('communicator', choices=['flat', 'reduction_server'])
    p.add_argument('--reps', type=int, default=3,
                   help='repetitions of every case, after one warm-up')
    p.add_argument('--tunings', type=int, default=2,
                   help='tuned communicators (each tunes on its own)')
    p.add_argument('--small', action='store_true',
                   help='a few small arrays instead of ResNet-50 (a quick '
                        'check of the script itself)')
    p.add_argument('--label', default='',
                   help='what the run is (e.g. "2 nodes, 1 Gbit/s"), kept '
                        'in the JSON for tune_report.py')
    p.add_argument('--json', help='write the results here')
    args = p.parse_args()
    world = MPI.COMM_WORLD
    from mnopt.server import job as server_job
    if server_job.job().servers:
        # A job with server processes (netsim run --servers N): time over
        # the workers only (the servers are in COMM_WORLD too).
        first = mnopt.create_communicator(args.communicator)
        world = first.mpi_comm
    shapes = [(1000, 300), (64,), (500, 500), (3, 3, 3, 3)] if args.small \
        else resnet50_grad_shapes()
    model = grad_model(shapes, world.rank)
    nbytes = sum(int(numpy.prod(s)) * 4 for s in shapes)
    tuned, tuned_comms, tunings = tuned_cases(args.communicator, model,
                                              args.tunings, world)
    grid, grid_comms = grid_cases(args.communicator, model)
    cases = grid + tuned
    times, idle = run_cases(cases, world, args.reps, 1)
    for comm in grid_comms + tuned_comms:
        comm.finalize()
    if world.rank != 0:
        return
    medians = [spread(t)['median'] for t in times]
    best = min(range(len(grid)), key=lambda i: medians[i])
    print('# %s, %d ranks, %.1f MB float32 (%s); %d reps (+1 warm-up); '
          'the slowest rank\'s seconds' % (
              args.communicator, world.size, nbytes / 1e6,
              'small' if args.small else 'ResNet-50', args.reps))
    rows = []
    for i, ((name, _), t, cpu) in enumerate(zip(cases, times, idle)):
        s = spread(t)
        ratio = s['median'] / medians[best]
        rows.append({'case': name, 'times_s': t.tolist(), 'time_s': s,
                     'over_best': ratio, 'cpu_idle': float(numpy.median(cpu)),
                     'tuned': i >= len(grid)})
        mark = ' <- best of grid' if i == best else ''
        print('%-52s %.3f / %.3f / %.3f  x%.3f%s' % (
            name, s['min'], s['median'], s['max'], ratio, mark), flush=True)
    for k, t in enumerate(tunings):
        print('tuning %d: %d averagings, %.2f s (%.2f s each; the best '
              'grid case: %.3f s)' % (k + 1, t['averagings'], t['seconds'],
                                      t['seconds'] / t['averagings'],
                                      medians[best]))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'argv': sys.argv, 'label': args.label,
                       'communicator': args.communicator,
                       'ranks': world.size,
                       'bytes': nbytes, 'reps': args.reps,
                       'best_of_grid': cases[best][0],
                       'cases': rows, 'tunings': tunings}, f, indent=1)


if __name__ == '__main__':
    main()
