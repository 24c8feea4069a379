"""How the pipelines' piece sizes move the time on the wire: the reduction
server at several chunk sizes and windows, or mnopt's ring at several
segment sizes and windows (with gloo's DDP buckets beside it where PyTorch
is installed), side by side in one run, round-robin within each
repetition.  The evidence for issue 23's explanations in
docs/benchmarks.md ("Where the time goes").

Reduction server (4 workers + 4 server processes, 250 Mbit/s):

    python -m mnopt.netsim run --nodes 4 --servers 4 --rate 250mbit -- \\
        .venv/numpy2/bin/python -m mpi4py benchmarks/pipeline_settings.py \\
        reduction_server 262144:6 1048576:6 262144:16 1048576:2 65536:24

Ring (8 nodes, 250 Mbit/s; gloo with .venv/gloo, see gloo_bench.py):

    python -m mnopt.netsim run --nodes 8 --rate 250mbit -- \\
        .venv/gloo/bin/python -m mpi4py benchmarks/pipeline_settings.py \\
        flat 262144:8 1048576:8 1048576:4 262144:32 65536:32 --gloo

Each setting is BYTES:WINDOW: the reduction server's ``chunk_bytes`` and
``window`` (chunks in flight per server), or the ring's SEGMENT_BYTES and
WINDOW (receives posted ahead).  Times: the slowest rank's, min / median
/ max over the repetitions; CPU idle: the machine's, median.
"""

import argparse
import json
import os
import sys

import numpy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                '..'))
import mnopt  # NOQA
from mnopt.transport import ring  # NOQA
from mnopt.benchmark.workloads import grad_list, resnet50_grad_shapes  # NOQA
from ring_bench import run_cases, spread  # NOQA


def server_cases(settings, grads_of):
    cases, world, grads = [], None, None
    for chunk, window in settings:
        comm = mnopt.create_communicator('reduction_server',
                                         chunk_bytes=chunk, window=window)
        if grads is None:   # one set for every case
            grads = grads_of(comm.rank)
        world = comm.mpi_comm   # the workers
        cases.append(('reduction_server chunk %d KiB, window %d'
                      % (chunk >> 10, window),
                      lambda comm=comm, grads=grads: comm.mean_grads(grads)))
    return cases, world


def ring_cases(settings, grads_of):
    comm = mnopt.create_communicator('flat')
    grads = grads_of(comm.rank)

    def case(segment, window):
        def run():
            ring.SEGMENT_BYTES, ring.WINDOW = segment, window
            comm.mean_grads(grads)
        return run
    return [('flat (ring) segment %d KiB, window %d' % (s >> 10, w),
             case(s, w)) for s, w in settings], comm.mpi_comm


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('communicator', choices=['reduction_server', 'flat'])
    p.add_argument('settings', nargs='+', help='BYTES:WINDOW')
    p.add_argument('--reps', type=int, default=3)
    p.add_argument('--gloo', action='store_true',
                   help="add gloo's DDP buckets (needs torch)")
    p.add_argument('--json')
    args = p.parse_args()
    settings = [tuple(int(x) for x in s.split(':')) for s in args.settings]
    shapes = resnet50_grad_shapes()

    def grads_of(rank):
        return grad_list(shapes, rank)

    if args.communicator == 'flat':
        cases, world = ring_cases(settings, grads_of)
    else:
        cases, world = server_cases(settings, grads_of)
    gloo = None
    if args.gloo:
        import gloo_bench
        gloo = gloo_bench.gloo_here(world)
        fn, _, _ = gloo.case([g for _, g in grads_of(world.rank)],
                             gloo_bench.DDP_BUCKETS)
        cases.append(("gloo, DDP's buckets", fn))
    times, idle = run_cases(cases, world, args.reps, 1)
    if gloo is not None:
        gloo.dist.destroy_process_group()
    if world.rank != 0:
        return
    rows = []
    print('# %s, %d workers; ResNet-50, 102.2 MB float32; %d reps (+1 '
          'warm-up)' % (args.communicator, world.size, args.reps))
    for (label, _), t, cpu in zip(cases, times, idle):
        s = spread(t)
        rows.append({'case': label, 'times_s': t.tolist(), 'time_s': s,
                     'cpu_idle': float(numpy.median(cpu))})
        print('%-46s %.3f / %.3f / %.3f s   CPU idle %.0f%%'
              % (label, s['min'], s['median'], s['max'],
                 100 * numpy.median(cpu)), flush=True)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'argv': sys.argv, 'workers': world.size,
                       'cases': rows}, f, indent=1)


if __name__ == '__main__':
    main()
