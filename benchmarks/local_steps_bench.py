"""Local steps (DiLoCo, Streaming DiLoCo) beside synchronous averaging,
PowerSGD and PyTorch's post-local SGD, on the simulated cluster: how long
is a step, how much of it is the model's own compute, and how many bytes
does each step and each sync put on the links?

Setup: .venv/gloo as benchmarks/powersgd_bench.py says (PyTorch's CPU
wheel, Chainer and mnopt under NumPy 2; without torch its case is skipped
with a line saying so).  The whole measurement, one command (root: netsim
makes a network namespace per node; about 15 minutes on a quiet machine;
ROUNDS=2 in the environment shortens it):

    sudo .venv/gloo/bin/python benchmarks/local_steps_bench.py --all \\
        --out docs/results/netsim

It runs four netsim jobs one after the other and writes
local_steps_4_100mbit.json, local_steps_4_1gbit.json,
local_steps_8_100mbit.json, local_steps_4_100mbit_h128.json and the
tables, local_steps.md:

- 4 nodes at 100 Mbit/s and at 1 Gbit/s: every case, H=32;
- 8 nodes at 100 Mbit/s: the compute alone, synchronous float32 and the
  two local-steps cases, H=32;
- 4 nodes at 100 Mbit/s, H=128 (about 10 minutes of the whole): the
  compute alone, synchronous float32 (for the ratio), the streamed cases
  and PyTorch's post-local SGD with period 128 (``--only-h 128`` runs
  this job alone; the tables still show every JSON in ``--out``).

A quick check that every case runs (2 nodes, a 4 MB model, H=8; about a
minute; keep its output out of docs/):

    sudo .venv/gloo/bin/python benchmarks/local_steps_bench.py --all \\
        --tiny --out /tmp/local_steps_tiny

One job by hand (what --all runs for each line):

    python -m mnopt.netsim run --nodes 4 --rate 100mbit -- \\
        .venv/gloo/bin/python -m mpi4py benchmarks/local_steps_bench.py \\
        --rate-mbit 100 --json out.json

The model: a Chainer Link with ResNet-50's 161 parameter shapes (102.2 MB
of float32; mnopt/benchmark/workloads.py) and the loss sum over
parameters of (parameter * C).sum(), C a fixed standard normal array per
parameter and rank (benchmarks/powersgd_bench.py's model): real dense
gradients of those shapes, different on every rank.  A step's *compute*
is that forward and backward, the inner optimizer's update (MomentumSGD)
and a fixed ``time.sleep(--compute-s)`` (default 0.25 s) standing in for
a network's forward and backward on an accelerator: a sleep holds no core
and no GIL, as an accelerator's kernels do not, so averaging on
mnopt's background thread can run beside it as it would beside a GPU.
What a step's compute costs here is measured, not assumed: the case
``compute only`` (the same Chainer step, sleep and update, no averaging),
and compute utilisation = that case's step time / a case's step time.

Cases (each its own optimizer state; one set of weights shared by all,
as the gradients do not depend on them):

- ``sync float32``, ``sync float16``: ``create_multi_node_optimizer``,
  the ``flat`` communicator with the float32 and float16 wire;
- ``powersgd r4``: ``compression='powersgd'``, rank 4;
- ``local H=32 F=1``: ``local_steps=32`` (DiLoCo's outer Nesterov);
- ``local H=32 F=4 delay 1``: ``fragments=4, fragment_sync_delay=1``
  (Streaming DiLoCo: a quarter of the model every 8 steps, its averaging
  on the background thread during the next step);
- ``local H=32 F=4 delay 8``: the same with the averaging given the whole
  8 steps until the next fragment's (the largest delay allowed);
- ``local H=32 F=4 delay 8 float16``: the same, the pseudo-gradients on
  the float16 wire (``allreduce_grad_dtype='float16'``);
- ``torch post-local SGD``: PyTorch DDP on gloo with
  ``post_localSGD_hook`` (``post_local_gradient_allreduce=False``: with
  one rank per node the intra-node group is the rank itself) and
  ``PeriodicModelAverager(period=32)`` after 2 synchronous DDP steps,
  ``torch.optim.SGD(momentum=0.9)``, the same shapes, loss and sleep;
  its compute utilisation is against ``torch compute only`` (the same
  Module and SGD without DDP), as torch's step costs other CPU time than
  Chainer's.

Timing: each case runs windows of whole steps (``H`` steps for the local
cases, torch's and the compute alone, so that a window holds one sync of
every fragment and a window's barrier and slowest rank weigh the same per
step in a case and its baseline; ``--sync-window`` steps for the
synchronous cases), the slowest rank's window time
over its steps is the step time.  Untimed first: each case's own warm-up
(mnopt's first update broadcasts; PowerSGD's plain averaging; DDP's
synchronous steps) and ``--warmup-rounds`` rounds.  Then ``--rounds``
rounds, each running every case's window, the order rotated from round to
round (min / median / max over the rounds).

Bytes per step and rank, two ways, summed over a window and divided by
its steps: mnopt's own count (``comm.communication_stats()
['bytes_sent']``, the caller's and the background thread's collectives)
and the links' (the growth of eth0's tx_bytes in /proc/net/dev: each
netsim node is a network namespace of its own with one rank; headers,
ACKs, barriers and agreements included).  Peak bytes per sync: the most
bytes of one sync (a step's for the synchronous cases and torch's; for a
delayed sync, whose bytes can spread over the steps it overlaps, a run of
consecutive steps with bytes), beside a float32 sync of the whole model
(``2(N-1)/N`` x the model's bytes per rank, by a ring): about 1/F is the
aim.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

LR = 1e-4          # small: the parameters drift, nothing diverges
MOMENTUM = 0.9
TORCH_DDP_WARMUP = 2    # synchronous DDP steps before post-local SGD
ALL_CASES = ('compute only', 'sync float32', 'sync float16',
             'powersgd r4', 'local H=32 F=1', 'local H=32 F=4 delay 1',
             'local H=32 F=4 delay 8', 'local H=32 F=4 delay 8 float16',
             'torch compute only', 'torch post-local SGD')
FEW_CASES = ('compute only', 'sync float32', 'local H=32 F=1',
             'local H=32 F=4 delay 1')
#: H=128 (DiLoCo's range: 128x fewer bytes than synchronous float32),
#: the streamed cases only (H=32's F=1 row shows what one fragment costs).
LONG_CASES = ('compute only', 'sync float32', 'local H=32 F=4 delay 8',
              'local H=32 F=4 delay 8 float16', 'torch compute only',
              'torch post-local SGD')
# --all: (nodes, rate, Mbit/s, cases, H, warm-up rounds); --tiny runs only
# the first line's cases at 2 nodes and 1 Gbit/s.  H=128's windows are
# 128 steps long: no warm-up round (each case still warms up first).
JOBS = ((4, '100mbit', 100, ALL_CASES, 32, 1),
        (4, '1gbit', 1000, ALL_CASES, 32, 1),
        (8, '100mbit', 100, FEW_CASES, 32, 1),
        (4, '100mbit', 100, LONG_CASES, 128, 0))


def label(case, h):
    """A case's label with the run's H (32 in the real run)."""
    return case.replace('H=32', 'H=%d' % h).replace(
        'delay 8', 'delay %d' % (h // 4))


# -- the cases -----------------------------------------------------------------

class Case(object):
    """One training setup; ``step()`` is one update; ``window`` steps are
    timed together; ``sent()`` the bytes mnopt counted since last asked
    (None: not mnopt)."""

    window = 1
    background = continuous = False
    fragments = 1

    def sent(self):
        return None

    def finish(self):
        pass


class MnoptCase(Case):
    def __init__(self, name, weights, consts, compute_s, window,
                 comm_args=None, opt_args=None):
        import chainer
        import mnopt
        from powersgd_bench import chainer_model
        self.label, self.window, self.compute_s = name, window, compute_s
        self.comm = None
        self.model = chainer_model(weights, consts)
        inner = chainer.optimizers.MomentumSGD(lr=LR, momentum=MOMENTUM)
        if comm_args is None:     # the compute alone
            self.optimizer = inner
        else:
            self.comm = mnopt.create_communicator('flat', **comm_args)
            self.optimizer = mnopt.create_multi_node_optimizer(
                inner, self.comm, **(opt_args or {}))
        self.optimizer.setup(self.model)
        delay = (opt_args or {}).get('fragment_sync_delay', 0)
        self.background = bool(delay)
        self.fragments = (opt_args or {}).get('fragments', 1)
        # A delay of H/F: a fragment always in flight, so consecutive
        # syncs' bytes cannot be told apart step by step.
        self.continuous = delay and delay >= window // self.fragments
        # mnopt's first update broadcasts; PowerSGD's warmup_steps=1.
        # With a delay, ``delay`` more: local step s syncs fragment f
        # where s = f*H/F (mod H), s counted from 1 after the broadcast,
        # so H-step windows then end right after an outer update landed
        # (nothing in flight at the end where delay < H/F).
        self.warmup = 0 if comm_args is None else \
            1 + (comm_args or {}).get('warmup_steps', 0) + delay

    def finish(self):
        """Wait for a fragment's averaging in flight (none where nothing
        runs in the background), so that none runs on into another
        case's window."""
        if self.background:
            self.optimizer.wait()

    def step(self):
        time.sleep(self.compute_s)
        self.optimizer.update(self.model)
        self.model.cleargrads()

    def sent(self):
        if self.comm is None:
            return 0
        return self.comm.communication_stats()['bytes_sent']


class TorchPostLocalSGD(Case):
    """DDP on gloo, synchronous for TORCH_DDP_WARMUP steps, then local SGD
    with the parameters averaged every ``period`` steps."""

    def __init__(self, name, weights, consts, compute_s, period,
                 alone=False):
        import torch
        from torch.distributed.algorithms.ddp_comm_hooks import \
            post_localSGD_hook as plsgd
        from torch.distributed.algorithms.model_averaging import averagers
        from torch.nn.parallel import DistributedDataParallel as DDP
        from powersgd_bench import torch_model
        self.label, self.window, self.compute_s = name, period, compute_s
        self.warmup, self.averager = 0, None
        self.model = torch_model(weights, consts)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR,
                                         momentum=MOMENTUM)
        if alone:     # torch's own compute: no DDP, no averaging
            return
        # init_sync=False: the weights start alike (zeros) everywhere.
        self.model = DDP(self.model, init_sync=False)
        self.model.register_comm_hook(plsgd.PostLocalSGDState(
            process_group=None, subgroup=None,
            start_localSGD_iter=TORCH_DDP_WARMUP,
            post_local_gradient_allreduce=False), plsgd.post_localSGD_hook)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR,
                                         momentum=MOMENTUM)
        self.averager = averagers.PeriodicModelAverager(
            period=period, warmup_steps=TORCH_DDP_WARMUP)
        self.warmup = TORCH_DDP_WARMUP

    def step(self):
        time.sleep(self.compute_s)
        self.model().backward()
        self.optimizer.step()
        # Before zero_grad: the averager skips parameters without grad.
        if self.averager is not None:
            self.averager.average_parameters(self.model.parameters())
        self.optimizer.zero_grad()


def make_cases(names, shapes, consts, weights, args, world):
    h, sync_w = args.local_steps, args.sync_window
    made, note, torch_up = [], None, None
    for name in names:
        lab = label(name, h)
        if name.startswith('torch'):
            os.environ.setdefault('TORCH_CPP_LOG_LEVEL', 'ERROR')
            try:
                import torch  # NOQA
            except ImportError as e:
                note = 'torch cases skipped: no torch (%s)' % e
                continue
            if torch_up is None:
                from gloo_bench import gloo_here
                torch_up = gloo_here(world)
            made.append(TorchPostLocalSGD(
                lab, weights, consts, args.compute_s,
                h, alone=name == 'torch compute only'))
            continue
        comm_args, opt_args, window = {}, None, sync_w
        if name == 'compute only':
            # Windows as long as the local cases': a window's barrier and
            # its slowest rank weigh the same per step in both.
            comm_args, window = None, h
        elif name == 'sync float16':
            comm_args = {'allreduce_grad_dtype': 'float16'}
        elif name == 'powersgd r4':
            comm_args = {'compression': 'powersgd', 'powersgd_rank': 4,
                         'warmup_steps': 1}
        elif name.startswith('local'):
            window = h
            opt_args = {'local_steps': h}
            if 'F=4' in name:
                opt_args['fragments'] = 4
                opt_args['fragment_sync_delay'] = 1 if 'delay 1' in name \
                    else h // 4
            if name.endswith('float16'):   # the pseudo-gradients' wire
                comm_args = {'allreduce_grad_dtype': 'float16'}
        made.append(MnoptCase(lab, weights, consts, args.compute_s, window,
                              comm_args, opt_args))
    return made, note


# -- timing --------------------------------------------------------------------

def eth0_tx():
    from powersgd_bench import net_counters
    return int(net_counters('eth0')[0])


def run_window(case, world):
    """Time one window of ``case``: this rank's seconds, and per step the
    bytes mnopt counted and eth0's tx growth."""
    case.sent()              # what earlier steps left uncounted
    world.Barrier()
    mine, link = [], []
    start = time.perf_counter()
    for _ in range(case.window):
        tx = eth0_tx()
        case.step()
        link.append(eth0_tx() - tx)
        mine.append(case.sent())
    # A sync still in flight at the window's end (delay = H/F: always
    # one) is waited for inside the window's time, its bytes counted in
    # its last step: charged whole here, where in a run without other
    # cases between windows it would overlap the next steps.
    tx, before_wait = eth0_tx(), time.perf_counter()
    case.finish()
    end = time.perf_counter()
    link[-1] += eth0_tx() - tx
    if mine[-1] is not None:
        mine[-1] += case.sent()
    return end - start, mine, link, end - before_wait


def peak_sync(per_step, case):
    """The most bytes of one sync: the largest step, or for syncs in the
    background the largest run of consecutive steps with more than 1% of
    the largest step's bytes, or where a fragment is always in flight
    (delay H/F) the window's bytes over F (the mean of its F syncs)."""
    per_step = [b or 0 for b in per_step]
    if case.continuous:
        return sum(per_step) / float(case.fragments)
    background = case.background
    top = max(per_step) if per_step else 0
    if not background or not top:
        return top
    best = run = 0
    for b in per_step:
        run = run + b if b > 0.01 * top else 0
        best = max(best, run)
    return best


def spread(values):
    v = sorted(values)
    return {'min': v[0], 'median': float(numpy.median(v)), 'max': v[-1]}


def measure(args):
    from mpi4py import MPI
    from mnopt.benchmark.workloads import grad_list, resnet50_grad_shapes
    from powersgd_bench import cut_shapes, ring_factor
    world = MPI.COMM_WORLD
    n = world.size
    shapes = cut_shapes(resnet50_grad_shapes(), args.max_mb)
    model_bytes = 4 * sum(int(numpy.prod(s)) for s in shapes)
    consts = [c for _, c in grad_list(shapes, world.rank)]
    weights = [numpy.zeros(s, numpy.float32) for s in shapes]
    names = args.cases.split(',') if args.cases else ALL_CASES
    unknown = [c for c in names if c not in ALL_CASES]
    if unknown:
        raise SystemExit('unknown cases %r; known: %s'
                         % (unknown, ', '.join(ALL_CASES)))
    started = time.perf_counter()
    cases, note = make_cases(names, shapes, consts, weights, args, world)
    for case in cases:                      # each case's own warm-up
        for _ in range(case.warmup):
            world.Barrier()
            case.step()
    raw = {c.label: [] for c in cases}
    for r in range(args.warmup_rounds + args.rounds):
        k = r % len(cases)
        for case in cases[k:] + cases[:k]:  # the order rotates
            got = run_window(case, world)
            if r >= args.warmup_rounds:
                raw[case.label].append(got)
        if world.rank == 0:
            sys.stderr.write('round %d/%d done, %.0f s\n' % (
                r + 1, args.warmup_rounds + args.rounds,
                time.perf_counter() - started))
    everyone = world.gather(raw)
    if world.rank != 0:
        return None
    full_sync = model_bytes * ring_factor(n)
    rows = []
    for case in cases:
        per_rank = [e[case.label] for e in everyone]
        w = case.window
        # The slowest rank's window, per round, over its steps.
        step_s = [max(pr[i][0] for pr in per_rank) / w
                  for i in range(args.rounds)]
        row = {'case': case.label, 'window_steps': w, 'step_s': spread(
            step_s), 'step_s_rounds': step_s,
            # The wait for a sync in flight at the window's end (in the
            # step time), the slowest rank's, per round.
            'end_wait_s_rounds': [max(pr[i][3] for pr in per_rank)
                                  for i in range(args.rounds)]}
        for key, idx in (('mnopt', 1), ('eth0_tx', 2)):
            if key == 'mnopt' and per_rank[0][0][1][0] is None:
                continue
            per_step = [numpy.mean([sum(pr[i][idx]) for pr in per_rank]) / w
                        for i in range(args.rounds)]
            peak = max(peak_sync(pr[i][idx], case)
                       for pr in per_rank for i in range(args.rounds))
            row[key + '_bytes_per_step'] = spread(per_step)
            row[key + '_peak_sync_bytes'] = float(peak)
            row[key + '_peak_over_full_sync'] = peak / full_sync
        rows.append(row)
    by = {r['case']: r for r in rows}
    base = by.get('sync float32')
    for row in rows:
        # Each framework's step against its own compute alone.
        compute = by.get('torch compute only' if row['case'].startswith(
            'torch') else 'compute only')
        if compute:
            row['compute_utilisation'] = (compute['step_s']['median']
                                          / row['step_s']['median'])
        if row['case'].endswith('compute only'):
            continue
        for key in ('mnopt', 'eth0_tx'):
            mine = row.get(key + '_bytes_per_step')
            if base and mine and mine['median'] and \
                    base.get(key + '_bytes_per_step'):
                row[key + '_x_fewer_than_sync_float32'] = (
                    base[key + '_bytes_per_step']['median'] / mine['median'])
    result = {'bench': 'local_steps', 'n_ranks': n,
              'rate_mbit': args.rate_mbit, 'compute_s': args.compute_s,
              'local_steps': args.local_steps, 'rounds': args.rounds,
              'warmup_rounds': args.warmup_rounds,
              'sync_window': args.sync_window, 'model_bytes': model_bytes,
              'full_sync_bytes_per_rank': full_sync,
              'n_params': len(shapes), 'max_mb': args.max_mb,
              'date': datetime.date.today().isoformat(),
              'host': MPI.Get_processor_name(), 'argv': sys.argv,
              'cpu_count': os.cpu_count(), 'note': note,
              'elapsed_s': time.perf_counter() - started, 'cases': rows}
    try:
        import torch
        result['torch'] = torch.__version__
    except ImportError:
        pass
    return result


# -- the report ----------------------------------------------------------------

def _mb(row, key):
    v = row.get(key)
    if v is None:
        return ''
    return '%.3f' % ((v['median'] if isinstance(v, dict) else v) / 1e6)


def _x(v, fmt='%.1f'):
    return '' if v is None else fmt % v


def continuous_utilisation(result, row):
    """Compute utilisation with the wait for the sync in flight at each
    window's end left out of the case's step (median over the rounds): a
    run that does not stop between windows overlaps that sync with its
    next steps, as it does every other one."""
    by = {c['case']: c for c in result['cases']}
    base = by.get('torch compute only' if row['case'].startswith('torch')
                  else 'compute only')
    w = row['window_steps']
    steps = [s - e / w for s, e in zip(row['step_s_rounds'],
                                      row['end_wait_s_rounds'])]
    return base['step_s']['median'] / float(numpy.median(steps))


def table(result):
    lines = ['### %d nodes, %g Mbit/s' % (result['n_ranks'],
                                         result['rate_mbit']), '',
             'Model %.1f MB float32, compute %.2f s sleep a step, H=%d; '
             'median (min-max) over %d rounds.  %s' % (
                 result['model_bytes'] / 1e6, result['compute_s'],
                 result['local_steps'], result['rounds'],
                 result['note'] or ''), '',
             '| case | step s | compute utilisation | the same, the '
             'window-end wait left out | MB/step (mnopt) | '
             'MB/step (eth0) | x fewer than sync float32 (mnopt / eth0) | '
             'peak MB per sync (mnopt / eth0) | peak / float32 sync of '
             'the model (mnopt) |', '|---|---|---|---|---|---|---|---|---|']
    for c in result['cases']:
        t = c['step_s']
        lines.append('| %s | %.3f (%.3f-%.3f) | %s | %s | %s | %s | %s / %s '
                     '| %s / %s | %s |' % (
                         c['case'], t['median'], t['min'], t['max'],
                         _x(100 * c['compute_utilisation'], '%.1f%%')
                         if 'compute_utilisation' in c else '',
                         _x(100 * continuous_utilisation(result, c),
                            '%.1f%%') if 'compute_utilisation' in c
                         else '',
                         _mb(c, 'mnopt_bytes_per_step'),
                         _mb(c, 'eth0_tx_bytes_per_step'),
                         _x(c.get('mnopt_x_fewer_than_sync_float32')),
                         _x(c.get('eth0_tx_x_fewer_than_sync_float32')),
                         _mb(c, 'mnopt_peak_sync_bytes'),
                         _mb(c, 'eth0_tx_peak_sync_bytes'),
                         _x(c.get('mnopt_peak_over_full_sync'), '%.3f')))
    return '\n'.join(lines)


def run_all(args):
    """Every job of JOBS under netsim, one after the other, then the
    tables (root)."""
    os.makedirs(args.out, exist_ok=True)
    py = sys.executable
    results = []
    jobs = JOBS[:1] if args.tiny else [
        j for j in JOBS if args.only_h is None or j[4] == args.only_h]
    for nodes, rate, mbit, cases, h, warmup in [] if args.tables else jobs:
        if args.tiny:
            nodes, rate, mbit = 2, '1gbit', 1000
        name = os.path.join(args.out, 'local_steps_%d_%s%s.json' % (
            nodes, rate, '' if h == 32 else '_h%d' % h))
        cmd = [py, '-m', 'mnopt.netsim', 'run', '--nodes', str(nodes),
               '--rate', rate, '--ranks-per-node', '1', '--timeout',
               str(args.job_timeout), '--', py, '-m', 'mpi4py',
               os.path.abspath(__file__), '--rate-mbit', str(mbit),
               '--cases', ','.join(cases), '--json', name,
               '--rounds', str(args.rounds), '--compute-s',
               str(args.compute_s)] + (['--tiny'] if args.tiny else [
                   '--local-steps', str(h), '--warmup-rounds', str(warmup)])
        print('$ ' + ' '.join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=os.path.dirname(HERE))
    # Every job's JSON there (also those of an earlier --only-h run).
    for nodes, rate, mbit, cases, h, warmup in jobs if args.tiny else JOBS:
        name = os.path.join(args.out, 'local_steps_%d_%s%s.json' % (
            2 if args.tiny else nodes, '1gbit' if args.tiny else rate,
            '' if h == 32 or args.tiny else '_h%d' % h))
        if os.path.exists(name):
            with open(name) as f:
                results.append(json.load(f))
    md = os.path.join(args.out, 'local_steps.md')
    with open(md, 'w') as f:
        f.write('# Local steps beside synchronous averaging, PowerSGD and '
                "PyTorch's post-local SGD on the simulated cluster\n\n"
                'Command (root): `%s`; each job alone: `--all --only-h H`; '
                'the tables again from the JSON: `--tables`.\n\n'
                'The window-end wait: each case is timed in windows with '
                'other cases between them, so the sync still in flight at '
                'a window\'s end (with a delay of H/F, always one) is waited '
                'for inside the window; a run that goes on overlaps it with '
                'its next steps as it does the others.  Bytes are exact; '
                'times are median (min-max) over the rounds.\n\n' % ' '.join(
                    ['python', 'benchmarks/local_steps_bench.py', '--all',
                     '--out', args.out] + (['--tiny'] if args.tiny else [])))
        f.write('\n\n'.join(table(r) for r in results) + '\n')
    print('wrote %s' % md)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--all', action='store_true',
                   help='run every job under netsim (root) and write '
                   'the JSON and local_steps.md to --out')
    p.add_argument('--out', default='docs/results/netsim')
    p.add_argument('--tables', action='store_true',
                   help='write local_steps.md again from the JSON in --out '
                   '(runs nothing)')
    p.add_argument('--job-timeout', type=int, default=900)
    p.add_argument('--tiny', action='store_true',
                   help='a check that every case runs: the first 4 MB of '
                   'the parameters, H=8, 0.01 s of compute, 2 rounds')
    p.add_argument('--rate-mbit', type=float,
                   help='the link rate (for the JSON and the table)')
    p.add_argument('--cases', help='comma-separated case names '
                   '(default: all): ' + ', '.join(ALL_CASES))
    p.add_argument('--compute-s', type=float, default=0.25,
                   help='the sleep standing in for the compute of a step')
    p.add_argument('--local-steps', type=int, default=32, help='H')
    p.add_argument('--only-h', type=int, default=None,
                   help='with --all: only the jobs of this H (the tables '
                   'still show every job whose JSON is in --out)')
    p.add_argument('--sync-window', type=int, default=1,
                   help='steps timed together for the synchronous cases')
    p.add_argument('--rounds', type=int,
                   default=int(os.environ.get('ROUNDS', 3)))
    p.add_argument('--warmup-rounds', type=int, default=1)
    p.add_argument('--max-mb', type=float,
                   help='only the first parameters, up to this many MB')
    p.add_argument('--json')
    args = p.parse_args()
    if args.tiny:
        args.max_mb = args.max_mb or 4
        args.local_steps, args.compute_s = 8, 0.01
        args.sync_window, args.rounds = 2, 2
    if args.all or args.tables:
        return run_all(args)
    if args.rate_mbit is None:
        p.error('--rate-mbit is needed (or --all)')
    import mnopt  # NOQA: before Chainer, NumPy 2 names for it
    result = measure(args)
    if result is None:
        return
    print(table(result))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(result, f, indent=1)


if __name__ == '__main__':
    main()
