"""What a snapshot every N iterations costs the ImageNet example's step:
no snapshots (one at the end only), snapshots written in line, and in the
background (--async-snapshots).  A benchmark, not a test.

    python benchmarks/snapshot_cost.py --runs 3 --every 5

Each run trains ``--iteration`` steps on ``--ranks`` ranks (CPU, the
embedded set) and measures the mean step between the log's entries at
iterations 5 and ``--iteration`` - 5 (the snapshots inside that window
counted, the start-up, the final validation and the final snapshot not).
The variants run in turn within each run, so that a busy spell of the
machine hits all of them.  Prints each variant's runs, their median and
its ratio to no snapshots (higher is slower).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TRAIN = os.path.join(REPO, 'examples', 'imagenet', 'train_imagenet.py')

VARIANTS = {
    'none': lambda every: ['--snapshot-interval', '1000000'],
    'in line': lambda every: ['--snapshot-interval', str(every)],
    'async': lambda every: ['--snapshot-interval', str(every),
                            '--async-snapshots'],
}


def mean_step(args, flags, cache):
    out = tempfile.mkdtemp(prefix='mnopt-snap-cost-')
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    try:
        proc = subprocess.run(
            [mpiexec, '-n', str(args.ranks), sys.executable, '-m', 'mpi4py',
             TRAIN, '--cpu', '--noplot', '--iteration', str(args.iteration),
             '--out', out, '--data-cache', cache] + flags,
            env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
            text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError('the example failed (%d):\n%s' % (
                proc.returncode, (proc.stdout + proc.stderr)[-3000:]))
        with open(os.path.join(out, 'log')) as f:
            at = {e['iteration']: e['elapsed_time'] for e in json.load(f)}
        first, last = 5, args.iteration - 5
        return (at[last] - at[first]) / (last - first)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--runs', type=int, default=3)
    p.add_argument('--every', type=int, default=5,
                   help='iterations between snapshots')
    p.add_argument('--iteration', type=int, default=60)
    p.add_argument('--ranks', type=int, default=2)
    args = p.parse_args(argv)
    cache = tempfile.mkdtemp(prefix='mnopt-snap-cost-data-')
    steps = {v: [] for v in VARIANTS}
    try:
        for _ in range(args.runs):
            for name, flags in VARIANTS.items():
                steps[name].append(mean_step(args, flags(args.every), cache))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    base = statistics.median(steps['none'])
    print('mean step, %d ranks, a snapshot every %d iterations, %d runs'
          % (args.ranks, args.every, args.runs))
    for name, got in steps.items():
        median = statistics.median(got)
        print('%-8s %s  median %.4f s  %.3fx no snapshots' % (
            name, ' '.join('%.4f' % s for s in got), median, median / base))


if __name__ == '__main__':
    main()
