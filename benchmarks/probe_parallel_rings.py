"""Probe: mnopt's raw ring over one packed 102.2 MB float32 buffer, and
the same buffer split over 2 and 4 rings at once (threads, a communicator
each), beside gloo's DDP buckets and one bucket, round-robin in one run
(needs PyTorch: .venv/gloo, see gloo_bench.py).  Does running several
allreduces at once, as DDP's buckets do, drive the links harder?

    python -m mnopt.netsim run --nodes 8 --rate 250mbit -- \
        .venv/gloo/bin/python -m mpi4py benchmarks/probe_parallel_rings.py 3

Results: docs/results/netsim/pipeline.md.
"""
import os
import sys
import threading
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, '..'))
import numpy
from mpi4py import MPI
from mnopt.transport import ring
from ring_bench import run_cases, spread
import gloo_bench
from mnopt.benchmark.workloads import grad_list, resnet50_grad_shapes
world = MPI.COMM_WORLD
n = 25557096
buf = numpy.ones(n, numpy.float32)
def k_rings(k):
    comms = [world.Dup() for _ in range(k)]
    bounds = numpy.linspace(0, n, k + 1).astype(int)
    def run():
        if k == 1:
            ring.allreduce_sum(comms[0], buf, 'float32')
            return
        ts = [threading.Thread(target=ring.allreduce_sum, args=(comms[i], buf[bounds[i]:bounds[i+1]], 'float32')) for i in range(k)]
        for t in ts: t.start()
        for t in ts: t.join()
    return run
cases = [('%d ring(s) at once' % k, k_rings(k)) for k in (1, 2, 4)]
base = grad_list(resnet50_grad_shapes(), world.rank)
g = gloo_bench.gloo_here(world)
fn, _, _ = g.case([b for _, b in base], gloo_bench.DDP_BUCKETS)
cases.append(("gloo DDP buckets", fn))
fn1, _, _ = g.case([b.copy() for _, b in base], [sys.maxsize])
cases.append(("gloo one bucket", fn1))
times, idle = run_cases(cases, world, 3, 1)
if world.rank == 0:
    for (label, _), t, i in zip(cases, times, idle):
        s = spread(t)
        print('%-28s %.3f / %.3f / %.3f  idle %.0f%%' % (label, s['min'], s['median'], s['max'], 100 * numpy.median(i)), flush=True)
g.dist.destroy_process_group()
