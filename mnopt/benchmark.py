"""Benchmark gradient averaging, side by side in one run.

    mpiexec -n 2 python -m mpi4py -m mnopt.benchmark [--quick] [--json FILE]

Times gradient averaging (``mean_grads``) on ResNet-50's gradient set
(162 arrays, 25,557,096 float32) for each communicator and wire dtype, next to:

- the limit: raw mpi4py ``Allreduce`` of one pre-packed float32 buffer, at
  the best of several chunk sizes (no packing, no casting, no scaling);
- ChainerMN's own ``naive`` communicator, when ChainerMN is importable.

Cases run round-robin within each repetition so drift on a shared machine
hits all of them alike; each time is the slowest rank's.
"""

import argparse
import atexit
import collections
import json
import os
import socket
import statistics
import sys
import time

import numpy
from mpi4py import MPI

from mnopt import cli


def resnet50_grad_shapes(n_classes=1000):
    """Parameter shapes of ResNet-50 as in Chainer's ImageNet example
    (conv1 with bias, batch normalisation after every convolution)."""
    shapes = [(64, 3, 7, 7), (64,), (64,), (64,)]
    in_ch = 64
    for n_blocks, mid, out in ((3, 64, 256), (4, 128, 512),
                               (6, 256, 1024), (3, 512, 2048)):
        for block in range(n_blocks):
            convs = [(mid, in_ch, 1, 1), (mid, mid, 3, 3), (out, mid, 1, 1)]
            if block == 0:
                convs.append((out, in_ch, 1, 1))  # projection shortcut
            for w in convs:
                shapes += [w, (w[0],), (w[0],)]   # conv W, BN gamma, beta
            in_ch = out
    return shapes + [(n_classes, 2048), (n_classes,)]


def spread(values):
    """{'min', 'median', 'max'} of a figure measured several times."""
    return {'min': min(values), 'median': statistics.median(values),
            'max': max(values)}


def grad_list(shapes, rank, dtype=numpy.float32):
    """[(name, gradient)] as ``mean_grads`` takes them: no Chainer needed."""
    rng = numpy.random.RandomState(rank)
    return [('p%03d' % i, rng.standard_normal(shape).astype(dtype))
            for i, shape in enumerate(shapes)]


def grad_model(shapes, rank, dtype=numpy.float32):
    """A Chainer Link holding ``grad_list``'s gradients (for the cases that
    need Chainer: the optimizer wrapper, ChainerMN)."""
    import chainer
    link = chainer.Link()
    with link.init_scope():
        for name, grad in grad_list(shapes, rank, dtype):
            p = chainer.Parameter(numpy.zeros(grad.shape, dtype=dtype))
            p.grad = grad
            setattr(link, name, p)
    return link


def _limit_case(comm, n_elements, chunk):
    buf = numpy.ones(n_elements, dtype=numpy.float32)

    def run():
        for start in range(0, n_elements, chunk):
            comm.Allreduce(MPI.IN_PLACE, buf[start:start + chunk])
    return run


SIGN_COMMS = {}  # case label -> its sign-compressed communicator


def build_cases(args, world):
    import mnopt
    shapes = resnet50_grad_shapes()
    total = sum(int(numpy.prod(s)) for s in shapes)
    cases = []
    if not args.only_mnopt:
        limit_comm = world.Dup()
        for mib in [4, 16] if args.quick else [1, 4, 16, 64]:
            cases.append(('limit: Allreduce, %d MiB chunks' % mib, 'limit',
                          _limit_case(limit_comm, total, mib << 18)))
        cases += _chainermn_cases(shapes, world)
    for name in args.communicators:
        for wire, options, label in _variants(name, args):
            if name == 'reduction_server':
                options['stats'] = True
            comm = mnopt.create_communicator(
                name, bucket_bytes=args.bucket_bytes, **options)
            if name == 'reduction_server' and world.rank == 0:
                atexit.register(lambda c=comm: print(c.stats.format(
                    'worker 0 %s' % c.allreduce_grad_dtype)))
            grads = grad_list(shapes, world.rank)
            cases.append(('mnopt %s %s' % (name, label), name,
                          lambda c=comm, g=grads: c.mean_grads(g)))
            if wire == 'sign':
                SIGN_COMMS[cases[-1][0]] = comm
            if args.compare_checks and name != 'reduction_server':
                # The same averaging with stall detection and the overflow
                # check off: what the checks cost.
                off = mnopt.create_communicator(
                    name, bucket_bytes=args.bucket_bytes, stall_warning=0,
                    timeout=0, on_overflow='ignore', **options)
                cases.append(('mnopt %s %s, checks off' % (name, label),
                              name + ' checks off',
                              lambda c=off, g=grads: c.mean_grads(g)))
    return cases, total


def _chainermn_cases(shapes, world):
    """ChainerMN's naive communicator, where ChainerMN can run here."""
    from mnopt import server
    try:
        if server.job().servers:
            raise RuntimeError('a job with reduction servers')
        import chainermn
        cmn = chainermn.create_communicator('naive', mpi_comm=world.Dup())
    except Exception as e:  # not installed, or not importable here
        if world.rank == 0:
            print('# ChainerMN not available (%s); skipping it' % e)
        return []
    model = grad_model(shapes, world.rank)
    return [('chainermn naive', 'chainermn',
             lambda: cmn.multi_node_mean_grad(model))]


def _variants(name, args):
    """(wire, communicator options, label) for each of --dtypes; 'sign'
    is sign compression (majority vote), not a dtype, once per --votes
    (the reduction server votes its own way)."""
    for wire in args.dtypes:
        if wire != 'sign':
            yield wire, {'allreduce_grad_dtype': wire}, wire
        elif name == 'reduction_server':
            yield wire, {'compression': 'sign'}, wire
        else:
            for vote in args.votes:
                label = wire if vote == 'ring' else '%s (%s vote)' % (wire,
                                                                      vote)
                yield wire, {'compression': 'sign', 'vote': vote}, label


def link_tx_bytes():
    """{interface: bytes sent so far} of this node's network interfaces
    but loopback (Linux's /sys counters; frames a bridge forwards count on
    the interface they leave by)."""
    out = {}
    root = '/sys/class/net'
    for dev in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        try:
            with open(os.path.join(root, dev, 'statistics', 'tx_bytes')) as f:
                out[dev] = int(f.read())
        except (OSError, ValueError):
            continue
    out.pop('lo', None)
    return out


def counting_link_bytes(cases):
    """``cases`` with each function wrapped to add up the bytes this node's
    interfaces sent while it ran; returns (wrapped cases, per_call) where
    ``per_call()`` is, per case, {interface: mean bytes per call}."""
    totals = [collections.Counter() for _ in cases]
    calls = [0] * len(cases)

    def wrap(i, fn):
        def run():
            before = link_tx_bytes()
            fn()
            for dev, n in link_tx_bytes().items():
                totals[i][dev] += n - before.get(dev, n)
            calls[i] += 1
        return run

    def per_call():
        return [{dev: n / max(1, c) for dev, n in t.items()}
                for t, c in zip(totals, calls)]
    return ([(label, kind, wrap(i, fn))
             for i, (label, kind, fn) in enumerate(cases)], per_call)


def gather_link_bytes(world, per_case):
    """Rank 0: per case {'host:interface': bytes per call}, one entry per
    node (the first rank of each host speaks for it)."""
    gathered = world.gather((socket.gethostname(), per_case))
    if gathered is None:
        return None
    merged = [{} for _ in per_case]
    seen = set()
    for host, cases in gathered:
        if host in seen:
            continue
        seen.add(host)
        for out, counts in zip(merged, cases):
            out.update(('%s:%s' % (host, dev), n) for dev, n in counts.items())
    return merged


def run_cases(cases, world, reps, warmup=2, progress=''):
    """Time each case ``reps`` times, round-robin; returns the slowest
    rank's times, shape (cases, reps)."""
    times = numpy.zeros((len(cases), reps))
    for rep in range(warmup + reps):
        for i, (_, _, fn) in enumerate(cases):
            world.Barrier()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if rep >= warmup:
                times[i, rep - warmup] = dt
        if world.rank == 0:
            sys.stderr.write('\r%srepetition %d/%d ' % (progress, rep + 1,
                                                         warmup + reps))
            sys.stderr.flush()
    if world.rank == 0:
        sys.stderr.write('\r' + ' ' * 60 + '\r')
    world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)  # the slowest rank
    return times


def bus_bandwidth(algbw, n):
    """nccl-tests' allreduce bus bandwidth: what each link carries."""
    return algbw * 2.0 * (n - 1) / n if n > 1 else algbw


SWEEP_SIZES = [1 << k for k in range(10, 29, 2)]  # 1 KiB .. 256 MiB


def _reps_for(nbytes, reps):
    return max(3, reps if nbytes <= 1 << 20 else reps // 2
               if nbytes <= 16 << 20 else reps // 5)


def sweep(args, world):
    """mean_grads of one float32 array per message size, next to
    one raw Allreduce of the same buffer."""
    import mnopt
    comms = [(name, wire, mnopt.create_communicator(
        name, allreduce_grad_dtype=wire))
        for name in args.communicators for wire in args.dtypes]
    raw = world.Dup()
    rows = []
    sizes = [n for n in SWEEP_SIZES if n <= args.max_size]
    for i, nbytes in enumerate(sizes):
        n = nbytes // 4
        buf = numpy.ones(n, numpy.float32)
        cases = [('mpi4py Allreduce', 'raw',
                  lambda b=buf: raw.Allreduce(MPI.IN_PLACE, b))]
        for name, wire, comm in comms:
            grads = [('w', numpy.ones(n, numpy.float32))]
            cases.append(('mnopt %s %s' % (name, wire), name,
                          lambda c=comm, g=grads: c.mean_grads(g)))
        times = run_cases(cases, world, _reps_for(nbytes, args.reps),
                          progress='size %d/%d (%s): ' % (
                              i + 1, len(sizes), _human(nbytes)))
        for (label, kind, _), t in zip(cases, times):
            med = float(numpy.median(t))
            rows.append({'bytes': nbytes, 'case': label, 'kind': kind,
                         'median_s': med, 'min_s': float(t.min()),
                         'max_s': float(t.max()),
                         'algbw_GBps': nbytes / med / 1e9,
                         'busbw_GBps': bus_bandwidth(nbytes / med / 1e9,
                                                     world.size)})
    return rows


def _human(nbytes):
    for unit in ('B', 'KiB', 'MiB', 'GiB'):
        if nbytes < 1024:
            return '%d %s' % (nbytes, unit)
        nbytes //= 1024
    return '%d TiB' % nbytes


def print_sweep(rows, world):
    print('# mean_grads of one float32 array, N=%d, slowest rank; '
          'algbw = bytes/time, busbw = algbw*2(N-1)/N' % world.size)
    print('%10s  %-28s %10s %10s %10s %9s %9s' % (
        'size', 'case', 'median ms', 'min ms', 'max ms', 'algbw GB/s',
        'busbw GB/s'))
    for r in rows:
        print('%10s  %-28s %10.3f %10.3f %10.3f %9.3f %9.3f' % (
            _human(r['bytes']), r['case'], r['median_s'] * 1e3,
            r['min_s'] * 1e3, r['max_s'] * 1e3, r['algbw_GBps'],
            r['busbw_GBps']))


def plot_sweep(rows, path, title):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for case in dict.fromkeys(r['case'] for r in rows):
        pts = [(r['bytes'], r['busbw_GBps']) for r in rows if r['case'] == case]
        ax.plot(*zip(*pts), marker='o', label=case)
    ax.set_xscale('log', base=2)
    ax.set_xlabel('message size (bytes)')
    ax.set_ylabel('bus bandwidth (GB/s)')
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


STEPS_PER_BLOCK = 16


class _SimulatedUpdate(object):
    """Stands in for a Chainer optimizer whose update runs elsewhere (on a
    GPU): it counts updates and leaves the CPU alone."""

    _loss_scale = None

    def __init__(self):
        self.t = 0
        self.target = None

    def setup(self, link):
        self.target = link
        return self

    def update(self, lossfun=None, *args, **kwds):
        self.t += 1


def _simulated_steps(model, opt, grad_sets, compute_s, drain=True):
    """STEPS_PER_BLOCK training steps whose forward, backward and update are
    SIMULATED by sleeping ``compute_s``; backward's fresh gradients are two
    alternating sets of arrays, handed over by assignment as backward does.
    With ``drain`` the block ends with nothing in flight, so no work leaks
    into the next measurement; without it, consecutive blocks of one case
    form a steady-state run (each pays for what the previous left)."""
    params = [p for _, p in sorted(model.namedparams())]

    def steps():
        for k in range(STEPS_PER_BLOCK):
            time.sleep(compute_s)
            for p, g in zip(params, grad_sets[k % 2]):
                p.grad = g
            opt.update()
        if drain and hasattr(opt, 'wait'):
            opt.wait()
    steps.optimizer = opt
    return steps


def double_buffering(args, world):
    """Step time with simulated compute as long as the averaging: plain
    (compute + averaging) against double buffering (overlapped)."""
    import mnopt
    shapes = resnet50_grad_shapes()
    comm = mnopt.create_communicator(args.communicators[0],
                                     allreduce_grad_dtype=args.dtypes[0])

    def gradients(seed):
        model = grad_model(shapes, world.rank + 1000 * seed)
        return [p.grad for _, p in sorted(model.namedparams())]
    grad_sets = [gradients(0), gradients(1)]

    def steps(compute_s, **kw):
        model = grad_model(shapes, world.rank)
        opt = mnopt.create_multi_node_optimizer(_SimulatedUpdate(), comm,
                                                **kw).setup(model)
        return _simulated_steps(model, opt, grad_sets, compute_s)

    # The averaging alone: the same steps with no compute at all.
    mean = ('averaging alone', 'comm', steps(0.0))
    probe = run_cases([mean], world, 3)
    compute_s = float(numpy.median(probe)) / STEPS_PER_BLOCK
    cases = [mean,
             ('step, plain', 'plain', steps(compute_s)),
             ('step, double buffering', 'double_buffering',
              steps(compute_s, double_buffering=True))]
    times = run_cases(cases, world, args.reps) / STEPS_PER_BLOCK
    med = dict((c[1], m) for c, m in zip(cases, numpy.median(times, axis=1)))
    if world.rank != 0:
        return None
    print('# double buffering: %s %s, N=%d, ResNet-50 gradients; per step, '
          'over blocks of %d steps; compute SIMULATED: sleep %.1f ms per step '
          '(forward + backward + update)'
          % (comm.name, comm.allreduce_grad_dtype or 'float32', world.size,
             STEPS_PER_BLOCK, compute_s * 1e3))
    for (label, kind, _), row in zip(cases, times):
        print('%-26s %8.1f ms  (min %.1f, max %.1f)' % (
            label, med[kind] * 1e3, row.min() * 1e3, row.max() * 1e3))
    longer = max(compute_s, med['comm'])
    shorter = min(compute_s, med['comm'])
    result = {
        'compute_s': compute_s, 'median_s': med,
        'plain_over_sum': med['plain'] / (compute_s + med['comm']),
        'db_over_max': med['double_buffering'] / longer,
        'hidden_fraction': (compute_s + med['comm']
                            - med['double_buffering']) / shorter}
    print('plain step / (compute + averaging)       = %.2f' %
          result['plain_over_sum'])
    print('double-buffered step / max(compute, avg.) = %.2f  (goal <= 1.15)'
          % result['db_over_max'])
    print('fraction of the shorter part hidden       = %.2f  (goal >= 0.85)'
          % result['hidden_fraction'])
    return result


def scaling(args, world):
    """Per-step time with a fixed SIMULATED compute per step: plain float32
    averaging against double buffering with float16 on the wire.  Run it
    at several node counts; efficiency e = t / (t0 n) = step(1) / step(n)
    (ChainerMN's definition, throughput t on n nodes, t0 on one)."""
    import mnopt
    shapes = resnet50_grad_shapes()
    compute_s = args.compute_ms / 1e3
    grad_sets = [[p.grad for _, p in sorted(grad_model(
        shapes, world.rank + 1000 * seed).namedparams())] for seed in (0, 1)]

    def steps(wire, **kw):
        comm = mnopt.create_communicator(args.communicators[0],
                                         allreduce_grad_dtype=wire)
        model = grad_model(shapes, world.rank)
        opt = mnopt.create_multi_node_optimizer(_SimulatedUpdate(), comm,
                                                **kw).setup(model)
        return _simulated_steps(model, opt, grad_sets, compute_s,
                                drain=False)
    cases = [('plain, float32', 'plain_fp32', steps('float32')),
             ('double buffering, float16', 'db_fp16',
              steps('float16', double_buffering=True))]
    # One case at a time: its blocks form one steady-state run, drained
    # before the next case starts.
    times = []
    for case in cases:
        times.append(run_cases([case], world, args.reps, warmup=1)[0]
                     / STEPS_PER_BLOCK)
        opt = case[2].optimizer
        if hasattr(opt, 'wait'):
            opt.wait()
    probe = mnopt.create_communicator('flat')
    result = {'n_ranks': world.size, 'n_nodes': probe.inter_size,
              'compute_s': compute_s, 'communicator': args.communicators[0],
              'steps': {k: float(numpy.median(t))
                        for (_, k, _), t in zip(cases, times)}}
    if world.rank == 0:
        print('# scaling: %d nodes x %d ranks, %s, compute SIMULATED %.0f ms '
              'per step' % (probe.inter_size, probe.intra_size,
                            args.communicators[0], args.compute_ms))
        for (label, kind, _), t in zip(cases, times):
            print('%-28s %8.1f ms per step (min %.1f, max %.1f)' % (
                label, result['steps'][kind] * 1e3, t.min() * 1e3,
                t.max() * 1e3))
    return result


def parser():
    """The command line: every option with its help, bad values refused by
    argparse (usage and an ``error:`` line, exit status 2)."""
    from mnopt import communicators
    from mnopt import grad_buffer
    p = argparse.ArgumentParser(
        prog='python -m mnopt.benchmark',
        description=__doc__.split('\n')[0],
        epilog=__doc__.split('\n', 1)[1].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--communicators', nargs='+', metavar='NAME',
                   choices=[n for n in communicators.NAMES if n != 'auto'],
                   help='the mnopt communicators to time, of %(choices)s '
                        '(default: naive flat hierarchical; flat with '
                        '--scaling or --double-buffering)')
    p.add_argument('--dtypes', nargs='+', metavar='WIRE',
                   default=['float32', 'float16', 'bfloat16'],
                   choices=list(grad_buffer.WIRE_DTYPES) + ['sign'],
                   help='the wires to time, of %(choices)s (sign: sign '
                        'compression, a majority vote) (default: float32 '
                        'float16 bfloat16)')
    p.add_argument('--votes', nargs='+', default=['ring'],
                   choices=['ring', 'alltoall'],
                   help="how --dtypes sign counts votes (ring "
                        "communicators; default: ring)")
    p.add_argument('--reps', type=cli.positive_int, default=15,
                   help='repetitions of each case (default 15; at most 5 '
                        'with --quick)')
    p.add_argument('--only-mnopt', action='store_true',
                   help='time the mnopt communicators only (not the '
                        'raw-Allreduce limit nor ChainerMN)')
    p.add_argument('--link-bytes', action='store_true',
                   help='record the bytes each node\'s interfaces sent '
                        'per averaging (JSON: link_tx_bytes)')
    p.add_argument('--bucket-bytes', type=cli.positive_int, default=None,
                   help='bucket size of the mnopt communicators, in bytes '
                        '(default: theirs)')
    p.add_argument('--quick', action='store_true',
                   help='fewer cases and repetitions (a smoke run)')
    p.add_argument('--compare-checks', action='store_true',
                   help='time each case also with stall detection and '
                        'the overflow check off (stall_warning=0, '
                        'timeout=0, on_overflow=ignore)')
    p.add_argument('--json', metavar='FILE',
                   help='write the results to this file')
    p.add_argument('--sizes', action='store_true',
                   help='sweep message sizes from 1 KiB to --max-size')
    p.add_argument('--max-size', type=cli.positive_int, default=256 << 20,
                   metavar='BYTES',
                   help='largest message of --sizes (default 256 MiB)')
    p.add_argument('--plot', metavar='PNG',
                   help='write a PNG figure here (--sizes)')
    p.add_argument('--scaling', action='store_true',
                   help='step time with --compute-ms of simulated '
                        'compute: plain float32 vs double buffering + '
                        'float16')
    p.add_argument('--compute-ms', type=cli.nonnegative_float,
                   default=1000.0,
                   help='simulated compute per step, in ms (--scaling; '
                        'default 1000)')
    p.add_argument('--steps', type=cli.positive_int, default=None,
                   help='steps per timed block (--scaling, '
                        '--double-buffering)')
    p.add_argument('--double-buffering', action='store_true',
                   help='measure the overlap of double buffering (with '
                        'the first of --communicators and --dtypes)')
    return p


def main(argv=None):
    parser_ = parser()
    args = cli.parse_args(parser_, argv)
    if args.quick:
        args.reps = min(args.reps, 5)
        args.dtypes = args.dtypes[:2]
    world = MPI.COMM_WORLD
    from mnopt import server
    if server.job().servers:
        # Servers take no part in the timing: time over the workers, with
        # the reduction_server communicator (the only one such a job runs).
        import mnopt
        first = mnopt.create_communicator('reduction_server')
        world = first.mpi_comm
        args.communicators = ['reduction_server']
    if args.steps:
        global STEPS_PER_BLOCK
        STEPS_PER_BLOCK = args.steps
    if args.scaling:
        args.communicators = args.communicators or ['flat']
        result = scaling(args, world)
        if args.json and world.rank == 0:
            with open(args.json, 'w') as f:
                json.dump(result, f, indent=1)
        return
    if args.double_buffering:
        args.communicators = args.communicators or ['flat']
        result = double_buffering(args, world)
        if args.json and result is not None:
            with open(args.json, 'w') as f:
                json.dump(result, f, indent=1)
        return
    args.communicators = args.communicators or ['naive', 'flat',
                                                'hierarchical']
    if args.sizes:
        rows = sweep(args, world)
        if world.rank == 0:
            print_sweep(rows, world)
            if args.json:
                with open(args.json, 'w') as f:
                    json.dump({'n_ranks': world.size, 'rows': rows}, f,
                              indent=1)
            if args.plot:
                plot_sweep(rows, args.plot, 'allreduce bus bandwidth, N=%d'
                           % world.size)
        return
    cases, total = build_cases(args, world)
    if args.link_bytes:
        cases, link_bytes_per_call = counting_link_bytes(cases)
    times = run_cases(cases, world, args.reps)
    link_bytes = gather_link_bytes(world, link_bytes_per_call()) \
        if args.link_bytes else None
    if world.rank != 0:
        return
    nbytes = total * 4
    medians = numpy.median(times, axis=1)
    limit = min([m for m, c in zip(medians, cases) if c[1] == 'limit'],
                default=None)
    rows = []
    print('# mean_grads, ResNet-50 gradients (%d float32, %.1f MB), '
          'N=%d, %d repetitions, slowest rank; algbw = bytes/time, busbw = '
          'algbw*2(N-1)/N (what each rank\'s link carries on a ring); '
          'MNOPT_ALLREDUCE=%s' % (total, nbytes / 1e6, world.size,
                                  args.reps, os.environ.get(
                                      'MNOPT_ALLREDUCE') or 'auto'))
    print('%-34s %9s %9s %9s %9s %9s %9s' % (
        'case', 'median ms', 'min ms', 'max ms', 'algbw GB/s', 'busbw GB/s',
        'x limit'))
    for (label, kind, _), t, med in zip(cases, times, medians):
        row = {'case': label, 'kind': kind, 'median_s': float(med),
               'min_s': float(t.min()), 'max_s': float(t.max()),
               'algbw_GBps': nbytes / med / 1e9,
               'busbw_GBps': bus_bandwidth(nbytes / med / 1e9, world.size),
               'x_limit': float(med / limit) if limit else None}
        if label in SIGN_COMMS:  # measured: bytes rank 0 sent in its vote
            row['sent_bytes'] = SIGN_COMMS[label].vote_stats['bytes_sent']
        if link_bytes is not None:
            row['link_tx_bytes'] = link_bytes[len(rows)]
        rows.append(row)
        print('%-34s %9.1f %9.1f %9.1f %9.3f %9.3f %9s' % (
            label, med * 1e3, t.min() * 1e3, t.max() * 1e3,
            row['algbw_GBps'], row['busbw_GBps'],
            '%.2f' % row['x_limit'] if limit else '-'))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'n_ranks': world.size, 'n_elements': total,
                       'reps': args.reps, 'allreduce': os.environ.get(
                           'MNOPT_ALLREDUCE') or 'auto',
                       'rows': rows}, f, indent=1)


if __name__ == '__main__':
    main()
