#!/usr/bin/env python
"""Local steps (DiLoCo, Streaming DiLoCo) on the example's CNN: the
final validation accuracy beside synchronous training and PowerSGD.

    python examples/imagenet/local_sgd_study.py [--seeds 1] [--epochs 16]
        [--out docs/results] [--outer-lr 0.7]

Runs train_imagenet.py as convergence.py does (``smallcnn`` on the
embedded ImageNet-format set, 4 ranks, CPU, communicator ``flat``, 16
images per rank, momentum SGD with lr 0.05 decayed linearly to 0; with
local steps the inner lr is 0.05 over the 4 ranks, for one rank's batch):
the same samples seen in every configuration.  Synchronous float32,
PowerSGD rank 2 (8 plain iterations first), then ``--local-steps H`` for
H in 1, 8, 32, 128, and with 4 fragments (H 8, 32, 128), with DiLoCo's
outer Nesterov (``--outer-lr``, ``--outer-momentum``: DiLoCo's 0.7 and
0.9 unless given).  Writes ``<stem>.json``, ``<stem>.md`` (a table with the command) and
``<stem>.png`` (validation accuracy per epoch) under ``--out``."""

import argparse
import json
import os
import sys

import numpy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import convergence  # NOQA


def configs(outer):
    out = [('synchronous, float32', []),
           ('PowerSGD rank 2, warmup 8',
            ['--compression', 'powersgd', '--powersgd-rank', '2',
             '--warmup-steps', '8'])]
    for h, f in ((1, 1), (8, 1), (8, 4), (32, 1), (32, 4), (128, 1),
                 (128, 4)):
        out.append(('H=%d, F=%d' % (h, f),
                    ['--local-steps', str(h), '--fragments', str(f)]
                    + outer))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--seeds', type=int, default=1)
    p.add_argument('--epochs', type=int, default=16)
    p.add_argument('--outer-lr', type=float, default=None)
    # DiLoCo's 0.9 (the example's own default is 0.5): the study's tables
    # are of DiLoCo's settings unless this says otherwise.
    p.add_argument('--outer-momentum', type=float, default=0.9)
    p.add_argument('--only', nargs='*', default=None,
                   help='labels to run (the others are read from the '
                   'JSON already there)')
    p.add_argument('--skip', nargs='*', default=[],
                   help='labels not to run (nor to show)')
    p.add_argument('--stem', default='cnn_local_sgd')
    p.add_argument('--out', default='docs/results')
    p.add_argument('--data-cache', default=os.path.join(
        os.path.expanduser('~'), '.cache', 'mnopt', 'imagenet-embedded'))
    args = p.parse_args()
    outer = (['--outer-lr', str(args.outer_lr)] if args.outer_lr else []) \
        + ['--outer-momentum', str(args.outer_momentum)]
    stem = os.path.join(args.out, args.stem)
    results = {}
    if os.path.exists(stem + '.json'):
        with open(stem + '.json') as f:
            results = json.load(f)
    todo = [c for c in configs(outer) if c[0] not in args.skip]
    for label, extra in todo:
        if args.only is not None and label not in args.only and \
                label in results:
            continue
        results[label] = [convergence.run(extra, s, args.data_cache,
                                          args.epochs)
                          for s in range(args.seeds)]
        print('%-30s %s' % (label, ' '.join(
            '%.4f' % r['test_accuracy'] for r in results[label])),
            flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(stem + '.json', 'w') as f:
            json.dump(results, f, indent=1)
    base = numpy.mean([r['test_accuracy']
                       for r in results[todo[0][0]]]) * 100
    lines = ['| configuration | validation accuracy %% (mean of %d seeds) '
             '| per seed | vs synchronous (points) |' % args.seeds,
             '|---|---|---|---|']
    for label, _ in todo:
        if label not in results:
            continue
        accs = numpy.array([r['test_accuracy'] for r in results[label]]) \
            * 100
        lines.append('| %s | %.2f | %s | %+.2f |' % (
            label, accs.mean(), ', '.join('%.2f' % a for a in accs),
            accs.mean() - base))
    command = ' '.join(['python examples/imagenet/local_sgd_study.py',
                        '--seeds', str(args.seeds), '--epochs',
                        str(args.epochs)] + outer + ['--out', args.out] + (
                            ['--skip'] + ["'%s'" % s for s in args.skip]
                            if args.skip else []))
    with open(stem + '.md', 'w') as f:
        f.write('\n'.join(lines) + '\n\nCommand: `%s`\n' % command)
    print('\n'.join(lines))
    plot([label for label, _ in todo if label in results], results,
         stem + '.png')


def plot(labels, results, path):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for label in labels:
        curves = numpy.array([r['curve'] for r in results[label]]) * 100
        epochs = numpy.arange(1, curves.shape[1] + 1)
        ax.plot(epochs, curves.mean(axis=0), label=label,
                linestyle='-' if label.endswith('F=1') or 'H=' not in label
                else '--')
    ax.set_xlabel('epoch (10 updates of 4 x 16 images)')
    ax.set_ylabel('validation accuracy % (synced parameters)')
    ax.set_ylim(0, 101)
    ax.grid(alpha=0.3)
    ax.legend(loc='lower right', fontsize=8)
    ax.set_title('smallcnn, 4 ranks: local steps (DiLoCo outer Nesterov) '
                 'vs synchronous and PowerSGD')
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == '__main__':
    main()
