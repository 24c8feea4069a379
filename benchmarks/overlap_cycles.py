"""benchmarks/overlap.py in alternating cycles: mnopt's overlap and double
buffering beside PyTorch DDP on gloo, in the same processes ('together',
``--ddp``) and in separate jobs, one framework each ('mnopt', 'ddp':
``--only``), as a user runs them.  Root, for the simulated nodes:

    sudo python benchmarks/overlap_cycles.py --nodes 2 --rate 1gbit \\
        --cycles 5 --out docs/results/overlap_cycles
    python benchmarks/overlap_cycles.py --shm 2 --variants mnopt ...
    python benchmarks/overlap_cycles.py --report DIR   # tables only

Each cycle runs every variant once, in an order that rotates from cycle
to cycle; each run's JSON is kept (DIR/CASE/cycleK_VARIANT.json, with
every rank's rounds).  Per cycle, per framework: the median over the
run's rounds of the hidden share (overlap.py's definition) and the step
saving, 1 - overlapped step / synchronous step (median step times); then
their min / median / max over the cycles.  The table also gives each
cycle's spread over its rounds (min-max), the averaging threads' CPU per
step and per MB averaged, the CPU idle share beside the overlapped
steps, and the share of the CPU that other processes used during the
run ('others', the largest of the cycles': every CPU jiffy not idle,
interrupts included, less our processes' own CPU time, so network work
the kernel does in its own threads counts as others'; each run first
waits up to ``--quiet-wait`` seconds for a machine 90% idle, rerun.py's
rule).
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time

from rerun import children_cpu_s, cpu_jiffies, wait_for_quiet

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VARIANTS = {'together': ['--ddp'], 'mnopt': ['--only', 'mnopt'],
            'ddp': ['--only', 'ddp']}
#: framework -> (its synchronous mode, its overlapped modes)
FRAMEWORKS = {'mnopt': ('sync', ('overlap', 'double buffering')),
              'ddp': ('ddp sync', ('ddp',))}


def command(args, variant, json_path):
    bench = [sys.executable, os.path.join(HERE, 'overlap.py'),
             '--rounds', str(args.rounds), '--steps', str(args.steps),
             '--batch', str(args.batch), '--json', json_path] \
        + VARIANTS[variant]
    if args.shm:
        mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
        return [mpiexec, '-n', str(args.shm)] + bench
    return [sys.executable, '-m', 'mnopt.netsim', 'run', '--nodes',
            str(args.nodes), '--ranks-per-node', '1', '--rate', args.rate,
            '--servers', '0', '--'] + bench


def case_name(args):
    return 'shm%d' % args.shm if args.shm else '%dn_%s' % (args.nodes,
                                                          args.rate)


def run(args):
    out = os.path.join(args.out, case_name(args))
    os.makedirs(out, exist_ok=True)
    for k in range(args.cycles):
        shift = k % len(args.variants)
        for variant in args.variants[shift:] + args.variants[:shift]:
            path = os.path.join(out, 'cycle%d_%s.json' % (k, variant))
            if args.quiet_wait:
                wait_for_quiet(0.9, args.quiet_wait)
            started = time.time()
            i0, _, t0 = cpu_jiffies()
            c0 = children_cpu_s()
            done = subprocess.run(command(args, variant, path), cwd=ROOT,
                                  stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True,
                                  timeout=args.timeout)
            i1, _, t1 = cpu_jiffies()
            ours = (children_cpu_s() - c0) * os.sysconf('SC_CLK_TCK')
            # Every jiffy not idle (interrupts too: the kernel's network
            # work in our processes is counted in ours), less ours.
            busy = (t1 - t0) - (i1 - i0)
            others = max(0.0, busy - ours) / max(1, t1 - t0)
            print('cycle %d %-8s rc=%d %.0f s, others %.0f%% of the CPU' % (
                k, variant, done.returncode, time.time() - started,
                100 * others), flush=True)
            if done.returncode != 0 or not os.path.exists(path):
                sys.stderr.write(done.stderr[-3000:])
                continue
            with open(path) as f:
                result = json.load(f)
            result['others_cpu'] = others
            with open(path, 'w') as f:
                json.dump(result, f, indent=1)
    return out


def per_cycle(result, framework):
    """{mode: (hidden median, hidden min, hidden max, saving)} of one
    run for ``framework``'s overlapped modes."""
    sync, modes = FRAMEWORKS[framework]
    steps = result['step_s']
    found = {}
    for mode in modes:
        key = 'ddp' if framework == 'ddp' else mode
        if mode not in steps or key not in result['hidden']:
            continue
        h = result['hidden'][key]
        saving = 1 - steps[mode]['median'] / steps[sync]['median']
        found[mode] = (h['median'], h['min'], h['max'], saving)
    return found


def cpu_of(result, mode):
    """(ms per step, ms per MB) of the averaging threads in ``mode``."""
    costs = result.get('averaging_thread_s', {}).get(mode) or \
        result.get('ddp_thread_s', {}).get(mode)
    if not costs:
        return None
    return costs['cpu']['median'] * 1e3, costs['cpu_per_mb']['median'] * 1e3


def report(out):
    rows = {}
    for path in sorted(glob.glob(os.path.join(out, 'cycle*_*.json'))):
        name = os.path.basename(path)[len('cycle'):-len('.json')]
        cycle, variant = name.split('_', 1)
        result = json.load(open(path))
        for framework in FRAMEWORKS:
            for mode, values in per_cycle(result, framework).items():
                rows.setdefault((variant, mode), []).append(
                    (int(cycle), values, cpu_of(result, mode),
                     result['cpu_idle'].get(mode, {}).get('median'),
                     result.get('others_cpu')))
    lines = ['%s: %s' % (out, 'per cycle: hidden median (round min to '
                         'max), step saving; then over the cycles'),
             '| run | mode | hidden, per cycle | step saving, per cycle | '
             'hidden min / median / max | saving min / median / max | '
             'CPU ms/step | ms/MB | CPU idle | others (max) |',
             '|---' * 10 + '|']
    for (variant, mode), got in sorted(rows.items()):
        got.sort()
        hid = [v[0] for _, v, _, _, _ in got]
        sav = [v[3] for _, v, _, _, _ in got]
        cpus = [c for _, _, c, _, _ in got if c]
        idle = [i for _, _, _, i, _ in got if i is not None]
        others = [o for _, _, _, _, o in got if o is not None]
        lines.append('| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |'
                     % (variant, mode, ', '.join(
                         '%.2f (%.2f-%.2f)' % v[:3] for _, v, _, _, _ in got),
            ', '.join('%.3f' % s for s in sav), three(hid), three(sav),
            '%.1f' % statistics.median(c[0] for c in cpus) if cpus else '',
            '%.2f' % statistics.median(c[1] for c in cpus) if cpus else '',
            '%.2f' % statistics.median(idle) if idle else '',
            '%.2f' % max(others) if others else ''))
    text = '\n'.join(lines)
    with open(os.path.join(out, 'summary.md'), 'w') as f:
        f.write(text + '\n')
    return text


def three(values):
    return '%.2f / %.2f / %.2f' % (min(values), statistics.median(values),
                                   max(values))


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--nodes', type=int, default=2)
    p.add_argument('--rate', default='1gbit')
    p.add_argument('--shm', type=int, metavar='N',
                   help='N ranks on this machine (shared memory), no '
                   'simulated nodes')
    p.add_argument('--cycles', type=int, default=5)
    p.add_argument('--variants', nargs='+', default=list(VARIANTS),
                   choices=list(VARIANTS))
    p.add_argument('--rounds', type=int, default=3)
    p.add_argument('--steps', type=int, default=3)
    p.add_argument('--batch', type=int, default=1024)
    p.add_argument('--timeout', type=float, default=900)
    p.add_argument('--quiet-wait', type=float, default=120,
                   help='seconds to wait for a quiet machine before each '
                   'run (0: do not wait)')
    p.add_argument('--out', default='docs/results/overlap_cycles')
    p.add_argument('--report', metavar='DIR',
                   help="only the tables of DIR's saved runs")
    args = p.parse_args()
    out = args.report or run(args)
    print(report(out))


if __name__ == '__main__':
    main()
