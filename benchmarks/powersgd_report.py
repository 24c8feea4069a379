"""The Markdown tables of benchmarks/powersgd_bench.py's JSON files: a
summary (one row per node count and link rate: the acceptance checks)
and each run's cases.

    .venv/gloo/bin/python benchmarks/powersgd_report.py \\
        docs/results/netsim/powersgd_{4,8}_*.json

Checks, each run on its own (the cases of one run shared the machine
round-robin, so their ratios are what is comparable; runs are not):

- PowerSGD faster than plain: mnopt powersgd r4's median step below both
  mnopt flat float32's and float16's;
- 'auto' never slower: mnopt auto r4's median at most 5% above the
  quicker of flat float32 and float16;
- mnopt against torch: mnopt powersgd r4's median over the quicker
  powerSGD_hook case of the run (one bucket, or DDP's buckets serialized:
  see powersgd_bench.serialized for why not DDP's buckets as they come).

A grid point may be measured in more than one run (at 8 nodes the cases
do not all fit 24 GiB at once): each run is a row of its own.
"""

import argparse
import json
import os

FLAT32, FLAT16 = 'mnopt flat float32', 'mnopt flat float16 wire'
PSGD, AUTO = 'mnopt powersgd r4', 'mnopt auto r4'
AUTO16 = 'mnopt auto r4, float16 wire'
TORCH_HOOKS = ('torch DDP powerSGD_hook r4, one bucket',
               'torch DDP powerSGD_hook r4, buckets serialized')
TORCH_DDP = 'torch DDP float32'
AUTO_SLACK = 1.05


def rate_name(mbit):
    return '%g Gbit/s' % (mbit / 1000) if mbit >= 1000 else '%g Mbit/s' % mbit


def medians(run):
    return {c['case']: c['time_s']['median'] for c in run['cases']}


def summary(runs):
    lines = ['| nodes | link | run | flat f32 s | flat f16 s | powersgd r4 s '
             '| auto r4 s (chose) | auto r4 f16 s (chose) | torch DDP s | '
             'torch hook r4 s | powersgd < plain (the goal below 10 Gbit/s) '
             '| auto / best plain | auto f16 / best plain | '
             'mnopt / torch hook |',
             '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|']
    for run in runs:
        m = medians(run)
        best_plain = min(m.get(FLAT32, float('inf')),
                         m.get(FLAT16, float('inf')))
        plain_known = FLAT32 in m and FLAT16 in m

        def fmt(key):
            return '%.3f' % m[key] if key in m else ''

        def auto_cell(key):
            if key not in m:
                return ''
            row = next(c for c in run['cases'] if c['case'] == key)
            chose = ', '.join(w.split(': ')[1] for w in
                              (row.get('state') or {}).get('auto_choices',
                                                           []))
            return '%.3f (%s)' % (m[key], chose)

        def against_plain(key):
            if key not in m or not plain_known:
                return ''
            r = m[key] / best_plain
            return '%.2f%s' % (r, '' if r <= AUTO_SLACK else ' (>1.05)')
        faster = (('yes' if m[PSGD] < best_plain else 'NO')
                  if PSGD in m and plain_known else '')
        hooks = [h for h in TORCH_HOOKS if h in m]
        hook = min(hooks, key=m.get) if hooks else None
        vs_torch = ('%.2f' % (m[PSGD] / m[hook])
                    if PSGD in m and hook else '')
        hook_cell = ('%.3f (%s)' % (m[hook], hook.split(', ')[-1])
                     if hook else '')
        lines.append('| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s '
                     '| %s | %s | %s |' % (
                         run['n_ranks'], rate_name(run['rate_mbit']),
                         os.path.basename(run['json']), fmt(FLAT32),
                         fmt(FLAT16), fmt(PSGD), auto_cell(AUTO),
                         auto_cell(AUTO16), fmt(TORCH_DDP), hook_cell,
                         faster, against_plain(AUTO), against_plain(AUTO16),
                         vs_torch))
    return '\n'.join(lines)


def run_table(run):
    lines = ['### %d nodes, %s (%s, %d reps + %d warm-up, %.1f MB of '
             'float32 gradients)' % (
                 run['n_ranks'], rate_name(run['rate_mbit']),
                 os.path.basename(run.get('json', '')), run['reps'],
                 run['warmup'], run['bytes'] / 1e6), '',
             '| case | min s | median s | max s | x flat f32 | MB sent/rank, '
             'mnopt count | MB sent/rank, analytic | MB eth0 tx/rank | '
             'CPU idle % | replicas agree | mnopt averaging s (in wire) |',
             '|---|---|---|---|---|---|---|---|---|---|---|']
    for c in run['cases']:
        t = c['time_s']
        mine = c.get('mnopt_bytes_sent_per_rank')
        split = ''
        if 'mnopt_averaging_s' in c:
            split = '%.3f (%.3f)' % (c['mnopt_averaging_s'],
                                     c['mnopt_wire_s'])
        lines.append('| %s | %.3f | %.3f | %.3f | %s | %s | %.2f | %.2f | '
                     '%.0f | %s | %s |' % (
                         c['case'], t['min'], t['median'], t['max'],
                         '%.2f' % c['x_flat_float32']
                         if c.get('x_flat_float32') else '',
                         '' if mine is None else '%.2f' % (mine / 1e6),
                         c['analytic_sent_bytes'] / 1e6,
                         c['eth0_tx_bytes_per_rank'] / 1e6,
                         100 * c['cpu_idle']['median'],
                         {True: 'yes', False: 'NO', None: ''}[
                             c.get('replicas_agree')], split))
    rss = run.get('peak_rss_bytes')
    if rss:
        lines += ['', 'Peak resident memory per rank: %.1f-%.1f GB.'
                  % (min(rss) / 1e9, max(rss) / 1e9)]
    return '\n'.join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('files', nargs='+')
    args = p.parse_args()
    runs = []
    for name in args.files:
        with open(name) as f:
            run = json.load(f)
        run['json'] = name
        runs.append(run)
    runs.sort(key=lambda r: (r['n_ranks'], r['rate_mbit'], r['json']))
    a = runs[0]['analytic']
    print('ResNet-50 at rank 4: %.1fx fewer bytes than float32 '
          '(powersgd.compression_rate)\n'
          % a['resnet50_compression_rate_r4'])
    print(summary(runs))
    for run in runs:
        print()
        print(run_table(run))


if __name__ == '__main__':
    main()
