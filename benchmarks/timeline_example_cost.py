"""What observing costs a real training step: the ImageNet example's
median step with mnopt as it was before the timeline and the per-step
figures existed, with today's mnopt (timeline off: the figures are kept
anyway), and with today's mnopt recording a timeline.  A benchmark, not a
test.

    git worktree add /tmp/before bcfda6b~1     # mnopt before the timeline
    python benchmarks/timeline_example_cost.py --before /tmp/before

Every variant runs the *same* example script (the one in --before: today's
adds a CommunicationReport, whose cost is the report's, not the
timeline's) on its own mnopt (PYTHONPATH), ``--runs`` times, the variants
in turn within each run so that a busy spell of the machine hits all of
them.  Prints each variant's min / median / max of the runs' median step
and the ratio of the medians to the first variant.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def run_example(root, script, args, timeline):
    """Median step (s) of one run of ``script`` on the mnopt in ``root``."""
    out = tempfile.mkdtemp(prefix='mnopt-tl-cost-')
    env = dict(os.environ, PYTHONPATH=root)
    env.pop('MNOPT_TIMELINE', None)
    if timeline:
        env['MNOPT_TIMELINE'] = os.path.join(out, 'trace', 'trace.json')
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    try:
        proc = subprocess.run(
            [mpiexec, '-n', str(args.ranks), sys.executable, '-m', 'mpi4py',
             script, '--cpu', '--iteration', str(args.iteration), '--out',
             os.path.join(out, 'result')] + args.example_args,
            env=env, capture_output=True, text=True, timeout=900)
        found = re.search(r'median step ([0-9.]+) s', proc.stdout)
        if proc.returncode != 0 or not found:
            raise RuntimeError('the example failed (%d):\n%s' % (
                proc.returncode, (proc.stdout + proc.stderr)[-3000:]))
        return float(found.group(1))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        epilog='Example: python benchmarks/timeline_example_cost.py '
               '--before /tmp/before --runs 5')
    p.add_argument('--before', required=True, metavar='CHECKOUT',
                   help='a checkout of mnopt before the timeline (its '
                        'example script is the one every variant runs)')
    p.add_argument('--runs', type=int, default=5)
    p.add_argument('--iteration', type=int, default=30)
    p.add_argument('--ranks', type=int, default=2)
    p.add_argument('example_args', nargs='*',
                   help='more arguments for the example (after --)')
    args = p.parse_args(argv)
    script = os.path.join(args.before, 'examples', 'imagenet',
                          'train_imagenet.py')
    variants = [('before', args.before, False),
                ('today, timeline off', REPO, False),
                ('today, timeline on', REPO, True)]
    steps = {name: [] for name, _, _ in variants}
    for r in range(args.runs):
        turn = variants[r % 3:] + variants[:r % 3]
        for name, root, timeline in turn:
            steps[name].append(run_example(root, script, args, timeline))
            print('run %d %-20s median step %.4f s'
                  % (r, name, steps[name][-1]), flush=True)
    base = statistics.median(steps[variants[0][0]])
    print('\n%-20s %8s %8s %8s %8s' % ('', 'min', 'median', 'max', 'ratio'))
    for name, _, _ in variants:
        s = steps[name]
        print('%-20s %8.4f %8.4f %8.4f %8.3f' % (
            name, min(s), statistics.median(s), max(s),
            statistics.median(s) / base))


if __name__ == '__main__':
    main()
