"""docs/results/netsim/ring.md from the ring_*.json that
benchmarks/ring_bench.py wrote (one file per node count and rate), and
the mnopt vs gloo table from benchmarks/gloo_bench.py's JSON (those that
say "bench": "gloo"), alone or beside the ring's.

    python benchmarks/ring_report.py docs/results/netsim/ring_*.json \\
        > docs/results/netsim/ring.md
    python benchmarks/ring_report.py docs/results/netsim/gloo_{4,8,16}.json \\
        --plot docs/results/netsim/gloo.png > docs/results/netsim/gloo.md
"""

import json
import sys


def gloo_report(runs):
    """gloo_bench.py's runs: every case with its own bound (float16: half
    the float32 one) and its time over gloo's DDP buckets'."""
    print('# mnopt vs PyTorch\'s gloo (simulated cluster)\n')
    print('One rank per node, every link shaped to the rate in each '
          'direction (`python -m mnopt.netsim`); ResNet-50\'s gradients '
          '(all 162: 102.2 MB of float32) averaged in place, each case in '
          'the same processes, round-robin within each repetition.  Times: '
          'the slowest rank, min / median / max over the repetitions.  '
          'Bound: 2(N-1)/N * wire bytes / rate (float16: half the float32 '
          'bound).  x gloo DDP: the median over gloo\'s with DDP\'s '
          'buckets (1 MiB first, then 25 MiB, all in flight).  CPU idle: the '
          'share of the machine\'s cores idle while the case ran (median).  '
          'Error: the largest difference from the float64 mean over the '
          'largest mean.\n')
    print('| nodes | rate Mbit/s | MB | case | min s | median s | max s | '
          'bound s | x bound | x gloo DDP | CPU idle % | max rel. error | '
          'file |')
    print('|---|---|---|---|---|---|---|---|---|---|---|---|---|')
    for run in runs:
        for c in run['cases']:
            t = c['time_s']
            print('| %d | %g | %.1f | %s | %.3f | %.3f | %.3f | %.3f | %.2f '
                  '| %s | %.0f | %s | %s |' % (
                      run['n_ranks'], run['rate_mbit'], run['bytes'] / 1e6,
                      c['case'], t['min'], t['median'], t['max'],
                      c['bound_s'], c['x_bound'],
                      '%.2f' % c['x_gloo_ddp'] if c.get('x_gloo_ddp')
                      else '', 100 * c['cpu_idle']['median'],
                      '%.1e' % c['max_rel_err']
                      if c.get('max_rel_err') is not None else '',
                      run['path'].split('/')[-1]))
    versions = sorted({'torch %s, numpy %s' % (r.get('torch', '-'),
                                               r.get('numpy', '-'))
                       for r in runs})
    print('\n%s.' % '; '.join(versions))
    notes = sorted({r['gloo_note'] for r in runs if r.get('gloo_note')})
    for note in notes:
        print('\n%s.' % note)
    print('\nCommands: each JSON records its argv; the runs were\n')
    print('```sh')
    for run in runs:
        print('.venv/gloo/bin/python -m mnopt.netsim run --nodes %d --rate '
              '%gmbit -- .venv/gloo/bin/python -m mpi4py %s'
              % (run['n_ranks'], run['rate_mbit'], ' '.join(
                  a if not a.endswith('gloo_bench.py')
                  else 'benchmarks/gloo_bench.py' for a in run['argv'])))
    print('```')


def gloo_plot(runs, path):
    """Every case's time over its own bound against nodes, one panel per
    rate (median, min-max bars), with the goal's 1.10x: on one scale the
    cases' few percent apart show, where seconds would hide them."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    rates = sorted({r['rate_mbit'] for r in runs})
    fig, axes = plt.subplots(1, len(rates), figsize=(7 * len(rates), 4.5),
                             squeeze=False)
    for ax, rate in zip(axes[0], rates):
        at_rate = sorted((r for r in runs if r['rate_mbit'] == rate),
                         key=lambda r: r['n_ranks'])
        nodes = [r['n_ranks'] for r in at_rate]
        names = []
        for r in at_rate:
            names += [c['case'] for c in r['cases'] if c['case'] not in names]
        for name in names:
            xs, med, lo, hi = [], [], [], []
            for r in at_rate:
                for c in r['cases']:
                    if c['case'] == name:
                        t, b = c['time_s'], c['bound_s']
                        xs.append(r['n_ranks'])
                        med.append(t['median'] / b)
                        lo.append((t['median'] - t['min']) / b)
                        hi.append((t['max'] - t['median']) / b)
            ax.errorbar(xs, med, yerr=[lo, hi], marker='o', capsize=3,
                        label=name)
        ax.axhline(1.0, color='k', ls='--', lw=1,
                   label='bound 2(N-1)/N S/B (float16: half)')
        ax.axhline(1.1, color='k', ls=':', lw=1, label='goal: 1.10x')
        ax.set_xscale('log', base=2)
        ax.set_xticks(nodes)
        ax.set_xticklabels([str(n) for n in nodes])
        ax.set_xlabel('nodes (one rank each)')
        ax.set_ylabel('time / its bound (ResNet-50, 102 MB)')
        ax.set_title('%g Mbit/s links, simulated cluster' % rate)
        ax.set_ylim(0.95, 1.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(paths):
    plot = None
    if '--plot' in paths:
        i = paths.index('--plot')
        plot = paths[i + 1]
        paths = paths[:i] + paths[i + 2:]
    runs = []
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        run['path'] = path
        runs.append(run)
    runs.sort(key=lambda r: (r['rate_mbit'], r['n_ranks'], r['path']))
    gloo = [r for r in runs if r.get('bench') == 'gloo']
    runs = [r for r in runs if r.get('bench') != 'gloo']
    if gloo:
        gloo_report(gloo)
        if plot:
            gloo_plot(gloo, plot)
        if not runs:
            return
        print()
    # Runs on one machine without netsim (mpiexec alone, shared memory)
    # pass a huge rate: their bound is 0 and means nothing.
    shm = [r for r in runs if r['rate_mbit'] >= 1e6]
    runs = [r for r in runs if r['rate_mbit'] < 1e6]
    print('# mnopt\'s pipelined ring vs MPI Allreduce (simulated cluster)\n')
    print('One rank per node, every link shaped to the rate in each '
          'direction (`python -m mnopt.netsim`); ResNet-50\'s 162 '
          'gradients, 102.2 MB of float32.  Times: the slowest rank, '
          'min / median / max over the repetitions, cases round-robin in '
          'one run.  CPU idle: the share of the machine\'s 2 cores idle '
          'while the case ran (median).  Bound: 2(N-1)/N * bytes / rate.\n')
    print('| nodes | rate Mbit/s | case | min s | median s | max s | '
          'x bound | CPU idle % | file |')
    print('|---|---|---|---|---|---|---|---|---|')
    for run in runs:
        if not run['cases']:
            continue
        for c in run['cases']:
            t = c['time_s']
            print('| %d | %g | %s | %.3f | %.3f | %.3f | %.2f | %.0f | %s |'
                  % (run['n_ranks'], run['rate_mbit'], c['case'], t['min'],
                     t['median'], t['max'], c['x_bound'],
                     100 * c['cpu_idle']['median'],
                     run['path'].split('/')[-1]))
        print('| %d | %g | ring bound | | %.3f | | 1.00 | | |'
              % (run['n_ranks'], run['rate_mbit'],
                 run['cases'][0]['bound_s']))
    sized = [r for r in runs if r['sizes']]
    if sized:
        print('\n## One buffer by size: ring vs MPI Allreduce\n')
        print('| nodes | rate Mbit/s | bytes | ring median ms (min-max) | '
              'MPI median ms (min-max) | MPI / ring | bound ms | CPU idle % '
              'ring / MPI |')
        print('|---|---|---|---|---|---|---|---|')
        for run in sized:
            for r in run['sizes']:
                ring, mpi = r['ring'], r['mpi']
                print('| %d | %g | %d | %.1f (%.1f-%.1f) | %.1f (%.1f-%.1f) '
                      '| %.2f | %.1f | %.0f / %.0f |' % (
                          run['n_ranks'], run['rate_mbit'], r['bytes'],
                          1e3 * ring['time_s']['median'],
                          1e3 * ring['time_s']['min'],
                          1e3 * ring['time_s']['max'],
                          1e3 * mpi['time_s']['median'],
                          1e3 * mpi['time_s']['min'],
                          1e3 * mpi['time_s']['max'],
                          r['mpi_over_ring'], 1e3 * r['bound_s'],
                          100 * ring['cpu_idle']['median'],
                          100 * mpi['cpu_idle']['median']))
    if shm:
        print('\n## One shared-memory node (mpiexec alone, no netsim)\n')
        print('| ranks | case | min ms | median ms | max ms | file |')
        print('|---|---|---|---|---|---|')
        for run in shm:
            for c in run['cases']:
                t = c['time_s']
                print('| %d | %s | %.1f | %.1f | %.1f | %s |' % (
                    run['n_ranks'], c['case'], 1e3 * t['min'],
                    1e3 * t['median'], 1e3 * t['max'],
                    run['path'].split('/')[-1]))
            for r in run['sizes']:
                for k in ('ring', 'mpi'):
                    t = r[k]['time_s']
                    print('| %d | one %d-byte buffer, %s | %.2f | %.2f | '
                          '%.2f | %s |' % (
                              run['n_ranks'], r['bytes'],
                              'ring' if k == 'ring' else 'MPI Allreduce',
                              1e3 * t['min'], 1e3 * t['median'],
                              1e3 * t['max'], run['path'].split('/')[-1]))
    print('\nCommands: each JSON records its argv; the runs were\n')
    print('```sh')
    for run in shm:
        print('.venv/numpy2/bin/mpiexec -n %d .venv/numpy2/bin/python -m '
              'mpi4py %s' % (run['n_ranks'], ' '.join(
                  a if not a.endswith('ring_bench.py')
                  else 'benchmarks/ring_bench.py' for a in run['argv'])))
    for run in runs:
        print('python -m mnopt.netsim run --nodes %d --rate %gmbit -- '
              '.venv/numpy2/bin/python -m mpi4py %s'
              % (run['n_ranks'], run['rate_mbit'], ' '.join(
                  a if not a.endswith('ring_bench.py')
                  else 'benchmarks/ring_bench.py' for a in run['argv'])))
    print('```')


if __name__ == '__main__':
    main(sys.argv[1:])
