#!/usr/bin/env python
"""Does PowerSGD reach the accuracy of uncompressed averaging on a CNN?

    python examples/imagenet/convergence.py [--seeds 3] [--out docs/results]
        [--ranks 1 2] [--warmup-steps 8] [--epochs 16]

Runs train_imagenet.py on its embedded ImageNet-format set (``smallcnn``:
four convolutions, whose kernels PowerSGD compresses as out x in*3*3
matrices, and two fully connected layers) on 4 ranks, CPU, communicator
``flat``, 16 images per rank (the 64 of the documented 2-rank run), for
``--epochs`` (16: at the example's 8, 80 iterations, float32 itself is
still learning and PowerSGD lags far behind), the example's defaults
otherwise (momentum SGD, lr 0.05 decayed linearly to 0 at the end):
float32, then PowerSGD at each ``--ranks`` after ``--warmup-steps`` plain
iterations, for several seeds.  Writes ``cnn_powersgd.json``,
``cnn_powersgd.md`` (a table, the seeds, the command) and
``cnn_powersgd.png`` (validation accuracy per epoch) under ``--out``
(``--stem`` names them otherwise); ``--replot`` rewrites the table and
the figure from the JSON without training.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
N_RANKS, BATCH = 4, 16


def configs(ranks, warmup):
    out = [('4 ranks, float32', [])]
    for r in ranks:
        out.append(('4 ranks, PowerSGD rank %d, warmup %d' % (r, warmup),
                    ['--compression', 'powersgd', '--powersgd-rank', str(r),
                     '--warmup-steps', str(warmup)]))
    return out


def run(extra, seed, cache, epochs):
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    out = tempfile.mkdtemp(prefix='cnn_powersgd')
    try:
        subprocess.run(
            [mpiexec if os.path.exists(mpiexec) else 'mpiexec',
             '-n', str(N_RANKS), sys.executable, '-m', 'mpi4py',
             os.path.join(HERE, 'train_imagenet.py'), '--cpu',
             '--communicator', 'flat', '--batchsize', str(BATCH),
             '--seed', str(seed), '--epoch', str(epochs), '--out', out,
             '--data-cache', cache,
             # One snapshot, at the end: they are not what is measured.
             '--snapshot-interval', '100000'] + extra,
            check=True, stdout=subprocess.DEVNULL, timeout=900)
        log = json.load(open(os.path.join(out, 'log')))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    curve = [e['validation/main/accuracy'] for e in log
             if 'validation/main/accuracy' in e]
    return {'seed': seed, 'args': extra, 'curve': curve,
            'test_accuracy': curve[-1],
            'train_loss': [e['main/loss'] for e in log
                           if 'validation/main/accuracy' in e]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--seeds', type=int, default=3)
    p.add_argument('--first-seed', type=int, default=0)
    p.add_argument('--stem', default='cnn_powersgd',
                   help='the files\' name, before .json, .md, .png')
    p.add_argument('--ranks', type=int, nargs='+', default=[1, 2])
    p.add_argument('--epochs', type=int, default=16)
    p.add_argument('--warmup-steps', type=int, default=8)
    p.add_argument('--out', default='docs/results')
    p.add_argument('--data-cache', default=os.path.join(
        os.path.expanduser('~'), '.cache', 'mnopt', 'imagenet-embedded'))
    p.add_argument('--replot', action='store_true',
                   help='the table and figure from the JSON already there '
                   '(with the arguments it was run with)')
    args = p.parse_args()
    todo = configs(args.ranks, args.warmup_steps)
    stem = os.path.join(args.out, args.stem)
    if args.replot:
        with open(stem + '.json') as f:
            results = json.load(f)
    else:
        results = {}
        for label, extra in todo:
            results[label] = [run(extra, s, args.data_cache, args.epochs)
                              for s in range(args.first_seed,
                                             args.first_seed + args.seeds)]
            print('%-40s %s' % (label, ' '.join(
                '%.4f' % r['test_accuracy'] for r in results[label])),
                flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(stem + '.json', 'w') as f:
            json.dump(results, f, indent=1)
    base = numpy.array([r['test_accuracy']
                        for r in results[todo[0][0]]]) * 100
    lines = ['| configuration | validation accuracy % (mean of {0} seeds) | '
             'min / median / max | per seed | vs 4 ranks float32, mean '
             '(points) | per seed (points) |'.format(args.seeds),
             '|---|---|---|---|---|---|']
    seeds = ', '.join(str(r['seed']) for r in results[todo[0][0]])
    for label, _ in todo:
        accs = numpy.array([r['test_accuracy'] for r in results[label]]) * 100
        lines.append('| %s | %.2f | %.2f / %.2f / %.2f | %s | %+.2f | %s |' % (
            label, accs.mean(), accs.min(), numpy.median(accs), accs.max(),
            ', '.join('%.2f' % a for a in accs), accs.mean() - base.mean(),
            ', '.join('%+.2f' % d for d in accs - base)))
    command = ' '.join(['python examples/imagenet/convergence.py',
                        '--seeds', str(args.seeds)] +
                       (['--first-seed', str(args.first_seed)]
                        if args.first_seed else []) + ['--ranks'] +
                       [str(r) for r in args.ranks] +
                       ['--warmup-steps', str(args.warmup_steps),
                        '--epochs', str(args.epochs),
                        '--out', args.out] +
                       (['--stem', args.stem]
                        if args.stem != 'cnn_powersgd' else []))
    with open(stem + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n\nSeeds %s.  Command: `%s`\n'
                % (seeds, command))
    print('\n'.join(lines))
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, _ in todo:
        curves = numpy.array([r['curve'] for r in results[label]]) * 100
        epochs = numpy.arange(1, curves.shape[1] + 1)
        ax.plot(epochs, curves.mean(axis=0), marker='o', label=label)
    ax.set_xlabel('epoch')
    ax.set_ylabel('validation accuracy % (mean over seeds)')
    ax.grid(alpha=0.3)
    ax.legend(loc='lower right', fontsize=8)
    ax.set_title('smallcnn on the embedded ImageNet-format set, 4 ranks x '
                 '%d images, %d epochs' % (BATCH, args.epochs), fontsize=10)
    fig.tight_layout()
    fig.savefig(stem + '.png', dpi=100)


if __name__ == '__main__':
    main()
