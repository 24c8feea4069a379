"""What a snapshot every N iterations costs the ImageNet example's step:
no snapshots (one at the end only), snapshots written in line, and in the
background (--async-snapshots).  A benchmark, not a test.

    python benchmarks/snapshot_cost.py --runs 3 --every 5
    python benchmarks/snapshot_cost.py --blocking --megabytes 5.6

``--blocking`` measures instead, in this one process, how long a
``multi_node_snapshot`` call holds the training thread for a model of
``--megabytes`` of parameters (the example's smallest is 5.6 MB), in line
and in the background (the write in flight waited for outside the
timing): what a busy machine's noise hides in the step times.

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


def blocking(megabytes, repeats):
    """{variant: median seconds a snapshot call holds the caller}."""
    import time
    import numpy
    import chainer
    import mnopt
    comm = mnopt.create_communicator('naive')
    n = int(megabytes * 1e6 / 4)
    model = chainer.links.Linear(1000, n // 1000)
    opt = mnopt.create_multi_node_optimizer(chainer.optimizers.SGD(), comm)
    opt.setup(model)
    it = chainer.iterators.SerialIterator(numpy.zeros((8, 1000), 'f'), 4)
    held = {}
    for name, asynchronous in (('in line', False), ('async', True)):
        out = tempfile.mkdtemp(prefix='mnopt-snap-block-')
        trainer = chainer.training.Trainer(
            chainer.training.StandardUpdater(it, opt), (1, 'iteration'),
            out=out)
        ext = mnopt.extensions.multi_node_snapshot(
            comm, chainer.training.extensions.snapshot_object(
                model, 'snapshot_iter_{.updater.iteration}', n_retains=2),
            asynchronous=asynchronous)
        ext.initialize(trainer)
        times = []
        for k in range(repeats):
            trainer.updater.iteration = k + 1
            start = time.perf_counter()
            ext(trainer)
            times.append(time.perf_counter() - start)
            if asynchronous:
                ext.snapshot.writer.wait()   # outside the timing
        ext.finalize()
        shutil.rmtree(out, ignore_errors=True)
        held[name] = statistics.median(times)
    return held


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--runs', type=int, default=3)
    p.add_argument('--every', type=int, default=5,
                   help='iterations between snapshots')
    p.add_argument('--iteration', type=int, default=60)
    p.add_argument('--ranks', type=int, default=2)
    p.add_argument('--blocking', action='store_true',
                   help='time how long a snapshot call holds the training '
                   'thread, in this process')
    p.add_argument('--megabytes', type=float, default=5.6)
    args = p.parse_args(argv)
    if args.blocking:
        held = blocking(args.megabytes, max(args.runs, 10))
        print('a snapshot of %.1f MB holds the training thread (median of '
              '%d calls):' % (args.megabytes, max(args.runs, 10)))
        for name, seconds in held.items():
            print('%-8s %.1f ms' % (name, 1000 * seconds))
        return
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
