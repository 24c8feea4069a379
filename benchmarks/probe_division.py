"""Probe: ``flat`` dividing the gradients it sums in place segment by
segment as the ring first uses them (the code) against one pass before
the ring (as before 2a25dc1, by replacing the communicator's ``_sum``),
beside the raw ring and gloo's DDP buckets, round-robin in one run
(needs PyTorch: .venv/gloo, see gloo_bench.py).

    python -m mnopt.netsim run --nodes 8 --rate 250mbit -- \
        .venv/gloo/bin/python -m mpi4py benchmarks/probe_division.py 3

Results: docs/results/netsim/pipeline.md.
"""
import os
import sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, '..'))
import numpy
from mpi4py import MPI
import mnopt
from mnopt.transport import allreduce, ring
from ring_bench import run_cases, spread
import gloo_bench
from mnopt.benchmark.workloads import grad_list, resnet50_grad_shapes
world = MPI.COMM_WORLD
base = grad_list(resnet50_grad_shapes(), world.rank)
grads = [(n, g.copy()) for n, g in base]
lazy = mnopt.create_communicator('flat')
first = mnopt.create_communicator('flat')
def old_sum(buffer, group):
    allreduce.allreduce_sum_parts(group.comm, list(buffer.host_parts()), buffer.layout.wire, first.allreduce_algorithm)
    buffer.from_host()
first._sum = old_sum
n = sum(g.size for _, g in base)
buf = numpy.ones(n, numpy.float32)
cases = [('flat, division spread over the ring', lambda: lazy.mean_grads(grads)),
         ('flat, division in one pass first', lambda: first.mean_grads(grads)),
         ('raw ring, one packed buffer', lambda: ring.allreduce_sum(world, buf, 'float32'))]
g = gloo_bench.gloo_here(world)
fn, _, _ = g.case([b for _, b in base], gloo_bench.DDP_BUCKETS)
cases.append(("gloo, DDP's buckets", fn))
times, idle = run_cases(cases, world, int(sys.argv[1]), 1)
if world.rank == 0:
    for (label, _), t, i in zip(cases, times, idle):
        s = spread(t)
        print('%-40s %.3f / %.3f / %.3f  idle %.0f%%' % (label, s['min'], s['median'], s['max'], 100 * numpy.median(i)), flush=True)
g.dist.destroy_process_group()
