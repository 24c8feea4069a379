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
"""

import argparse
import json
import os
import sys
import time

import numpy

import mnopt  # before Chainer: NumPy 2 names for it
from mnopt import _sched
try:
    from mnopt.benchmarking.harness import spread
except ImportError:  # a tree from before the library (rerun.py --code)
    from mnopt.benchmark import spread
try:
    from mnopt.transport import wait_tallies, waiting
except ImportError:  # a tree from before the C waits (rerun.py --code)
    wait_tallies = waiting = None
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


def thread_costs(before, after, steps):
    """Per step, the averaging threads' CPU seconds, seconds inside
    mnopt's waits (the GIL released), the CPU of those waits, the time
    spent getting the GIL back after them (C waits only), and the CPU
    outside them: time the thread ran Python, numpy and MPI calls (an
    estimate of its GIL-held time; for Python waits their polling too)."""
    cpu = wait = wait_cpu = gil = 0.0
    for tid, (c1, t1) in after.items():
        c0, t0 = before.get(tid, (0.0, None))
        cpu += c1 - c0
        wait += t1.wall_s - (t0.wall_s if t0 else 0.0)
        wait_cpu += t1.cpu_s - (t0.cpu_s if t0 else 0.0)
        gil += t1.gil_s - (t0.gil_s if t0 else 0.0)
    return {'cpu': cpu / steps, 'wait': wait / steps,
            'wait_cpu': wait_cpu / steps, 'gil_wait': gil / steps,
            'outside_waits_cpu': (cpu - wait_cpu) / steps}


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
    results = [json.load(open(p)) for p in paths]
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
    p.add_argument('--json')
    args = p.parse_args(argv)
    if args.plot:
        return plot(args.plot[1].split(','), args.plot[0])

    comm = mnopt.create_communicator(args.communicator,
                                     bucket_bytes=args.bucket_bytes)
    rng = numpy.random.RandomState(comm.rank)
    x = rng.standard_normal((args.batch, args.width)).astype(numpy.float32)
    t = rng.randint(0, 10, args.batch).astype(numpy.int32)
    runs = {}
    for mode in MODES:
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
    model = runs['sync'][0]
    n_params = sum(p.size for p in model.params())
    modes = MODES
    peer = None
    if args.ddp:
        import ddp_peer
        peer = ddp_peer.DDPPeer(comm.mpi_comm, args.width, args.layers,
                                args.batch, args.bucket_bytes, comm.rank)
        modes = MODES + ddp_peer.MODES

    times = {m: [] for m in modes}
    blocked = {m: [] for m in MODES}   # waiting for averagings, per step
    idle = {m: [] for m in modes}      # the machine's CPU idle share
    costs = {m: [] for m in MODES}     # the averaging thread's, per step
    parts = {'forward': [], 'backward': [], 'average': []}
    peer_parts = {'forward': [], 'backward': [], 'average': []}
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for mode in order:
            comm.mpi_comm.Barrier()
            i0, j0 = cpu_times()
            start = time.perf_counter()
            if mode not in MODES:
                for _ in range(args.steps):
                    peer.step(mode)
                comm.mpi_comm.Barrier()
                times[mode].append((time.perf_counter() - start)
                                   / args.steps)
                i1, j1 = cpu_times()
                idle[mode].append((i1 - i0) / max(1, j1 - j0))
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
                                            args.steps))
            blocked[mode].append((opt.communication_time - waited)
                                 / args.steps)
        if peer is not None:
            for k, v in zip(('forward', 'backward', 'average'), peer.parts(
                    time.perf_counter, comm.mpi_comm.Barrier)):
                peer_parts[k].append(v)
        # The parts, on their own (no averaging in flight).
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
              'bytes': 4 * n_params, 'width': args.width,
              'layers': args.layers, 'batch': args.batch,
              'steps': args.steps, 'rounds': args.rounds,
              'bucket_bytes': args.bucket_bytes,
              # MNOPT_THREAD_SLICE_US: the averaging thread's slice
              'thread_slice_us': _sched.slice_us(),
              'step_s': {m: spread(v) for m, v in times.items()},
              'blocked_s': {m: spread(v) for m, v in blocked.items()},
              'parts_s': {k: spread(v) for k, v in parts.items()},
              'cpu_idle': {m: spread(v) for m, v in idle.items()},
              # MNOPT_WAIT: how the averaging thread waits
              'wait': waiting.kind() if waiting else 'python',
              'averaging_thread_s': {
                  m: {k: spread([c[k] for c in v]) for k in v[0]}
                  for m, v in costs.items() if v and v[0]}}
    hidden = {}
    for mode in MODES[1:]:
        per_round = [(s - o) / min(b, a) for s, o, b, a in zip(
            times['sync'], times[mode], parts['backward'], parts['average'])]
        hidden[mode] = spread(per_round)
    if peer is not None:
        result['ddp_parts_s'] = {k: spread(v) for k, v in peer_parts.items()}
        hidden['ddp'] = spread([(s - o) / min(b, a) for s, o, b, a in zip(
            times['ddp sync'], times['ddp'], peer_parts['backward'],
            peer_parts['average'])])
    result['hidden'] = hidden
    comm.finalize()
    if comm.rank == 0:
        print(json.dumps(result, indent=1))
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)),
                        exist_ok=True)
            with open(args.json, 'w') as f:
                json.dump(result, f, indent=1)


if __name__ == '__main__':
    main()
