#!/usr/bin/env python
"""Does data-parallel training with mnopt reach the accuracy of one process?

    python examples/digits/convergence.py [--seeds 3] [--out docs]
        [--study precision|sign|powersgd|local_sgd] [--replot] [--missing]

Runs train_digits.py with 1 rank in float32 (the baseline) and with 4 ranks
in float32, float16, double buffering, and float16 + double buffering, all
with the same total batch and epochs, for several seeds; writes
``digits_convergence.json``, ``digits_convergence.md`` (a table) and
``digits_convergence.png`` (test accuracy per epoch) under ``--out``.
``--study`` runs another set of configurations (sign compression,
PowerSGD, local steps) into files of its own; ``--replot`` rewrites the table and the
figure from the study's JSON without training; ``--missing`` runs only the
configurations that JSON lacks.  The local_sgd study's PyTorch rows run
train_digits_torch.py with ``--torch-python`` (default .venv/gloo's).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = [
    ('1 rank, float32 (baseline)', 1, []),
    ('4 ranks, float32', 4, []),
    ('4 ranks, float16', 4, ['--allreduce-grad-dtype', 'float16']),
    ('4 ranks, double buffering', 4, ['--double-buffering']),
    ('4 ranks, float16 + double buffering', 4,
     ['--allreduce-grad-dtype', 'float16', '--double-buffering']),
]
# Sign compression (--study sign): the voted signs times the mean scale
# have a larger norm than the mean gradient, so they take a smaller lr.
SIGN_CONFIGS = [
    CONFIGS[0],
    ('4 ranks, sign + error feedback, lr 0.02', 4,
     ['--compression', 'sign', '--lr', '0.02']),
    ('4 ranks, sign, no error feedback, lr 0.02', 4,
     ['--compression', 'sign', '--no-error-feedback', '--lr', '0.02']),
    ('4 ranks, sign + error feedback, Signum lr 0.002', 4,
     ['--compression', 'sign', '--optimizer', 'signum', '--lr', '0.002']),
]
# PowerSGD (--study powersgd): an approximation of the mean, so the
# default lr; error feedback on, and the first WARMUP iterations (about
# 3% of the 30 epochs' 690) averaged plain, as the paper and PyTorch do.
WARMUP = 20
POWERSGD_CONFIGS = [
    CONFIGS[0], CONFIGS[1], CONFIGS[2], SIGN_CONFIGS[1],
] + [('4 ranks, PowerSGD rank %d, warmup %d' % (r, WARMUP), 4,
      ['--compression', 'powersgd', '--powersgd-rank', str(r),
       '--warmup-steps', str(WARMUP)]) for r in (1, 2, 4)]
# Local steps (--study local_sgd, docs/local_sgd.md): DiLoCo's outer
# Nesterov (lr 0.7, momentum 0.9) every H inner MomentumSGD updates; with
# 4 fragments each averaging runs behind the next inner update (delay 1).
LOCAL_CONFIGS = [CONFIGS[0], CONFIGS[1]] + [
    ('4 ranks, local steps H=%d%s' % (
        h, ', 4 fragments, delay 1' if f > 1 else ''), 4,
     ['--local-steps', str(h)] + (
         ['--fragments', str(f), '--fragment-sync-delay', '1']
         if f > 1 else []))
    for h, f in ((1, 1), (8, 1), (32, 1), (8, 4), (32, 4))] + [
    # Plain model averaging every H (PyTorch's post-local SGD,
    # PeriodicModelAverager): an outer SGD of lr 1, no momentum.
    ('4 ranks, model averaging every H=%d' % h, 4,
     ['--local-steps', str(h), '--outer-lr', '1', '--outer-momentum', '0'])
    for h in (1, 8, 32, 128)] + [
    ('4 ranks, local steps H=128%s' % (
        ', 4 fragments, delay 1' if f > 1 else ''), 4,
     ['--local-steps', '128'] + (
         ['--fragments', str(f), '--fragment-sync-delay', '1']
         if f > 1 else []))
    for f in (1, 4)] + [
    # H=32 without fragments: a lower outer momentum (it stacks on the
    # inner one at small H), or synchronous updates first (about 6%).
    ('4 ranks, local steps H=32, outer momentum 0.5', 4,
     ['--local-steps', '32', '--outer-momentum', '0.5']),
    ('4 ranks, local steps H=8, outer momentum 0.5', 4,
     ['--local-steps', '8', '--outer-momentum', '0.5']),
    ('4 ranks, local steps H=128, outer momentum 0.5', 4,
     ['--local-steps', '128', '--outer-momentum', '0.5']),
    ('4 ranks, local steps H=32, 4 fragments, delay 1, outer momentum 0.5',
     4, ['--local-steps', '32', '--fragments', '4',
         '--fragment-sync-delay', '1', '--outer-momentum', '0.5']),
    ('4 ranks, local steps H=32, 40 synchronous updates first', 4,
     ['--local-steps', '32', '--sync-warmup-steps', '40'])] + [
    # PyTorch's post-local SGD itself (train_digits_torch.py; torch from
    # --torch-python): the same model, split and order as mnopt's plain
    # model averaging above.
    ('4 ranks, PyTorch PeriodicModelAverager every H=%d' % h, 4,
     ['--period', str(h)], 'train_digits_torch.py')
    for h in (8, 32, 128)]
STUDIES = {'precision': ('digits_convergence', CONFIGS),
           'sign': ('digits_sign', SIGN_CONFIGS),
           'powersgd': ('digits_powersgd', POWERSGD_CONFIGS),
           'local_sgd': ('digits_local_sgd', LOCAL_CONFIGS)}


def run(n, extra, seed, epochs, script='train_digits.py',
        python=sys.executable):
    mpiexec = os.path.join(os.path.dirname(python), 'mpiexec')
    with tempfile.NamedTemporaryFile(suffix='.json') as f:
        subprocess.run(
            [mpiexec if os.path.exists(mpiexec) else 'mpiexec', '-n', str(n),
             python, '-m', 'mpi4py',
             os.path.join(HERE, script), '--seed', str(seed),
             '--epoch', str(epochs), '--json', f.name] + extra,
            check=True, stdout=subprocess.DEVNULL, timeout=600)
        return json.load(open(f.name))


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--seeds', type=int, default=3)
    p.add_argument('--epochs', type=int, default=30)
    p.add_argument('--out', default='docs')
    p.add_argument('--study', default='precision', choices=sorted(STUDIES))
    p.add_argument('--replot', action='store_true',
                   help='the table and figure from the JSON already there')
    p.add_argument('--missing', action='store_true',
                   help='run only the configurations not in the JSON '
                   'already there, keep the others')
    p.add_argument('--torch-python', default=os.path.join(
        HERE, '..', '..', '.venv', 'gloo', 'bin', 'python'),
        help='the Python with torch for the PyTorch rows')
    args = p.parse_args()
    stem, configs = STUDIES[args.study]
    if args.replot:
        with open(os.path.join(args.out, stem + '.json')) as f:
            results = json.load(f)
        args.seeds = len(results[configs[0][0]])
        args.epochs = results[configs[0][0]][0]['epochs']
    else:
        results = {}
        path = os.path.join(args.out, stem + '.json')
        if args.missing and os.path.exists(path):
            with open(path) as f:
                results = json.load(f)
        for config in configs:
            label, n, extra = config[:3]
            if label in results:
                continue
            script = config[3] if len(config) > 3 else 'train_digits.py'
            python = sys.executable if script == 'train_digits.py' else \
                args.torch_python
            results[label] = [run(n, extra, s, args.epochs, script, python)
                              for s in range(args.seeds)]
            accs = [r['test_accuracy'] for r in results[label]]
            print('%-40s %s' % (label, ' '.join('%.4f' % a for a in accs)),
                  flush=True)
            os.makedirs(args.out, exist_ok=True)
            with open(path, 'w') as f:
                json.dump(results, f, indent=1)

    def mean(label):
        return numpy.mean([r['test_accuracy'] for r in results[label]]) * 100

    def points(delta):   # +0.00, never -0.00 from rounding
        return '%+.2f' % (round(delta, 2) + 0.0)

    base = mean(configs[0][0])
    # Where the study has it, also against 4 ranks in float32: what a
    # compression changes, apart from what data parallelism does.
    four = CONFIGS[1][0] if CONFIGS[1][0] in results else None
    lines = ['| configuration | test accuracy %% (mean of %d seeds) | '
             'min / median / max | per seed | vs baseline (points)%s |'
             % (args.seeds, ' | vs 4 ranks, float32 (points)' if four
                else ''),
             '|---|---|---|---|---|' + ('---|' if four else '')]
    for label in [c[0] for c in configs]:
        accs = numpy.array([r['test_accuracy'] for r in results[label]]) * 100
        lines.append('| %s | %.2f | %.2f / %.2f / %.2f | %s | %s |%s' % (
            label, accs.mean(), accs.min(), numpy.median(accs), accs.max(),
            ', '.join('%.2f' % a for a in accs), points(accs.mean() - base),
            ' %s |' % points(accs.mean() - mean(four)) if four else ''))
    command = 'python examples/digits/convergence.py --study %s --seeds %d ' \
        '--epochs %d --out %s' % (args.study, args.seeds, args.epochs,
                                  args.out)
    torch_rows = [c[0] for c in configs if len(c) > 3]
    note = '' if not torch_rows else (
        '\nThe PyTorch rows: examples/digits/train_digits_torch.py (torch '
        '%s, gloo, `PostLocalSGDOptimizer` with `PeriodicModelAverager`), '
        'run with `--torch-python` (default .venv/gloo/bin/python); '
        'accuracy of the mean of the ranks\' replicas.\n'
        % results[torch_rows[0]][0].get('torch', '?'))
    with open(os.path.join(args.out, stem + '.md'), 'w') as f:
        f.write('\n'.join(lines) + '\n\nCommand: `%s`\n' % command + note)
    print('\n'.join(lines))
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.cm.tab20(numpy.linspace(0, 1, 20))
    for i, config in enumerate(configs):
        label = config[0]
        curves = numpy.array([r['curve'] for r in results[label]]) * 100
        epochs = numpy.arange(1, curves.shape[1] + 1)
        # Dashed: plain model averaging (mnopt's or PyTorch's).
        ax.plot(epochs, curves.mean(axis=0), label=label,
                color=colors[i % 20], linestyle='--' if 'averag' in label
                else '-')
    ax.set_xlabel('epoch')
    ax.set_ylabel('test accuracy % (mean over seeds)')
    ax.set_ylim(85, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc='lower right', fontsize=7)
    ax.set_title('Digits MLP, total batch 64: 1 rank vs 4 ranks (%s)'
                 % args.study)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, stem + '.png'), dpi=100)


if __name__ == '__main__':
    main()
