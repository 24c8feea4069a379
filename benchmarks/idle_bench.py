"""``python -m mnopt.benchmark`` with the CPU's idle share beside every
time, and optionally fewer cases.

    mpiexec -n 2 python -m mpi4py benchmarks/idle_bench.py \\
        [--keep REGEX] [mnopt.benchmark's arguments ...]

Runs ``python -m mnopt.benchmark`` unchanged (its cases, its round-robin
order, the slowest rank's time) but times each repetition of each case next to the
machine's CPU idle share over the same interval (/proc/stat, every core:
the simulated nodes of ``mnopt.netsim`` share them).  That says whether
the cores or the links set the pace: a case whose cores were ~0% idle was
CPU-bound, whatever its links.  ``--keep REGEX`` keeps only the cases
whose label matches (``re.search``), so a figure can be rerun without the
cases it does not need.  With ``--json FILE`` each row (or, with
``--double-buffering``, the result) gains ``cpu_idle``: min / median / max
over the repetitions, from rank 0.
"""

import json
import re
import runpy
import statistics
import sys
import time

import numpy
from mpi4py import MPI

try:
    from mnopt.benchmark import cases, harness
except ImportError:  # a tree from before the folders (rerun.py --code)
    try:
        from mnopt.benchmarking import cases, harness
    except ImportError:  # a tree from before the library
        import mnopt.benchmark as cases
        harness = cases

IDLE = {}   # case label -> idle shares of its repetitions (last run_cases)


def spread(values):
    return {'min': min(values), 'median': statistics.median(values),
            'max': max(values)}


def cpu_times():
    """(idle, total) jiffies of all cores."""
    with open('/proc/stat') as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])


def run_cases(cases, world, reps, warmup=2, progress=''):
    """mnopt.benchmark.harness.run_cases, recording CPU idle per
    repetition."""
    times = numpy.zeros((len(cases), reps))
    idle = numpy.zeros((len(cases), reps))
    for rep in range(warmup + reps):
        for i, (_, _, fn) in enumerate(cases):
            world.Barrier()
            i0, j0 = cpu_times()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            i1, j1 = cpu_times()
            if rep >= warmup:
                times[i, rep - warmup] = dt
                idle[i, rep - warmup] = (i1 - i0) / max(1, j1 - j0)
    world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)  # the slowest rank
    for (label, kind, _), row in zip(cases, idle):
        IDLE[label] = IDLE[kind] = row.tolist()
    return times


def main(argv):
    keep = None
    if '--keep' in argv:
        k = argv.index('--keep')
        keep = re.compile(argv[k + 1])
        argv = argv[:k] + argv[k + 2:]
    harness.run_cases = run_cases
    if keep is not None:
        build = cases.build_cases

        def build_cases(args, world):
            timed, total = build(args, world)
            return [c for c in timed if keep.search(c[0])], total
        cases.build_cases = build_cases
    if harness is cases:  # the old tree: the command was the library
        cases.main(argv)
    else:
        sys.argv[1:] = argv
        runpy.run_module('mnopt.benchmark', run_name='__main__')
    path = argv[argv.index('--json') + 1] if '--json' in argv else None
    if path is None or MPI.COMM_WORLD.rank != 0:
        return
    with open(path) as f:
        result = json.load(f)
    if 'rows' in result:
        for row in result['rows']:
            if row['case'] in IDLE:
                row['cpu_idle'] = spread(IDLE[row['case']])
    else:  # --double-buffering: per kind ('comm', 'plain', ...)
        result['cpu_idle'] = {k: spread(v) for k, v in IDLE.items()
                              if k in ('comm', 'plain', 'double_buffering',
                                       'plain_fp32', 'db_fp16')}
    with open(path, 'w') as f:
        json.dump(result, f, indent=1)


if __name__ == '__main__':
    main(sys.argv[1:])
