"""Synchronous vs overlapped vs double-buffered training steps, side by side
in one run, on a Chainer MLP whose backward takes about as long as its
averaging.  Run it across simulated nodes (root):

    python -m mnopt.netsim run --nodes 2 --ranks-per-node 1 --rate 1gbit -- \\
        python benchmarks/overlap.py --json docs/results/overlap.json

Per round, each mode runs ``--steps`` steps (order rotating); the same
round also times forward, backward and one averaging of the gradients on
their own.  hidden = (t_sync - t_mode) / min(t_backward, t_average): the
share of the averaging a mode hides (issue 15's definition).  Beside
each mode's steps, rank 0 records the machine's CPU idle share over the
same interval (/proc/stat, every core: simulated nodes share them), which
says whether the cores or the links set the pace.

Per step, the CPU of the threads that average: mnopt's averaging thread,
split into the phases of mnopt/transport/cpu_phases.py (check, pack,
wire, divide, sum, unpack, wait, bookkeeping; MNOPT_PROFILE_THREADS=1
unless set otherwise), and with ``--ddp`` the threads torch.distributed
started (gloo's, by thread name: benchmarks/ddp_peer.py); each also per
MB of gradients averaged.  Rank 0's, in the JSON and in a table after it.
"""

import argparse
import json
import os
import sys
import time

import numpy

import mnopt  # before Chainer: NumPy 2 names for it
try:
    from mnopt.common import _sched
except ImportError:  # a tree from before the folders (rerun.py --code)
    from mnopt import _sched
try:
    from mnopt.benchmark.harness import spread
except ImportError:  # a tree from before the library (rerun.py --code)
    from mnopt.benchmark import spread
try:
    from mnopt.transport import wait_tallies, waiting
except ImportError:  # a tree from before the C waits (rerun.py --code)
    wait_tallies = waiting = None
try:
    from mnopt.transport.cpu_phases import PHASES
except ImportError:  # a tree from before the phases (rerun.py --code)
    PHASES = ()
import chainer  # NOQA
import chainer.functions as F  # NOQA
import chainer.links as L  # NOQA

MODES = ('sync', 'overlap', 'double buffering')


def averaging_threads():
    """{native id: (CPU seconds so far, its waiting.Tally)} of mnopt's
    averaging threads in this process (CPU from /proc's schedstat, in
    nanoseconds; a tree without mnopt/transport/waiting.py: {})."""
    if wait_tallies is None:
        return {}
    found = {}
    for tid, tally in wait_tallies.everyone().items():
        # The communicator's background executor ('mnopt-NAME_...'), not
        # a colocated reduction server's threads.
        if not tally.name.startswith('mnopt-') or \
                tally.name.startswith('mnopt-colocated'):
            continue
        try:
            with open('/proc/self/task/%d/schedstat' % tid) as f:
                found[tid] = (int(f.read().split()[0]) * 1e-9, tally)
        except OSError:
            continue
    return found


def thread_costs(before, after, steps, nbytes):
    """Per step, the averaging threads' CPU seconds, seconds inside
    mnopt's waits (the GIL released), the CPU of those waits, the time
    spent getting the GIL back after them (C waits only), and the CPU
    outside them: time the thread ran Python, numpy and MPI calls (an
    estimate of its GIL-held time; for Python waits their polling too).
    'cpu_per_mb': the CPU per MB (10**6 bytes) of the ``nbytes`` a step
    averages; 'phase_NAME': the CPU of each of the averagings' phases
    (mnopt/transport/cpu_phases.py; together no more than 'cpu')."""
    cpu = wait = wait_cpu = gil = 0.0
    phases = dict.fromkeys(PHASES, 0.0)
    for tid, (c1, t1) in after.items():
        c0, t0 = before.get(tid, (0.0, None))
        cpu += c1 - c0
        wait += t1.wall_s - (t0.wall_s if t0 else 0.0)
        wait_cpu += t1.cpu_s - (t0.cpu_s if t0 else 0.0)
        gil += t1.gil_s - (t0.gil_s if t0 else 0.0)
        had = getattr(t0, 'phases', {})
        for name, seconds in getattr(t1, 'phases', {}).items():
            phases[name] = phases.get(name, 0.0) + seconds - had.get(name,
                                                                     0.0)
    costs = {'cpu': cpu / steps, 'wait': wait / steps,
             'wait_cpu': wait_cpu / steps, 'gil_wait': gil / steps,
             'outside_waits_cpu': (cpu - wait_cpu) / steps,
             'cpu_per_mb': cpu / steps / (nbytes * 1e-6)}
    costs.update({'phase_' + k: v / steps for k, v in phases.items()})
    return costs


def ddp_thread_costs(threads, before, after, steps, nbytes):
    """Per step, the CPU seconds of the threads torch.distributed started
    (``threads``: DDPPeer.threads; ``before``/``after``: their CPU so
    far): 'cpu' of those init_process_group and the DDP wrapper started
    (gloo's loops and workers, the TCP store: the communication's),
    'cpu_per_mb' that per MB averaged, and 'by_comm' each thread name's
    (threads of one name summed; those of the first steps, torch's
    compute, named 'NAME (first steps)' and left out of 'cpu')."""
    cpu, by_comm = 0.0, {}
    for tid, (name, birth) in threads.items():
        if before.get(tid) is None or after.get(tid) is None:
            continue   # ended
        seconds = (after[tid] - before[tid]) / steps
        if birth == 'first steps':
            name += ' (first steps)'
        else:
            cpu += seconds
        by_comm[name] = by_comm.get(name, 0.0) + seconds
    return {'cpu': cpu, 'cpu_per_mb': cpu / (nbytes * 1e-6),
            'by_comm': by_comm}


def spread_by_key(dicts):
    """{key: spread} over ``dicts`` (a key a dict lacks counts as 0)."""
    keys = sorted({k for d in dicts for k in d})
    return {k: spread([d.get(k, 0.0) for d in dicts]) for k in keys}


def thread_table(result):
    """The averaging threads' CPU per step, as lines of text: medians
    over the rounds, in ms, and per MB averaged."""
    ms = 1e3
    mnopt_costs = result.get('averaging_thread_s', {})
    phases = [k for k in PHASES
              if any('phase_' + k in c for c in mnopt_costs.values())]
    lines = ['averaging threads, CPU per step (ms, median of rounds), '
             'per MB averaged (%.1f MB a step)' % (result['bytes'] * 1e-6),
             '%-17s %7s %7s  %s' % ('mode', 'cpu', 'cpu/MB', ' '.join(
                 '%7s' % k for k in phases))]
    for mode, c in mnopt_costs.items():
        if mode == 'sync':
            continue   # no averaging thread at work
        lines.append('%-17s %7.2f %7.3f  %s' % (
            mode, c['cpu']['median'] * ms, c['cpu_per_mb']['median'] * ms,
            ' '.join('%*.2f' % (max(7, len(k)), c['phase_' + k]['median']
                                * ms) for k in phases)))
    for mode, c in result.get('ddp_thread_s', {}).items():
        lines.append('%-17s %7.2f %7.3f  %s' % (
            mode, c['cpu']['median'] * ms, c['cpu_per_mb']['median'] * ms,
            ', '.join('%s %.2f' % (k, v['median'] * ms)
                      for k, v in c['by_comm'].items())))
    return lines


def cpu_times():
    """(idle, total) jiffies of all cores."""
    with open('/proc/stat') as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])


class MLP(chainer.ChainList):

    def __init__(self, width, layers, classes=10):
        super(MLP, self).__init__(
            *([L.Linear(width, width) for _ in range(layers)]
              + [L.Linear(width, classes)]))

    def forward(self, x, t):
        h = x
        for link in self[:-1]:
            h = F.relu(link(h))
        return F.softmax_cross_entropy(self[-1](h), t)


def plot(paths, out):
    """Median step time per mode (min-max bars) for each result file, with
    the compute (forward + backward) and the averaging measured alone."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    # Runs of mnopt (--only ddp ones have no parts of mnopt's to draw).
    results = [json.load(open(p)) for p in paths]
    if not any(r.get('parts_s') for r in results):
        raise SystemExit('--plot: no run of mnopt among %s' % paths)
    paths = [p for p, r in zip(paths, results) if r.get('parts_s')]
    results = [r for r in results if r.get('parts_s')]
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4),
                             squeeze=False)
    for ax, res, path in zip(axes[0], results, paths):
        steps = res['step_s']
        names = list(steps)
        med = [steps[m]['median'] for m in names]
        err = [[m - steps[n]['min'] for m, n in zip(med, names)],
               [steps[n]['max'] - m for m, n in zip(med, names)]]
        ax.bar(names, med, yerr=err, color=['#888', '#3a7', '#37a'])
        parts = res['parts_s']
        compute = parts['forward']['median'] + parts['backward']['median']
        ax.axhline(compute, ls='--', c='k', lw=1,
                   label='forward + backward alone')
        ax.axhline(compute + parts['average']['median'], ls=':', c='r',
                   lw=1, label='... + averaging alone')
        for i, n in enumerate(names):
            if n not in res['hidden']:
                continue
            ax.text(i, med[i] / 2, 'hides %.2f' % res['hidden'][n]['median'],
                    ha='center', color='w')
        ax.set_ylabel('seconds per step (median, min-max)')
        title = os.path.basename(path)
        if 'thread_slice_us' in res:
            title += '\nMNOPT_THREAD_SLICE_US=%d' % res['thread_slice_us']
        ax.set_title(title, fontsize=10)
        ax.legend(loc='lower right', fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--plot', nargs=2, metavar=('PNG', 'JSONS'),
                   help='plot saved results (comma-separated) and exit')
    p.add_argument('--width', type=int, default=1024)
    p.add_argument('--layers', type=int, default=6)
    p.add_argument('--batch', type=int, default=256)
    p.add_argument('--steps', type=int, default=5)
    p.add_argument('--rounds', type=int, default=5)
    p.add_argument('--communicator', default='flat')
    p.add_argument('--bucket-bytes', type=int, default=4 << 20)
    p.add_argument('--ddp', action='store_true',
                   help="PyTorch DDP on gloo in the same rounds "
                   "(benchmarks/ddp_peer.py; needs torch)")
    p.add_argument('--only', choices=('mnopt', 'ddp'),
                   help="one framework only, as a user runs it (--only ddp "
                   "implies --ddp; mnopt's communicator is still made, for "
                   "the barriers between rounds); default: mnopt, and DDP "
                   "too with --ddp, in the same processes")
    p.add_argument('--json')
    args = p.parse_args(argv)
    if args.plot:
        return plot(args.plot[1].split(','), args.plot[0])
    # The averaging thread's divides and sums, each a phase of its CPU.
    os.environ.setdefault('MNOPT_PROFILE_THREADS', '1')

    comm = mnopt.create_communicator(args.communicator,
                                     bucket_bytes=args.bucket_bytes)
    with_mnopt = args.only != 'ddp'
    with_ddp = args.ddp or args.only == 'ddp'
    if args.only == 'mnopt':
        with_ddp = False
    rng = numpy.random.RandomState(comm.rank)
    x = rng.standard_normal((args.batch, args.width)).astype(numpy.float32)
    t = rng.randint(0, 10, args.batch).astype(numpy.int32)
    runs = {}
    for mode in MODES if with_mnopt else ():
        numpy.random.seed(0)
        model = MLP(args.width, args.layers)
        opt = mnopt.create_multi_node_optimizer(
            chainer.optimizers.MomentumSGD(lr=0.01), comm,
            double_buffering=mode == 'double buffering',
            overlap=mode == 'overlap').setup(model)
        for _ in range(3):   # broadcast, plan, warm
            opt.update(model, x, t)
        if hasattr(opt, 'wait'):
            opt.wait()
        runs[mode] = (model, opt)
    n_params = args.layers * (args.width + 1) * args.width \
        + (args.width + 1) * 10
    nbytes = 4 * n_params   # averaged each step (float32 gradients)
    modes = MODES if with_mnopt else ()
    peer = None
    if with_ddp:
        import ddp_peer
        peer = ddp_peer.DDPPeer(comm.mpi_comm, args.width, args.layers,
                                args.batch, args.bucket_bytes, comm.rank)
        modes = modes + ddp_peer.MODES

    times = {m: [] for m in modes}
    blocked = {m: [] for m in MODES}   # waiting for averagings, per step
    idle = {m: [] for m in modes}      # the machine's CPU idle share
    costs = {m: [] for m in MODES}     # the averaging thread's, per step
    # The threads torch.distributed started, per step.
    ddp_costs = {m: [] for m in modes if m not in MODES}
    parts = {'forward': [], 'backward': [], 'average': []}
    peer_parts = {'forward': [], 'backward': [], 'average': []}
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for mode in order:
            comm.mpi_comm.Barrier()
            i0, j0 = cpu_times()
            start = time.perf_counter()
            if mode not in MODES:
                threads = peer.thread_cpu()
                for _ in range(args.steps):
                    peer.step(mode)
                comm.mpi_comm.Barrier()
                times[mode].append((time.perf_counter() - start)
                                   / args.steps)
                i1, j1 = cpu_times()
                idle[mode].append((i1 - i0) / max(1, j1 - j0))
                ddp_costs[mode].append(ddp_thread_costs(
                    peer.threads, threads, peer.thread_cpu(), args.steps,
                    nbytes))
                continue
            model, opt = runs[mode]
            waited = opt.communication_time
            threads = averaging_threads()
            for _ in range(args.steps):
                opt.update(model, x, t)
            if hasattr(opt, 'wait'):
                opt.wait()
            comm.mpi_comm.Barrier()
            times[mode].append((time.perf_counter() - start) / args.steps)
            i1, j1 = cpu_times()
            idle[mode].append((i1 - i0) / max(1, j1 - j0))
            costs[mode].append(thread_costs(threads, averaging_threads(),
                                            args.steps, nbytes))
            blocked[mode].append((opt.communication_time - waited)
                                 / args.steps)
        if peer is not None:
            for k, v in zip(('forward', 'backward', 'average'), peer.parts(
                    time.perf_counter, comm.mpi_comm.Barrier)):
                peer_parts[k].append(v)
        if not with_mnopt:
            continue
        # The parts, on their own (no averaging in flight).
        model = runs['sync'][0]
        comm.mpi_comm.Barrier()
        t0 = time.perf_counter()
        loss = model(x, t)
        t1 = time.perf_counter()
        model.cleargrads()
        loss.backward()
        t2 = time.perf_counter()
        named = [(n, p.grad) for n, p in sorted(model.namedparams())]
        comm.mpi_comm.Barrier()
        t3 = time.perf_counter()
        comm.mean_grads(named)
        t4 = time.perf_counter()
        parts['forward'].append(t1 - t0)
        parts['backward'].append(t2 - t1)
        parts['average'].append(t4 - t3)

    result = {'command': ' '.join(sys.argv), 'ranks': comm.size,
              'communicator': comm.name, 'parameters': n_params,
              'bytes': nbytes, 'width': args.width,
              'layers': args.layers, 'batch': args.batch,
              'steps': args.steps, 'rounds': args.rounds,
              'bucket_bytes': args.bucket_bytes,
              # MNOPT_THREAD_SLICE_US: the averaging thread's slice
              'thread_slice_us': _sched.slice_us(),
              'step_s': {m: spread(v) for m, v in times.items()},
              'blocked_s': {m: spread(v) for m, v in blocked.items()
                            if v},
              'parts_s': {k: spread(v) for k, v in parts.items() if v},
              'cpu_idle': {m: spread(v) for m, v in idle.items()},
              # MNOPT_WAIT: how the averaging thread waits
              'wait': waiting.kind() if waiting else 'python',
              # MNOPT_PROFILE_THREADS: the ring's divides and sums timed
              'profile_threads': os.environ.get('MNOPT_PROFILE_THREADS'),
              'averaging_thread_s': {
                  m: spread_by_key(v) for m, v in costs.items()
                  if v and v[0]}}
    hidden, hidden_rounds = {}, {}
    for mode in MODES[1:] if with_mnopt else ():
        hidden_rounds[mode] = [(s - o) / min(b, a) for s, o, b, a in zip(
            times['sync'], times[mode], parts['backward'], parts['average'])]
        hidden[mode] = spread(hidden_rounds[mode])
    if peer is not None:
        result['ddp_parts_s'] = {k: spread(v) for k, v in peer_parts.items()}
        # The threads torch.distributed started: (name, what started it).
        result['ddp_threads'] = sorted(peer.threads.values())
        result['ddp_thread_s'] = {
            m: {'cpu': spread([c['cpu'] for c in v]),
                'cpu_per_mb': spread([c['cpu_per_mb'] for c in v]),
                'by_comm': spread_by_key([c['by_comm'] for c in v])}
            for m, v in ddp_costs.items() if v}
        hidden_rounds['ddp'] = [(s - o) / min(b, a) for s, o, b, a in zip(
            times['ddp sync'], times['ddp'], peer_parts['backward'],
            peer_parts['average'])]
        hidden['ddp'] = spread(hidden_rounds['ddp'])
    result['hidden'] = hidden
    # Round by round, and each rank's own: where a run's swings come from.
    result['rounds_of_rank'] = comm.mpi_comm.gather({
        'step_s': times, 'blocked_s': blocked, 'cpu_idle': idle,
        'parts_s': parts, 'ddp_parts_s': peer_parts,
        'hidden': hidden_rounds,
        'averaging_thread_cpu_s': {m: [c['cpu'] for c in v]
                                   for m, v in costs.items() if v},
        'ddp_thread_cpu_s': {m: [c['cpu'] for c in v]
                             for m, v in ddp_costs.items() if v}}, root=0)
    comm.finalize()
    if comm.rank == 0:
        print(json.dumps(result, indent=1))
        print('\n'.join(thread_table(result)))
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)),
                        exist_ok=True)
            with open(args.json, 'w') as f:
                json.dump(result, f, indent=1)


if __name__ == '__main__':
    main()
