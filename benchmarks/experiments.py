#!/usr/bin/env python
"""Every experiment of docs/benchmarks.md on the simulated cluster.

    sudo python benchmarks/experiments.py              # = benchmarks/rerun.py
    sudo python benchmarks/experiments.py --rerun [rerun.py's arguments]
    sudo python benchmarks/experiments.py --only wire,topology,scaling,sweep

Without arguments (``make experiments``) it reruns every figure published
in docs/ and prints each beside its published value (benchmarks/rerun.py).
With ``--only`` (or ``--report-only``) it regenerates the tables below:

Each experiment brings up a cluster with ``mnopt.netsim`` (links of
--rate, 1 Gbit/s by default), runs ``python -m mnopt.benchmark`` across it,
and tears it down.  Results go to docs/results/netsim/ as JSON, PNG plots
and summary.md, each number beside its bound from DESIGN.md's cost model
(ring allreduce: T = 2(N-1)/N * S / B).  Takes about 15 minutes.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OUT = os.path.join(REPO, 'docs', 'results', 'netsim')
RESNET50_BYTES = 25557096 * 4


def rate_bytes_per_s(rate):
    units = {'gbit': 1e9, 'mbit': 1e6, 'kbit': 1e3}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale / 8
    raise ValueError(rate)


def ring_bound_s(n, nbytes, rate):
    return 2.0 * (n - 1) / n * nbytes / rate_bytes_per_s(rate) if n > 1 else 0


REPORT_ONLY = False  # --report-only: rebuild the tables from saved JSON


def bench(nodes, ranks_per_node, rate, args, name, servers=0,
          netsim_args=()):
    """Run the benchmark across a fresh cluster; returns its JSON."""
    path = os.path.join(OUT, name + '.json')
    if REPORT_ONLY:
        with open(path) as f:
            return json.load(f)
    cmd = [sys.executable, '-m', 'mnopt.netsim', 'run', '--nodes', str(nodes),
           '--ranks-per-node', str(ranks_per_node), '--rate', rate,
           '--servers', str(servers), '--server-args=--stats'] + list(
               netsim_args) + ['--',
           sys.executable, '-m', 'mnopt.benchmark', '--json', path] + args
    print('$ ' + ' '.join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, timeout=3600,
                   env=dict(os.environ, PYTHONPATH=REPO))
    with open(path) as f:
        return json.load(f)


def _plt():
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


def wire_dtypes(rate, lines):
    r = bench(4, 1, rate, ['--communicators', 'flat', '--dtypes', 'float32',
                           'float16', 'bfloat16', '--reps', '5'], 'wire')
    rows = {row['case']: row['median_s'] for row in r['rows']}
    fp32 = rows['mnopt flat float32']
    lines += ['## FP32 vs FP16 vs BF16 on the wire (4 nodes, %s)' % rate, '',
              '| case | median s | ring bound s | x bound | speed-up vs '
              'flat float32 |', '|---|---|---|---|---|']
    for case, t in rows.items():
        wire_bytes = RESNET50_BYTES // (2 if case.endswith('float16')
                                        else 1)
        bound = ring_bound_s(4, wire_bytes, rate)
        lines.append('| %s | %.3f | %.3f | %.2f | %.2f |' % (
            case, t, bound, t / bound, fp32 / t))
    lines.append('')


def topology(rate, lines):
    r = bench(4, 2, rate, ['--communicators', 'flat', 'hierarchical',
                           '--dtypes', 'float32', '--reps', '5'], 'topology')
    rows = {row['case']: row['median_s'] for row in r['rows']}
    # Only one copy per node need cross a node's link: the bound is a ring
    # over the 4 nodes.  (A topology-unaware ring over the 8 ranks would
    # carry two ranks' traffic per link: %.3f s.)
    bound = ring_bound_s(4, RESNET50_BYTES, rate)
    unaware = 2 * 2.0 * 7 / 8 * RESNET50_BYTES / rate_bytes_per_s(rate)
    lines += ['## hierarchical vs flat (4 nodes x 2 ranks, %s)' % rate, '',
              'Bound: a ring over the 4 nodes, %.3f s (a ring over all 8 '
              'ranks, unaware of nodes, would need %.3f s).' % (
                  bound, unaware), '',
              '| case | median s | x bound |', '|---|---|---|']
    for case, t in rows.items():
        lines.append('| %s | %.3f | %.2f |' % (case, t, t / bound))
    lines.append('')


def scaling(rate, lines, compute_ms=1000):
    results = {}
    for nodes in (1, 2, 4, 8):
        results[nodes] = bench(nodes, 1, rate, [
            '--scaling', '--compute-ms', str(compute_ms), '--steps', '4',
            '--reps', '3'], 'scaling_%d' % nodes)
    t0 = results[1]['steps']['plain_fp32']
    lines += ['## Scaling efficiency (1-8 nodes, %s, %d ms of SIMULATED '
              'compute per step)' % (rate, compute_ms), '',
              'e = t / (t0 n) = step(1 node) / step(n nodes); steady state.',
              '', '| nodes | plain float32 step s | e | double buffering + '
              'float16 step s | e | FP16 averaging bound s |',
              '|---|---|---|---|---|---|']
    for n, r in results.items():
        s = r['steps']
        lines.append('| %d | %.3f | %.3f | %.3f | %.3f | %.3f |' % (
            n, s['plain_fp32'], t0 / s['plain_fp32'], s['db_fp16'],
            t0 / s['db_fp16'], ring_bound_s(n, RESNET50_BYTES // 2, rate)))
    lines.append('')
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ns = sorted(results)
    ax.plot(ns, [results[n]['steps']['plain_fp32'] for n in ns], 'o-',
            label='plain, float32')
    ax.plot(ns, [results[n]['steps']['db_fp16'] for n in ns], 's-',
            label='double buffering, float16')
    ax.plot(ns, [compute_ms / 1e3] * len(ns), 'k--',
            label='simulated compute')
    ax.plot(ns, [compute_ms / 1e3 + ring_bound_s(n, RESNET50_BYTES, rate)
                 for n in ns], ':', label='compute + FP32 ring bound')
    ax.set_xlabel('nodes (1 rank each, %s links)' % rate)
    ax.set_ylabel('time per step (s)')
    ax.set_xticks(ns)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title('ResNet-50 gradients, step time against nodes')
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, 'scaling.png'), dpi=100)


def sweep(rate, lines):
    r = bench(4, 1, rate, ['--sizes', '--communicators', 'flat', '--dtypes',
                           'float32', 'float16', '--max-size', str(64 << 20),
                           '--reps', '5', '--plot',
                           os.path.join(OUT, 'sweep.png')], 'sweep')
    lines += ['## Bandwidth against message size (4 nodes, %s)' % rate, '',
              'Bus bandwidth (nccl-tests: algbw * 2(N-1)/N) of the largest '
              'size; the link carries %.3f GB/s.' % (
                  rate_bytes_per_s(rate) / 1e9), '',
              '| case | busbw GB/s at 64 MiB |', '|---|---|']
    for row in r['rows']:
        if row['bytes'] == 64 << 20:
            lines.append('| %s | %.3f |' % (row['case'], row['busbw_GBps']))
    lines.append('')


def reduction_server(rate, lines):
    r = bench(4, 1, rate, ['--dtypes', 'float32', 'float16', '--reps', '6'],
              'reduction_server', servers=4)
    rows = {row['case']: row['median_s'] for row in r['rows']}
    ring = min(t for c, t in rows.items() if c.startswith('limit'))
    link = rate_bytes_per_s(rate)
    lines += ['## Reduction server vs ring (4 worker nodes + 4 server nodes, '
              '%s)' % rate, '',
              'Ring: raw Allreduce among the same 4 workers, best chunking, '
              'same run (mnopt `flat` is this plus its packing).  Bound with '
              'servers: S/B each way (%.3f s in FP32); ring bound %.3f s.'
              % (RESNET50_BYTES / link, ring_bound_s(4, RESNET50_BYTES, rate)),
              '', '| case | median s | vs ring | of link rate |',
              '|---|---|---|---|']
    for case, t in rows.items():
        nbytes = RESNET50_BYTES // (2 if case.endswith('float16') else 1)
        share = ('%.0f%%' % (100 * nbytes / link / t)
                 if 'reduction_server' in case else '-')
        lines.append('| %s | %.3f | %.2fx | %s |' % (case, t, ring / t,
                                                     share))
    lines.append('')
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    cases = [('ring (Allreduce), float32', ring,
              ring_bound_s(4, RESNET50_BYTES, rate)),
             ('reduction server, float32',
              rows['mnopt reduction_server float32'], RESNET50_BYTES / link),
             ('reduction server, float16',
              rows['mnopt reduction_server float16'],
              RESNET50_BYTES / 2 / link)]
    ys = range(len(cases))
    ax.barh(ys, [c[1] for c in cases], color=['C0', 'C1', 'C2'])
    ax.scatter([c[2] for c in cases], ys, marker='|', s=400, color='k',
               label='bound')
    ax.set_yticks(list(ys))
    ax.set_yticklabels([c[0] for c in cases])
    ax.invert_yaxis()
    ax.set_xlabel('seconds per averaging of ResNet-50 gradients (median)')
    ax.set_title('4 workers (+ 4 servers), %s links' % rate)
    ax.legend(fontsize=8)
    ax.grid(axis='x', alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, 'reduction_server.png'), dpi=100)


# float32, float16 and sign with both votes, bytes on every interface.
SIGN_CASES = ['--communicators', 'flat', '--dtypes', 'float32', 'float16',
              'sign', '--votes', 'ring', 'alltoall', '--only-mnopt',
              '--link-bytes']


def sign_star(rate, lines, sizes=(4, 8)):
    """Sign compression against FP32 and FP16 on a switch (every node one
    link of ``rate``)."""
    lines += ['## Sign compression vs float32 and float16 (%s links to a '
              'switch, 1 rank per node)' % rate, '',
              'ResNet-50 gradients.  Sent: bytes rank 0 sent per averaging '
              '(its interface counter, headers included).', '',
              '| nodes | case | median s | vs float32 | sent MB |',
              '|---|---|---|---|---|']
    for n in sizes:
        r = bench(n, 1, rate, SIGN_CASES + ['--reps', '5'], 'sign_%d' % n)
        fp32 = r['rows'][0]['median_s']
        for row in r['rows']:
            lines.append('| %d | %s | %.3f | %.2fx | %.1f |' % (
                n, row['case'].replace('mnopt flat ', ''), row['median_s'],
                fp32 / row['median_s'],
                row['link_tx_bytes']['mnopt-n0:eth0'] / 1e6))
    lines.append('')


def sign_vote_bits_across(vote, n):
    """Bits per gradient element that cross the slow middle link of an
    n-node chain, each way, for one vote.  Ring: each direction carries
    one ring edge (the wrap-around goes back along the chain), i.e. one
    rank's whole send.  All-to-all: the (n/2)^2 pairs across each send
    1/n of the bits; then the all-gather (MPICH: a ring) like the ring's
    second half."""
    from mnopt.codecs.sign import count_bits
    gather = (n - 1) / n
    if vote == 'ring':
        return sum(count_bits(i) for i in range(1, n)) / n + gather
    return (n // 2) * (n - n // 2) / n + gather


def sign_chain(rate, lines, slow_rate='200mbit', sizes=(4, 8, 16)):
    """The all-reducible signSGD paper's Table 1: a chain of nodes whose
    middle link is 5x slower than the others."""
    results = {}
    for n in sizes:
        results[n] = bench(n, 1, rate, SIGN_CASES + ['--reps', '3'],
                           'sign_chain_%d' % n,
            netsim_args=['--topology', 'chain',
                         '--link', '%d=%s' % (n // 2 - 1, slow_rate)])
    slow = rate_bytes_per_s(slow_rate)
    elements = RESNET50_BYTES // 4
    lines += ['## Sign compression on a chain with one slow link (%s '
              'links, the middle one %s)' % (rate, slow_rate), '',
              'ResNet-50 gradients, 1 rank per node.  "Across": bytes '
              'measured on the slow link per averaging (Linux interface '
              'counters, TCP/IP headers included), the busier direction; '
              '"link time" is that over the slow rate.  Model: the bits '
              'per element benchmarks/experiments.py predicts for the '
              'votes.', '',
              '| nodes | case | median s | vs float32 | across MB | link '
              'time s | model MB |', '|---|---|---|---|---|---|---|']
    for n, r in results.items():
        fp32 = None
        for row in r['rows']:
            b = row['link_tx_bytes']
            across = max(b.get('mnopt-n%d:right' % (n // 2 - 1), 0),
                         b.get('mnopt-n%d:left' % (n // 2), 0))
            row['across_bytes'] = across
            vote = ('alltoall' if 'alltoall' in row['case'] else 'ring') \
                if 'sign' in row['case'] else None
            model = '%.1f' % (sign_vote_bits_across(vote, n) * elements
                              / 8e6) if vote else '-'
            fp32 = fp32 or (row['median_s'] if 'float32' in row['case']
                            else None)
            lines.append('| %d | %s | %.3f | %.2fx | %.1f | %.3f | %s |' % (
                n, row['case'].replace('mnopt flat ', ''), row['median_s'],
                fp32 / row['median_s'] if fp32 else float('nan'),
                across / 1e6, across / slow, model))
    lines.append('')
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    ns = sorted(results)
    cases = [row['case'] for row in results[ns[0]]['rows']]
    width = 0.8 / len(cases)
    for i, case in enumerate(cases):
        rows = [next(r for r in results[n]['rows'] if r['case'] == case)
                for n in ns]
        xs = [k + (i - (len(cases) - 1) / 2) * width for k in range(len(ns))]
        label = case.replace('mnopt flat ', '')
        left.bar(xs, [r['across_bytes'] / 1e6 for r in rows], width,
                 label=label)
        right.bar(xs, [r['median_s'] for r in rows], width, label=label)
    for ax, title in ((left, 'MB across the slow link per averaging'),
                      (right, 'seconds per averaging (median)')):
        ax.set_xticks(range(len(ns)))
        ax.set_xticklabels(['%d nodes' % n for n in ns])
        ax.set_yscale('log')
        ax.set_title(title, fontsize=10)
        ax.grid(axis='y', alpha=0.3)
    handles, labels = left.get_legend_handles_labels()
    fig.legend(handles, labels, loc='lower center', ncol=len(cases),
               fontsize=8)
    fig.suptitle('ResNet-50 gradients on a chain of %s links, middle link '
                 '%s' % (rate, slow_rate), fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(os.path.join(OUT, 'sign_chain.png'), dpi=100)


EXPERIMENTS = {'wire': wire_dtypes, 'topology': topology,
               'scaling': scaling, 'sweep': sweep,
               'reduction_server': reduction_server,
               'sign': sign_star, 'sign_chain': sign_chain}


def main():
    if len(sys.argv) == 1 or sys.argv[1] == '--rerun':
        # Without arguments (make experiments): rerun every published
        # figure and print it beside its published value (rerun.py).
        sys.path.insert(0, HERE)
        import rerun
        return rerun.main(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--only', default=','.join(EXPERIMENTS))
    p.add_argument('--rate', default='1gbit')
    p.add_argument('--report-only', action='store_true',
                   help='rebuild the tables and plots from saved JSON')
    args = p.parse_args()
    global REPORT_ONLY
    REPORT_ONLY = args.report_only
    os.makedirs(OUT, exist_ok=True)
    for name in args.only.split(','):
        lines = []
        EXPERIMENTS[name](args.rate, lines)
        with open(os.path.join(OUT, name + '.md'), 'w') as f:
            f.write('\n'.join(lines) + '\n')
        print('\n'.join(lines), flush=True)


if __name__ == '__main__':
    main()
