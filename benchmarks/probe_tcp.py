"""Probe: where `flat`'s last few percent behind gloo go at 8 nodes.  The
raw ring, `flat` and gloo's DDP buckets round-robin in one run, with per
repetition every rank's time and, per simulated node, the TCP segments
sent and retransmitted (each node is a network namespace of its own) and
the process's context switches (ring_bench.tcp_and_scheduling): do the
slow repetitions go with lost segments (a retransmission timeout costs
at least 200 ms), or with ranks preempted?  Needs
PyTorch (.venv/gloo, see gloo_bench.py).

    python -m mnopt.netsim run --nodes 8 --rate 250mbit -- \\
        .venv/gloo/bin/python -m mpi4py benchmarks/probe_tcp.py \\
        --reps 6 --json docs/results/netsim/probe_tcp_8.json

Results: docs/results/netsim/pipeline.md.
"""
import argparse
import json
import os
import sys

import numpy
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, '..'))
import mnopt  # NOQA
from mnopt.transport import ring  # NOQA
from mnopt.benchmark.workloads import grad_list, resnet50_grad_shapes  # NOQA
import gloo_bench  # NOQA
from ring_bench import (COUNTERS, run_cases, spread,  # NOQA
                        tcp_and_scheduling)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--reps', type=int, default=6)
    p.add_argument('--json')
    args = p.parse_args()
    world = MPI.COMM_WORLD
    base = grad_list(resnet50_grad_shapes(), world.rank)
    grads = [(name, g.copy()) for name, g in base]
    flat = mnopt.create_communicator('flat')
    packed = numpy.ones(sum(g.size for _, g in base), numpy.float32)
    gloo = gloo_bench.gloo_here(world)
    ddp, _, _ = gloo.case([g for _, g in base], gloo_bench.DDP_BUCKETS)
    cases = [('raw ring, one packed buffer', lambda: ring.allreduce_sum(
                  world, packed, 'float32', check=False)),
             ('mnopt flat float32', lambda: flat.mean_grads(grads)),
             ("gloo, DDP's buckets", ddp)]
    times, idle, detail = run_cases(cases, world, args.reps, 1,
                                    counters=tcp_and_scheduling)
    gloo.dist.destroy_process_group()
    if world.rank != 0:
        return
    result = {'n_ranks': world.size, 'reps': args.reps, 'counters': COUNTERS,
              'cases': []}
    for (label, _), t, cpu, ranks, grown in zip(
            cases, times, idle, detail['rank_times'], detail['counters']):
        sent, retrans, timeouts, probes, vol, invol = (
            grown[..., k].sum(axis=1) for k in range(len(COUNTERS)))
        result['cases'].append({
            'case': label, 'time_s': spread(t), 'times_s': t.tolist(),
            'cpu_idle': spread(cpu), 'rank_times_s': ranks.tolist(),
            'counters': grown.tolist()})
        s = spread(t)
        print('%s: %.3f / %.3f / %.3f s, CPU idle %.0f%%' % (
            label, s['min'], s['median'], s['max'],
            100 * numpy.median(cpu)))
        print('  rep  slowest s (rank)  fastest s  retransmitted/sent  '
              'timeouts  loss probes  preemptions  waits')
        for k in range(len(t)):
            print('  %3d  %9.3f (%d)  %9.3f  %8d/%-9d  %8d  %11d  %11d  %5d'
                  % (k, t[k], ranks[k].argmax(), ranks[k].min(), retrans[k],
                     sent[k], timeouts[k], probes[k], invol[k], vol[k]))
        sys.stdout.flush()
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(result, f, indent=1)


if __name__ == '__main__':
    main()
