"""The timing harness: cases timed round-robin, statistics, bytes on the links.

A case is ``(label, kind, fn)``.  The cases, the sweeps and the command
line call ``harness.run_cases`` through this module, so that a wrapper
(benchmarks/idle_bench.py) can replace it.
"""

import collections
import os
import socket
import statistics
import sys
import time

import numpy
from mpi4py import MPI


def spread(values):
    """{'min', 'median', 'max'} of a figure measured several times."""
    return {'min': min(values), 'median': statistics.median(values),
            'max': max(values)}


def run_cases(cases, world, reps, warmup=2, progress=''):
    """Time each case ``reps`` times, round-robin; returns the slowest
    rank's times, shape (cases, reps)."""
    times = numpy.zeros((len(cases), reps))
    for rep in range(warmup + reps):
        for i, (_, _, fn) in enumerate(cases):
            world.Barrier()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if rep >= warmup:
                times[i, rep - warmup] = dt
        if world.rank == 0:
            sys.stderr.write('\r%srepetition %d/%d ' % (progress, rep + 1,
                                                         warmup + reps))
            sys.stderr.flush()
    if world.rank == 0:
        sys.stderr.write('\r' + ' ' * 60 + '\r')
    world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)  # the slowest rank
    return times


def bus_bandwidth(algbw, n):
    """nccl-tests' allreduce bus bandwidth: what each link carries."""
    return algbw * 2.0 * (n - 1) / n if n > 1 else algbw


def link_tx_bytes():
    """{interface: bytes sent so far} of this node's network interfaces
    but loopback (Linux's /sys counters; frames a bridge forwards count on
    the interface they leave by)."""
    out = {}
    root = '/sys/class/net'
    for dev in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        try:
            with open(os.path.join(root, dev, 'statistics', 'tx_bytes')) as f:
                out[dev] = int(f.read())
        except (OSError, ValueError):
            continue
    out.pop('lo', None)
    return out


def counting_link_bytes(cases):
    """``cases`` with each function wrapped to add up the bytes this node's
    interfaces sent while it ran; returns (wrapped cases, per_call) where
    ``per_call()`` is, per case, {interface: mean bytes per call}."""
    totals = [collections.Counter() for _ in cases]
    calls = [0] * len(cases)

    def wrap(i, fn):
        def run():
            before = link_tx_bytes()
            fn()
            for dev, n in link_tx_bytes().items():
                totals[i][dev] += n - before.get(dev, n)
            calls[i] += 1
        return run

    def per_call():
        return [{dev: n / max(1, c) for dev, n in t.items()}
                for t, c in zip(totals, calls)]
    return ([(label, kind, wrap(i, fn))
             for i, (label, kind, fn) in enumerate(cases)], per_call)


def gather_link_bytes(world, per_case):
    """Rank 0: per case {'host:interface': bytes per call}, one entry per
    node (the first rank of each host speaks for it)."""
    gathered = world.gather((socket.gethostname(), per_case))
    if gathered is None:
        return None
    merged = [{} for _ in per_case]
    seen = set()
    for host, cases in gathered:
        if host in seen:
            continue
        seen.add(host)
        for out, counts in zip(merged, cases):
            out.update(('%s:%s' % (host, dev), n) for dev, n in counts.items())
    return merged
