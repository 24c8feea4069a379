#!/usr/bin/env python
"""Rerun the figures published in docs/ and print each beside its published
value, so that drift is visible.

    sudo python benchmarks/rerun.py [--only NAME,...] [--runs 3] [--quick]
    python benchmarks/rerun.py --report-only      # the table from saved runs
    python benchmarks/rerun.py --list             # the figures and commands

Each figure is a command (shared memory under mpiexec, or a simulated
cluster under ``python -m mnopt.netsim``, which needs root), run ``--runs``
times; the runs go round the figures (run 1 of every figure, then run 2,
...), so a slow spell of the machine falls on all of them alike.  Inside a
run the benchmark alternates its own cases.  Printed per figure and value:

    figure | value | published | new min / median / max | CPU idle % | outside % | verdict

- CPU idle: the machine's idle share (/proc/stat, every core) while the
  figure's main case ran, median over the runs (benchmarks/idle_bench.py
  and benchmarks/overlap.py record it beside every timing).  Near 0 the
  cores, not the links, set the pace.
- outside: CPU time the machine spent on processes that are not this
  script's children, as a share of the run's CPU time (busy jiffies of
  /proc/stat minus the children's rusage; network soft interrupts count
  here too).  Above a few percent something else competed for the cores:
  rerun that figure.
- verdict: ``holds`` where the published value lies within the new runs'
  min-max (5% slack), otherwise the new median over the published value.

The runs' JSON and a summary go to docs/results/rerun/ (``--out``), with
the machine (cores, kernel) and the date.
"""

import argparse
import datetime
import glob
import json
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PY = sys.executable
MPIEXEC = os.path.join(os.path.dirname(PY), 'mpiexec')
RESNET50_BYTES = 25557096 * 4
GBIT = 1e9 / 8   # bytes/s
MAX_OUTSIDE = 0.10   # a run with more CPU used by others is contended
CODE = REPO      # --code: the mnopt tree the commands run (an old one)


def netsim(nodes, rate, servers=0, ranks_per_node=1):
    return [PY, '-m', 'mnopt.netsim', 'run', '--nodes', str(nodes),
            '--ranks-per-node', str(ranks_per_node), '--rate', rate,
            '--servers', str(servers), '--']


def shm(n=2):
    return [MPIEXEC, '-n', str(n)]


IDLE_BENCH = [PY, '-m', 'mpi4py', os.path.join(HERE, 'idle_bench.py')]
OVERLAP = [PY, os.path.join(HERE, 'overlap.py')]


def rows(r):
    return {row['case']: row for row in r['rows']}


def med(r, case):
    return rows(r)[case]['median_s']


def idle_of(r, case):
    return rows(r)[case].get('cpu_idle', {}).get('median')


# ---- the figures ---------------------------------------------------------
# Each: where it is published, the command (given the JSON path), and
# values: (name, published or None, f(result) -> value), and the case
# whose CPU idle is shown.

def _rs(rate, reps):
    ring = 'limit: Allreduce, 1 MiB chunks'
    rs32 = 'mnopt reduction_server float32'
    rs16 = 'mnopt reduction_server float16'
    link = float(rate[:-4]) * (1e9 if rate.endswith('gbit') else 1e6) / 8
    return dict(
        cmd=lambda out: netsim(4, rate, servers=4) + IDLE_BENCH + [
            '--keep', 'limit: Allreduce, 1 MiB|reduction_server',
            '--dtypes', 'float32', 'float16', '--reps', str(reps),
            '--json', out],
        idle=lambda r: idle_of(r, rs32),
        values=lambda r: {
            'reduction_server float32 s': med(r, rs32),
            'ring (Allreduce) s': med(r, ring),
            'ring / reduction_server float32': med(r, ring) / med(r, rs32),
            'float32 share of link rate': RESNET50_BYTES / link
            / med(r, rs32),
            'ring / reduction_server float16': med(r, ring) / med(r, rs16)})


FIGURES = {}


def figure(name, doc, published, **kw):
    FIGURES[name] = dict(doc=doc, published=published, **kw)


figure('rs_1gbit', 'benchmarks.md, choosing.md, limits.md: reduction '
       'server, 4 workers + 4 servers, 1 Gbit/s',
       {'reduction_server float32 s': 0.909, 'ring (Allreduce) s': 1.295,
        'ring / reduction_server float32': 1.42,
        'float32 share of link rate': 0.90,
        'ring / reduction_server float16': 2.41},
       **_rs('1gbit', 6))
figure('rs_1gbit_slice0', 'the same with the kernel\'s default scheduler '
       'slice (MNOPT_THREAD_SLICE_US=0), as when the 0.909 s was measured',
       {'reduction_server float32 s': 0.909,
        'ring / reduction_server float32': 1.42},
       env={'MNOPT_THREAD_SLICE_US': '0'}, **_rs('1gbit', 6))
figure('rs_250mbit', 'the same at 250 Mbit/s, where the links set the pace '
       '(theory: 1.5x the ring)', {'ring / reduction_server float32': 1.5},
       **_rs('250mbit', 3))
figure('rs_10gbit', 'the same at 10 Gbit/s: the cores\' own floor '
       '(link bound 0.082 s)', {}, **_rs('10gbit', 4))

_LIMITS = ['limit: Allreduce, %d MiB chunks' % m for m in (1, 4, 16, 64)]


def _x_limit(r, case):
    return med(r, case) / min(med(r, c) for c in _LIMITS)


def _shm(bucket_bytes=None):
    return dict(
        cmd=lambda out: shm(2) + IDLE_BENCH + [
            '--keep', 'MiB chunks|chainermn|flat float32', '--communicators',
            'flat', '--dtypes', 'float32', '--compare-checks', '--reps', '15',
            '--json', out] + (['--bucket-bytes', str(bucket_bytes)]
                              if bucket_bytes else []),
        idle=lambda r: idle_of(r, 'mnopt flat float32'),
        values=lambda r: {
            'flat float32 x limit': _x_limit(r, 'mnopt flat float32'),
            'flat float32, checks off x limit': _x_limit(
                r, 'mnopt flat float32, checks off'),
            'ChainerMN naive / flat float32': med(r, 'chainermn naive')
            / med(r, 'mnopt flat float32'),
            'ChainerMN naive x limit': _x_limit(r, 'chainermn naive')})


SHM_PUBLISHED = {'flat float32 x limit': 1.41,
                 'ChainerMN naive / flat float32': 1.27,
                 'ChainerMN naive x limit': 1.78}
figure('shm_n2', 'benchmarks.md: shared memory, N=2, ResNet-50 gradients '
       '(default 1 MiB buckets)', SHM_PUBLISHED, **_shm())
figure('shm_n2_4mib', 'the same with 4 MiB buckets, the default when the '
       'published table was made (a20aa3c; 1 MiB since aaa8b0f)',
       SHM_PUBLISHED, **_shm(4 << 20))

figure('double_buffering', 'benchmarks.md, double_buffering.md, '
       'overlap.md: double buffering, N=2 shared memory, compute a sleep',
       {'hidden share': 0.91, 'step / max(compute, averaging)': 1.07},
       cmd=lambda out: shm(2) + IDLE_BENCH + [
           '--double-buffering', '--reps', '12', '--json', out],
       idle=lambda r: r.get('cpu_idle', {}).get(
           'double_buffering', {}).get('median'),
       values=lambda r: {'hidden share': r['hidden_fraction'],
                         'step / max(compute, averaging)': r['db_over_max'],
                         'averaging alone s': r['median_s']['comm']})


def _overlap(rate, batch):
    return dict(
        cmd=lambda out: netsim(2, rate) + OVERLAP + [
            '--rounds', '5', '--steps', '3', '--batch', str(batch),
            '--json', out],
        idle=lambda r: r.get('cpu_idle', {}).get('overlap', {}).get('median'),
        values=lambda r: {
            'overlap hidden (median of rounds)': r['hidden']['overlap'][
                'median'],
            'double buffering hidden': r['hidden']['double buffering'][
                'median'],
            'backward s': r['parts_s']['backward']['median'],
            'averaging s': r['parts_s']['average']['median']})


figure('overlap_1gbit', 'overlap.md: 2 nodes, 1 Gbit/s, batch 1024',
       {'overlap hidden (median of rounds)': 0.74,
        'double buffering hidden': 0.80, 'backward s': 0.18,
        'averaging s': 0.21}, **_overlap('1gbit', 1024))
figure('overlap_1gbit_mpi', 'the same with MPI\'s Allreduce '
       '(MNOPT_ALLREDUCE=mpi), as when the published figure was made '
       '(d25fc13; mnopt\'s ring across nodes since 85df96f)',
       {'overlap hidden (median of rounds)': 0.74,
        'double buffering hidden': 0.80, 'backward s': 0.18,
        'averaging s': 0.21}, env={'MNOPT_ALLREDUCE': 'mpi'},
       **_overlap('1gbit', 1024))
figure('overlap_500mbit', 'overlap.md: 2 nodes, 500 Mbit/s, batch 2048',
       {'overlap hidden (median of rounds)': 0.76,
        'double buffering hidden': 0.78, 'backward s': 0.34,
        'averaging s': 0.425}, **_overlap('500mbit', 2048))


def _thread(r, mode, key):
    """The averaging thread's per-step ``key`` (overlap.py) in ``mode``."""
    return r['averaging_thread_s'][mode][key]['median']


def _overlap_ddp(rate, batch):
    return dict(
        cmd=lambda out: netsim(2, rate) + OVERLAP + [
            '--rounds', '5', '--steps', '3', '--batch', str(batch),
            '--ddp', '--json', out],
        idle=lambda r: r.get('cpu_idle', {}).get('overlap', {}).get('median'),
        values=lambda r: {
            'overlap hidden (median of rounds)': r['hidden']['overlap'][
                'median'],
            'PyTorch DDP hidden': r['hidden']['ddp']['median'],
            'overlap step / DDP step': r['step_s']['overlap']['median']
            / r['step_s']['ddp']['median'],
            'averaging thread CPU s/step': _thread(r, 'overlap', 'cpu'),
            '... outside its waits s/step': _thread(r, 'overlap',
                                                    'outside_waits_cpu'),
            '... waiting for the GIL s/step': _thread(r, 'overlap',
                                                      'gil_wait')})


# The "before" (mnopt before the C waits, and DDP) on the same
# MLP: 2 nodes x 1 Gbit/s, three cycles, medians of runs.
figure('overlap_1gbit_ddp', 'overlap.md, benchmarks.md: overlap beside '
       'PyTorch DDP (gloo, the same bucket size and MLP), 2 nodes, '
       '1 Gbit/s, batch 1024; needs torch (.venv/gloo)',
       {'overlap hidden (median of rounds)': 0.29,
        'PyTorch DDP hidden': 0.68},
       needs='torch', **_overlap_ddp('1gbit', 1024))
figure('overlap_1gbit_ddp_pywait', 'the same with the Python fallback '
       'waits (MNOPT_WAIT=python)',
       {'overlap hidden (median of rounds)': 0.29,
        'PyTorch DDP hidden': 0.68},
       env={'MNOPT_WAIT': 'python'}, needs='torch',
       **_overlap_ddp('1gbit', 1024))
figure('overlap_500mbit_ddp', 'the same at 500 Mbit/s, batch 2048',
       {}, needs='torch', **_overlap_ddp('500mbit', 2048))


def _rs_model(servers, reps=5):
    flat, rs = 'mnopt flat float32', 'mnopt reduction_server float32'
    return dict(
        cmd=lambda out: netsim(4, '1gbit', servers=servers) + IDLE_BENCH + [
            '--communicators', 'flat', 'reduction_server', '--dtypes',
            'float32', '--only-mnopt', '--through-model', '--reps',
            str(reps), '--json', out],
        idle=lambda r: idle_of(r, rs),
        values=lambda r: {
            'reduction_server float32 s': med(r, rs),
            'flat float32 s': med(r, flat),
            'flat / reduction_server': med(r, flat) / med(r, rs)})


figure('rs_model_1gbit', 'benchmarks.md, choosing.md: reduction server '
       'through a Chainer model (multi_node_mean_grad), 4 workers + 4 '
       'servers, 1 Gbit/s, flat over the workers in the same job',
       {'reduction_server float32 s': 1.115, 'flat float32 s': 1.316,
        'flat / reduction_server': 1.18}, **_rs_model(4))
figure('rs_colocated_1gbit', 'benchmarks.md, choosing.md: colocated '
       'reduction server through a Chainer model, 4 nodes, 1 Gbit/s',
       {'reduction_server float32 s': 3.735,
        'flat / reduction_server': 0.36}, **_rs_model(0))
figure('rs_colocated_1gbit_pywait', 'the same with the Python fallback '
       'waits (MNOPT_WAIT=python)', {'flat / reduction_server': 0.36},
       env={'MNOPT_WAIT': 'python'}, **_rs_model(0))


def _flat(nodes, rate, reps=3):
    case = 'mnopt flat float32'
    return dict(
        cmd=lambda out: netsim(nodes, rate) + IDLE_BENCH + [
            '--communicators', 'flat', '--dtypes', 'float32',
            '--only-mnopt', '--reps', str(reps), '--json', out],
        idle=lambda r: idle_of(r, case),
        values=lambda r: {'flat float32 s': med(r, case)})


figure('flat_8_1gbit', 'benchmarks.md (ring table): flat float32, 8 nodes, '
       '1 Gbit/s (ring bound 1.431 s)', {'flat float32 s': 1.571},
       **_flat(8, '1gbit'))
figure('flat_8_10gbit', 'flat float32, 8 nodes, 10 Gbit/s: the cores\' '
       'floor (ring bound 0.143 s)', {}, **_flat(8, '10gbit'))
figure('flat_8_250mbit', 'benchmarks.md (ring table): flat float32, 8 '
       'nodes, 250 Mbit/s (ring bound 5.725 s)', {'flat float32 s': 6.265},
       **_flat(8, '250mbit', reps=2))

figure('scaling_8', 'benchmarks.md, choosing.md: step time, 8 nodes, '
       '1 Gbit/s, 1 s of simulated compute',
       {'plain float32 step s': 2.937,
        'double buffering + float16 step s': 1.017},
       cmd=lambda out: netsim(8, '1gbit') + IDLE_BENCH + [
           '--scaling', '--compute-ms', '1000', '--steps', '4', '--reps',
           '3', '--json', out],
       idle=lambda r: r.get('cpu_idle', {}).get('db_fp16', {}).get('median'),
       values=lambda r: {
           'plain float32 step s': r['steps']['plain_fp32'],
           'double buffering + float16 step s': r['steps']['db_fp16']})

figure('wire_4', 'benchmarks.md, choosing.md: wire dtypes, 4 nodes, '
       '1 Gbit/s',
       {'flat float32 s': 1.296, 'flat float16 s': 0.687,
        'float32 / float16': 1.89, 'float32 / bfloat16': 1.87,
        'ChainerMN naive / flat float32': 1.24},
       cmd=lambda out: netsim(4, '1gbit') + IDLE_BENCH + [
           '--keep', 'chainermn|flat', '--communicators', 'flat',
           '--dtypes', 'float32', 'float16', 'bfloat16', '--reps', '5',
           '--json', out],
       idle=lambda r: idle_of(r, 'mnopt flat float32'),
       values=lambda r: {
           'flat float32 s': med(r, 'mnopt flat float32'),
           'flat float16 s': med(r, 'mnopt flat float16'),
           'float32 / float16': med(r, 'mnopt flat float32')
           / med(r, 'mnopt flat float16'),
           'float32 / bfloat16': med(r, 'mnopt flat float32')
           / med(r, 'mnopt flat bfloat16'),
           'ChainerMN naive / flat float32': med(r, 'chainermn naive')
           / med(r, 'mnopt flat float32')})


# ---- running -------------------------------------------------------------

def cpu_jiffies():
    """(idle, busy outside interrupts, total) jiffies of all cores."""
    with open('/proc/stat') as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return v[3] + v[4], v[0] + v[1] + v[2], sum(v)


def children_cpu_s():
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def idle_now(seconds=1.0):
    i0, _, t0 = cpu_jiffies()
    time.sleep(seconds)
    i1, _, t1 = cpu_jiffies()
    return (i1 - i0) / max(1, t1 - t0)


def wait_for_quiet(min_idle, max_wait):
    """Wait (up to ``max_wait`` s) until the machine is ``min_idle`` idle
    over 2 s: others' test suites steal the cores these figures need."""
    deadline = time.time() + max_wait
    while True:
        idle = idle_now(2.0)
        if idle >= min_idle or time.time() > deadline:
            return idle
        print('  waiting for a quiet machine (CPU idle %.0f%%)' % (
            100 * idle), flush=True)
        time.sleep(10)


def others_netsim():
    """Pids of ``mnopt.netsim`` runs not started by this script: a second
    cluster would tear the first one down (netsim.up starts with down)."""
    pids = []
    for pid in os.listdir('/proc'):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open('/proc/%s/cmdline' % pid, 'rb') as f:
                argv = f.read().split(b'\0')
            with open('/proc/%s/stat' % pid) as f:
                ppid = int(f.read().rsplit(')', 1)[1].split()[1])
        except OSError:
            continue
        if b'mnopt.netsim' in argv and ppid != os.getpid():
            pids.append(int(pid))
    return pids


def wait_for_netsim(max_wait=900):
    deadline = time.time() + max_wait
    while others_netsim() and time.time() < deadline:
        print('  waiting: another mnopt.netsim run is going (pids %s)'
              % others_netsim(), flush=True)
        time.sleep(15)


def _run(cmd, timeout, env):
    """Run ``cmd``; on any exception (SIGTERM, ^C, timeout) ask it to end
    (netsim tears its cluster down on SIGTERM) before going."""
    proc = subprocess.Popen(cmd, cwd=CODE, env=dict(os.environ,
                                                    PYTHONPATH=CODE, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except BaseException:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise


def run_one(name, k, out_dir, timeout, quiet=(0.0, 0), max_outside=1.0,
            tries=1):
    """One run of a figure; redone (up to ``tries`` in all) while others
    used more than ``max_outside`` of the CPU during it."""
    fig = FIGURES[name]
    path = os.path.join(out_dir, '%s_%d.json' % (name, k))
    cmd = fig['cmd'](path)
    if fig.get('needs') and subprocess.call(
            [PY, '-c', 'import %s' % fig['needs']],
            stderr=subprocess.DEVNULL) != 0:
        raise RuntimeError('%s needs %s in %s (for torch: run rerun.py with '
                           'the .venv/gloo environment of '
                           'benchmarks/gloo_bench.py)'
                           % (name, fig['needs'], PY))
    print('$ ' + ''.join('%s=%s ' % kv for kv in fig.get('env', {}).items())
          + ' '.join(os.path.relpath(a, REPO) if a.startswith(REPO)
                     else a for a in cmd), flush=True)
    for attempt in range(1, tries + 1):
        if 'mnopt.netsim' in cmd:
            wait_for_netsim()
        before = wait_for_quiet(*quiet) if quiet[1] else idle_now()
        hz = os.sysconf('SC_CLK_TCK')
        i0, b0, t0 = cpu_jiffies()
        c0 = children_cpu_s()
        start = time.time()
        rc, out = _run(cmd, timeout, fig.get('env', {}))
        wall = time.time() - start
        i1, b1, t1 = cpu_jiffies()
        ours = (children_cpu_s() - c0) * hz
        if rc != 0:
            print(out[-3000:])
            raise RuntimeError('%s run %d failed (%d)' % (name, k, rc))
        with open(path) as f:
            result = json.load(f)
        meta = {'idle_before': before, 'wall_s': wall, 'code': CODE,
                'idle_run': (i1 - i0) / max(1, t1 - t0),
                'outside': max(0.0, (b1 - b0) - ours) / max(1, t1 - t0),
                'attempt': attempt,
                'date': datetime.datetime.now(
                    datetime.timezone.utc).isoformat(timespec='seconds')}
        result['rerun'] = meta
        with open(path, 'w') as f:
            json.dump(result, f, indent=1)
        print('  %s run %d: %.0f s, CPU idle %.0f%% (before: %.0f%%), '
              'outside %.0f%%' % (name, k, wall, 100 * meta['idle_run'],
                                  100 * before, 100 * meta['outside']),
              flush=True)
        if meta['outside'] <= max_outside:
            break
        print('  others used %.0f%% of the CPU: %s' % (
            100 * meta['outside'],
            'again' if attempt < tries else 'kept, marked'), flush=True)
    return result


def spread(values):
    return (min(values), statistics.median(values), max(values))


def fmt(v):
    if v is None:
        return '-'
    return '%.3f' % v if abs(v) < 10 else '%.1f' % v


def verdict(published, new):
    if published is None:
        return 'new'
    lo, m, hi = new
    if lo / 1.05 <= published <= hi * 1.05:
        return 'holds'
    return 'differs: %.2fx' % (m / published)


def report(names, out_dir):
    """The table: published beside new, per figure and value."""
    lines = []
    machine = None
    for name in names:
        fig = FIGURES[name]
        results = []
        for path in sorted(glob.glob(os.path.join(out_dir, name + '_*.json'))):
            if re.fullmatch(re.escape(name) + r'_\d+\.json',
                            os.path.basename(path)):
                with open(path) as f:
                    results.append(json.load(f))
        if not results:
            continue
        # Runs in which others used more than MAX_OUTSIDE of the CPU are
        # left out where cleaner ones exist (and said so).
        clean = [r for r in results
                 if r.get('rerun', {}).get('outside', 0) <= MAX_OUTSIDE]
        note = '%d runs' % len(results)
        if clean and len(clean) < len(results):
            note = '%d of %d runs; left out: runs in which other processes ' \
                'used over %.0f%% of the CPU' % (len(clean), len(results),
                                                 100 * MAX_OUTSIDE)
            results = clean
        elif not clean:
            note = '%d runs, ALL CONTENDED: others used over %.0f%% of ' \
                'the CPU' % (len(results), 100 * MAX_OUTSIDE)
        values = [fig['values'](r) for r in results]
        idles = [fig['idle'](r) for r in results]
        idles = [x for x in idles if x is not None]
        outside = [r.get('rerun', {}).get('outside', 0) for r in results]
        dates = sorted(r.get('rerun', {}).get('date', '?')[:10]
                       for r in results)
        lines.append('### %s: %s (%s; %s)' % (
            name, fig['doc'], note, dates[-1]))
        lines.append('')
        lines.append('| value | published | new min / median / max | CPU '
                     'idle % | outside % | verdict |')
        lines.append('|---|---|---|---|---|---|')
        for key in values[0]:
            new = spread([v[key] for v in values])
            pub = fig['published'].get(key)
            lines.append('| %s | %s | %s | %s | %s | %s |' % (
                key, fmt(pub), ' / '.join(fmt(x) for x in new),
                '%.0f' % (100 * statistics.median(idles)) if idles else '-',
                '%.0f-%.0f' % (100 * min(outside), 100 * max(outside)),
                verdict(pub, new)))
        lines.append('')
        lines.append('`' + ''.join('%s=%s ' % kv for kv in fig.get(
            'env', {}).items()) + ' '.join(
            os.path.relpath(a, REPO) if a.startswith(REPO) else a
            for a in fig['cmd']('OUT.json')).replace(PY, 'python') + '`')
        lines.append('')
        machine = machine or results[-1].get('rerun')
    head = ['# Published figures, rerun', '',
            'Machine: %d cores, Linux %s, Python %s; written %s by '
            '`benchmarks/rerun.py`.' % (
                os.cpu_count(), platform.release(),
                platform.python_version(),
                datetime.date.today().isoformat()),
            'CPU idle: the machine\'s idle share while the figure\'s main '
            'case ran (median of runs); outside: CPU used by other '
            'processes during the run.', '']
    return '\n'.join(head + lines)


def _sigterm(signum, frame):
    raise SystemExit(128 + signum)


def main(argv=None):
    signal.signal(signal.SIGTERM, _sigterm)
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--only', default=','.join(FIGURES),
                   help='comma-separated figure names (--list)')
    p.add_argument('--runs', type=int, default=3)
    p.add_argument('--first-run', type=int, default=1,
                   help='number the runs from here (add runs to saved ones)')
    p.add_argument('--out', default=os.path.join(REPO, 'docs', 'results',
                                                 'rerun'))
    p.add_argument('--timeout', type=float, default=600)
    p.add_argument('--code', default=REPO,
                   help='run this tree\'s mnopt (e.g. an old commit, '
                        '"git archive C | tar -x -C DIR") with this '
                        'script\'s harness, to find when a figure moved')
    p.add_argument('--quiet-idle', type=float, default=0.85,
                   help='before each run wait until the CPU is this idle')
    p.add_argument('--quiet-wait', type=float, default=300,
                   help='... for at most this many seconds (0: no wait)')
    p.add_argument('--max-outside', type=float, default=0.10,
                   help='redo a run in which others used more of the CPU')
    p.add_argument('--tries', type=int, default=3)
    p.add_argument('--keep-done', action='store_true',
                   help='skip the runs whose JSON is already there')
    p.add_argument('--report-only', action='store_true')
    p.add_argument('--list', action='store_true')
    args = p.parse_args(argv)
    global CODE
    CODE = os.path.abspath(args.code)
    names = args.only.split(',')
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        p.error('unknown figure(s) %s; known: %s' % (
            ', '.join(unknown), ', '.join(FIGURES)))
    if args.list:
        for name in names:
            print('%-18s %s\n    %s' % (name, FIGURES[name]['doc'], ' '.join(
                FIGURES[name]['cmd']('OUT.json'))))
        return
    os.makedirs(args.out, exist_ok=True)
    if not args.report_only:
        print('# %d cores, Linux %s, %s' % (
            os.cpu_count(), platform.release(),
            datetime.datetime.now().isoformat(timespec='seconds')))
        for k in range(args.first_run, args.first_run + args.runs):
            for name in names:
                if args.keep_done and os.path.exists(os.path.join(
                        args.out, '%s_%d.json' % (name, k))):
                    continue
                run_one(name, k, args.out, args.timeout,
                        (args.quiet_idle, args.quiet_wait),
                        args.max_outside, args.tries)
    print(report(names, args.out))
    # The summary holds every figure with saved runs, not only these.
    with open(os.path.join(args.out, 'summary.md'), 'w') as f:
        f.write(report(list(FIGURES), args.out) + '\n')


if __name__ == '__main__':
    main()
