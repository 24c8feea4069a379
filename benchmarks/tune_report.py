"""The tables of docs/tuning.md and docs/results/netsim/tune.md from
tune_bench.py's JSON files: per run, the best grid case, the default,
the worst, and each tuned communicator against the best (summary), or
every case (``--full``).

    python benchmarks/tune_report.py docs/results/netsim/tune_*.json
    python benchmarks/tune_report.py --full docs/results/netsim/tune_*.json
"""

import argparse
import json


def fmt(t):
    return '%.3f / %.3f / %.3f' % (t['min'], t['median'], t['max'])


def _name(case):
    """A case's label without '#' (older runs said 'tuned #0')."""
    if case.startswith('tuned #'):
        k, rest = case[len('tuned #'):].split(' ', 1)
        return 'tuned %d %s' % (int(k) + 1, rest)
    return case


def summary(runs):
    lines = ['| run | communicator | best of the grid (median s) | default '
             '(x best) | tuned: choice, x best | tuning: averagings, s |',
             '|---|---|---|---|---|---|']
    for run in runs:
        grid = [c for c in run['cases'] if not c['tuned']]
        best = min(grid, key=lambda c: c['time_s']['median'])
        default = grid[0]
        tuned = [c for c in run['cases'] if c['tuned']]
        lines.append('| %s | `%s` | %s: %.3f | %.3f | %s | %s |' % (
            run.get('label') or run['argv'], run['communicator'],
            best['case'], best['time_s']['median'], default['over_best'],
            '; '.join('%s: **%.3f**' % (c['case'].split('(', 1)[1]
                                        .rstrip(')'), c['over_best'])
                      for c in tuned),
            ', '.join('%d in %.1f' % (t['averagings'], t['seconds'])
                      for t in run['tunings'])))
    return '\n'.join(lines)


def full(runs):
    out = []
    for run in runs:
        out.append('### %s, `%s`, %d ranks, %d repetitions (+1 warm-up)\n'
                   % (run.get('label') or '', run['communicator'],
                      run['ranks'], run['reps']))
        out.append('| case | s (min / median / max) | x best | CPU idle |')
        out.append('|---|---|---|---|')
        for c in run['cases']:
            out.append('| %s%s | %s | %.3f | %.0f%% |' % (
                _name(c['case']), ' (best)' if c['over_best'] == 1.0 and
                not c['tuned'] else '', fmt(c['time_s']), c['over_best'],
                100 * c['cpu_idle']))
        for k, t in enumerate(run['tunings']):
            out.append('\ntuning %d: %d averagings in %.1f s; its times '
                       '(the slowest rank\'s least of 2): %s' % (
                           k + 1, t['averagings'], t['seconds'], ', '.join(
                               '%s %s: %.3f' % (n, v, s)
                               for n, v, s in t['history'])))
        out.append('')
    return '\n'.join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('json', nargs='+')
    p.add_argument('--full', action='store_true', help='every case')
    args = p.parse_args()
    runs = []
    for path in args.json:
        with open(path) as f:
            runs.append(json.load(f))
    print(full(runs) if args.full else summary(runs))


if __name__ == '__main__':
    main()
