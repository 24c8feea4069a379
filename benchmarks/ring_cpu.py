"""CPU per MB of a ring allreduce: mnopt's ring with its waits' pace
(mnopt/transport/ring_pace.py) and with PROMPT's (the shortest nap after
every poll that moved data, as before the pace), beside gloo's allreduce
(PyTorch, the same bytes in the same 4 MiB tensors), in one run:

    sudo python -m mnopt.netsim run --nodes 2 --ranks-per-node 1 \\
        --rate 1gbit --servers 0 -- python benchmarks/ring_cpu.py

Each variant: ``--reps`` allreduces of ``--mb`` MB (4 MiB float32
arrays) per cycle, variants alternating, ``--cycles`` cycles; mnopt's as
one ring per array, one after another, as overlap's averaging thread
averages 4 MiB buckets (``--one-ring``: one ring for them all); per
allreduce the wall time and the process's CPU time (getrusage: every
thread, gloo's included).  ``--longest MS``: also the measured pace with
naps of at most MS (ring_pace.LONGEST; repeatable).  Rank 0 prints min /
median / max.  Needs torch (the .venv/gloo environment of
benchmarks/gloo_bench.py)."""

import argparse
import json
import resource
import time

import numpy
from mpi4py import MPI

from mnopt.transport import ring, ring_pace, waiting
from gloo_bench import gloo_here


def cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(world, reps, fn):
    out = []
    for _ in range(reps):
        world.Barrier()
        c0, t0 = cpu_s(), time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0, cpu_s() - c0))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--mb', type=int, default=24, help='a multiple of 4')
    p.add_argument('--reps', type=int, default=3)
    p.add_argument('--cycles', type=int, default=3)
    p.add_argument('--one-ring', action='store_true')
    p.add_argument('--longest', type=float, action='append', default=[],
                   metavar='MS')
    p.add_argument('--segment-kib', type=int, action='append', default=[],
                   metavar='KIB', help='also the measured pace with '
                   'segments of KIB (repeatable)')
    p.add_argument('--json')
    args = p.parse_args()
    world = MPI.COMM_WORLD
    comm = world.Dup()
    parts = [numpy.ones(1 << 20, numpy.float32) for _ in range(args.mb // 4)]
    nbytes = sum(a.nbytes for a in parts)
    dist = gloo_here(world).dist
    import torch
    tensors = [torch.ones(1 << 20) for _ in parts]

    def gloo():
        for h in [dist.all_reduce(t, async_op=True) for t in tensors]:
            h.wait()

    measured_pace, longest = ring_pace.pace, ring_pace.LONGEST

    def ring_with(pace, longest_s=longest, segment_bytes=None):
        def run():
            ring_pace.pace, ring_pace.LONGEST = pace, longest_s
            try:
                for bucket in [parts] if args.one_ring else [
                        [a] for a in parts]:
                    ring.allreduce_sum_parts(comm, bucket, 'float32',
                                             check=False,
                                             segment_bytes=segment_bytes)
            finally:
                ring_pace.pace, ring_pace.LONGEST = measured_pace, longest
        return run

    variants = {'mnopt ring, measured pace': ring_with(measured_pace)}
    for ms in args.longest:
        variants['mnopt ring, naps <= %g ms' % ms] = ring_with(
            measured_pace, ms * 1e-3)
    for kib in args.segment_kib:
        variants['mnopt ring, %d KiB segments' % kib] = ring_with(
            measured_pace, segment_bytes=kib << 10)
    variants['mnopt ring, PROMPT pace'] = ring_with(
        lambda per_byte, in_flight: waiting.PROMPT)
    variants['gloo allreduce'] = gloo
    for fn in variants.values():   # warm: connections, the first rate
        fn()
    got = {name: [] for name in variants}
    for _ in range(args.cycles):
        for name, fn in variants.items():
            got[name] += timed(world, args.reps, fn)
    if world.rank == 0:
        result = {'ranks': world.size, 'bytes': nbytes,
                  'one_ring': args.one_ring, 'variants': {}}
        for name, runs in got.items():
            wall = sorted(w for w, _ in runs)
            cpu = sorted(c for _, c in runs)
            mid = len(runs) // 2
            result['variants'][name] = {
                'wall_s': [wall[0], wall[mid], wall[-1]],
                'cpu_s': [cpu[0], cpu[mid], cpu[-1]],
                'cpu_ms_per_mb': cpu[mid] * 1e3 / (nbytes * 1e-6)}
            print('%-30s wall %.3f / %.3f / %.3f s   CPU %.1f / %.1f / %.1f '
                  'ms   %.2f ms per MB' % ((name,) + tuple(wall[i] for i in (
                      0, mid, -1)) + tuple(1e3 * cpu[i] for i in (0, mid, -1))
                      + (cpu[mid] * 1e3 / (nbytes * 1e-6),)), flush=True)
        if args.json:
            with open(args.json, 'w') as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
