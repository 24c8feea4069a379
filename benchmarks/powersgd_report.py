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
- mnopt against torch: mnopt powersgd r4's median over powerSGD_hook's
  (one bucket: see powersgd_bench.serialized for why not DDP's buckets).
"""

import argparse
import json
import os

FLAT32, FLAT16 = 'mnopt flat float32', 'mnopt flat float16 wire'
PSGD, AUTO = 'mnopt powersgd r4', 'mnopt auto r4'
TORCH_HOOK = 'torch DDP powerSGD_hook r4, one bucket'
TORCH_DDP = 'torch DDP float32'
AUTO_SLACK = 1.05


def rate_name(mbit):
    return '%g Gbit/s' % (mbit / 1000) if mbit >= 1000 else '%g Mbit/s' % mbit


def medians(run):
    return {c['case']: c['time_s']['median'] for c in run['cases']}


def summary(runs):
    lines = ['| nodes | link | MB | flat f32 s | flat f16 s | powersgd r4 s '
             '| auto r4 s (chose) | torch DDP s | torch hook r4 s | '
             'powersgd < plain | auto / best plain | mnopt / torch hook |',
             '|---|---|---|---|---|---|---|---|---|---|---|---|']
    for run in runs:
        m = medians(run)
        best_plain = min(m.get(FLAT32, float('inf')),
                         m.get(FLAT16, float('inf')))
        auto_row = next((c for c in run['cases'] if c['case'] == AUTO), None)
        chose = ''
        if auto_row and auto_row.get('state'):
            chose = ', '.join(w.split(': ')[1] for w in
                              auto_row['state'].get('auto_choices', []))

        def fmt(key):
            return '%.3f' % m[key] if key in m else ''
        faster = (('yes' if m[PSGD] < best_plain else 'NO')
                  if PSGD in m and best_plain < float('inf') else '')
        auto_ratio = ''
        if AUTO in m and best_plain < float('inf'):
            r = m[AUTO] / best_plain
            auto_ratio = '%.2f%s' % (r, '' if r <= AUTO_SLACK else ' (>1.05)')
        vs_torch = ('%.2f' % (m[PSGD] / m[TORCH_HOOK])
                    if PSGD in m and TORCH_HOOK in m else '')
        lines.append('| %d | %s | %.1f | %s | %s | %s | %s%s | %s | %s | %s '
                     '| %s | %s |' % (
                         run['n_ranks'], rate_name(run['rate_mbit']),
                         run['bytes'] / 1e6, fmt(FLAT32), fmt(FLAT16),
                         fmt(PSGD), fmt(AUTO),
                         ' (%s)' % chose if chose else '', fmt(TORCH_DDP),
                         fmt(TORCH_HOOK), faster, auto_ratio, vs_torch))
    return '\n'.join(lines)


def run_table(run):
    lines = ['### %d nodes, %s (%s, %d reps + %d warm-up, %.1f MB of '
             'float32 gradients)' % (
                 run['n_ranks'], rate_name(run['rate_mbit']),
                 os.path.basename(run.get('json', '')), run['reps'],
                 run['warmup'], run['bytes'] / 1e6), '',
             '| case | min s | median s | max s | x flat f32 | MB sent/rank, '
             'mnopt count | MB sent/rank, analytic | MB eth0 tx/rank | '
             'CPU idle % | replicas agree |',
             '|---|---|---|---|---|---|---|---|---|---|']
    for c in run['cases']:
        t = c['time_s']
        mine = c.get('mnopt_bytes_sent_per_rank')
        lines.append('| %s | %.3f | %.3f | %.3f | %s | %s | %.2f | %.2f | '
                     '%.0f | %s |' % (
                         c['case'], t['min'], t['median'], t['max'],
                         '%.2f' % c['x_flat_float32']
                         if c.get('x_flat_float32') else '',
                         '' if mine is None else '%.2f' % (mine / 1e6),
                         c['analytic_sent_bytes'] / 1e6,
                         c['eth0_tx_bytes_per_rank'] / 1e6,
                         100 * c['cpu_idle']['median'],
                         {True: 'yes', False: 'NO', None: ''}[
                             c.get('replicas_agree')]))
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
    runs.sort(key=lambda r: (r['n_ranks'], r['rate_mbit']))
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
