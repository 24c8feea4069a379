"""Colocated reduction servers in shared memory: ``multi_node_mean_grad``
through a Chainer model holding the first ``--max-mb`` MB of ResNet-50's
gradients, on a colocated ``reduction_server`` communicator (no server
processes: every worker serves a shard from two threads) beside ``flat``,
alternating, in one job on one machine:

    mpiexec -n 2 python -m mpi4py benchmarks/colocated_shm.py \\
        [--max-mb 9.7] [--calls 8] [--rounds 3] [--json OUT]

Per round each communicator averages ``--calls`` times; printed and
saved: seconds per call, min / median / max over the rounds (the slowest
rank's), and MNOPT_WAIT.  Results: docs/results/netsim/waits.md.
"""

import argparse
import json
import time

import numpy
from mpi4py import MPI

import mnopt
from mnopt.benchmark.harness import spread
from mnopt.benchmark.workloads import grad_model, resnet50_grad_shapes
try:
    from mnopt.transport import waiting
except ImportError:  # a tree from before the C waits
    waiting = None


def first_shapes(max_bytes):
    """ResNet-50's gradient shapes, in order, up to ``max_bytes`` of
    float32."""
    shapes, total = [], 0
    for shape in resnet50_grad_shapes():
        size = 4 * int(numpy.prod(shape))
        if total + size > max_bytes:
            break
        shapes.append(shape)
        total += size
    return shapes, total


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--max-mb', type=float, default=9.7)
    p.add_argument('--calls', type=int, default=8)
    p.add_argument('--rounds', type=int, default=3)
    p.add_argument('--json')
    args = p.parse_args()
    world = MPI.COMM_WORLD
    shapes, nbytes = first_shapes(args.max_mb * 1e6)
    model = grad_model(shapes, world.rank)
    comms = {name: mnopt.create_communicator(name)
             for name in ('reduction_server', 'flat')}
    for comm in comms.values():   # warm: plans, buffers, the servers
        comm.multi_node_mean_grad(model)
    times = {name: [] for name in comms}
    for r in range(args.rounds):
        for name in sorted(comms, reverse=r % 2 == 1):
            world.Barrier()
            start = time.perf_counter()
            for _ in range(args.calls):
                comms[name].multi_node_mean_grad(model)
            mine = (time.perf_counter() - start) / args.calls
            times[name].append(world.allreduce(mine, op=MPI.MAX))
    result = {'ranks': world.size, 'bytes': nbytes, 'arrays': len(shapes),
              'calls': args.calls,
              'wait': waiting.kind() if waiting else 'before the C waits',
              'seconds_per_call': {name: spread(v)
                                   for name, v in times.items()}}
    for comm in comms.values():
        comm.finalize()
    if world.rank == 0:
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, 'w') as f:
                json.dump(result, f, indent=1)


if __name__ == '__main__':
    main()
