"""mnopt's pipelined ring (mnopt/transport/ring.py) against MPI's Allreduce, side by
side in one run, with the CPU's idle share beside each time.

    python -m mnopt.netsim run --nodes 8 --rate 250mbit -- \\
        .venv/numpy2/bin/python -m mpi4py benchmarks/ring_bench.py \\
        --rate-mbit 250 --json docs/results/netsim/ring_8.json

Cases, round-robin within each repetition (so drift hits all alike), each
time the slowest rank's:

- mnopt flat float32, ring / mpi: ``mean_grads`` of ResNet-50's 162
  gradients (102.2 MB) on a flat communicator made with
  MNOPT_ALLREDUCE=ring / =mpi (mpi: MPI's Allreduce per 1 MiB bucket, as
  mnopt did before the ring);
- raw ring: ``ring.allreduce_sum`` of one packed 102.2 MB float32 buffer;
- raw MPI Allreduce, 1 MiB chunks: the same buffer, one MPI_Allreduce per
  1 MiB (MPICH's best chunking here; whole-buffer calls are slower);

and, with ``--sizes``, one buffer of each size by ring and by MPI
Allreduce (the evidence for mnopt/transport/allreduce.py's auto rule).

CPU idle: the share of the machine's CPU time (/proc/stat, every core;
the simulated nodes share them) that was idle while the case ran.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

import numpy
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..'))
import mnopt  # NOQA
from mnopt.transport import ring, waiting  # NOQA
from mnopt.benchmark.workloads import grad_list, resnet50_grad_shapes  # NOQA


def cpu_times():
    """(idle, total) jiffies of all cores."""
    with open('/proc/stat') as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])


def flat(algorithm, shapes, rank):
    os.environ['MNOPT_ALLREDUCE'] = algorithm
    comm = mnopt.create_communicator('flat', allreduce_grad_dtype='float32')
    del os.environ['MNOPT_ALLREDUCE']
    assert comm.allreduce_algorithm == algorithm
    grads = grad_list(shapes, rank)
    return lambda: comm.mean_grads(grads)


def raw_ring(comm, n):
    buf = numpy.ones(n, numpy.float32)
    return lambda: ring.allreduce_sum(comm, buf, 'float32', check=False)


def raw_mpi(comm, n, chunk):
    buf = numpy.ones(n, numpy.float32)

    def run():
        for start in range(0, n, chunk):
            comm.Allreduce(MPI.IN_PLACE, buf[start:start + chunk])
    return run


def _proc_net(path, prefix):
    """One protocol's counters from /proc/net/snmp or /proc/net/netstat
    (a header line and a value line per protocol)."""
    with open(path) as f:
        header, values = [line.split() for line in f
                          if line.startswith(prefix)]
    return dict(zip(header[1:], (int(v) for v in values[1:])))


def tcp_and_scheduling():
    """This rank's counters: its network namespace's TCP segments sent
    and retransmitted so far, retransmission timeouts and tail loss probes
    (each simulated node is a namespace of its own: /proc/net is per
    namespace), and the process's voluntary and involuntary context
    switches (waits, and preemptions by another process wanting the
    core)."""
    tcp = _proc_net('/proc/net/snmp', 'Tcp:')
    ext = _proc_net('/proc/net/netstat', 'TcpExt:')
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return numpy.array([tcp['OutSegs'], tcp['RetransSegs'],
                        ext['TCPTimeouts'], ext['TCPLossProbes'],
                        usage.ru_nvcsw, usage.ru_nivcsw], numpy.int64)


COUNTERS = ('TCP segments sent', 'TCP segments retransmitted',
            'TCP retransmission timeouts', 'TCP tail loss probes',
            'voluntary context switches', 'involuntary context switches')


def run_cases(cases, world, reps, warmup, counters=None):
    """Per case: the slowest rank's times and rank 0's CPU idle shares;
    with ``counters`` (a function returning this rank's counters as an
    array, e.g. ``tcp_and_scheduling``) also a dict of every rank's time,
    shape (cases, reps, ranks), and its counters' growth over each case,
    shape (cases, reps, ranks, counters)."""
    times = numpy.zeros((len(cases), reps))
    idle = numpy.zeros((len(cases), reps))
    rank_times = numpy.zeros((len(cases), reps, world.size))
    grown = None
    for rep in range(warmup + reps):
        for i, (label, fn) in enumerate(cases):
            world.Barrier()
            c0 = counters() if counters else None
            i0, t0 = cpu_times()
            start = time.perf_counter()
            fn()
            dt = time.perf_counter() - start
            i1, t1 = cpu_times()
            if rep >= warmup:
                times[i, rep - warmup] = dt
                idle[i, rep - warmup] = (i1 - i0) / max(1, t1 - t0)
                rank_times[i, rep - warmup, world.rank] = dt
                if counters:
                    delta = counters() - c0
                    if grown is None:
                        grown = numpy.zeros((len(cases), reps, world.size,
                                             len(delta)), numpy.int64)
                    grown[i, rep - warmup, world.rank] = delta
        if world.rank == 0:
            sys.stderr.write('repetition %d/%d done\n' % (rep + 1,
                                                           warmup + reps))
    world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    if counters is None:
        return times, idle
    world.Allreduce(MPI.IN_PLACE, rank_times, op=MPI.SUM)
    world.Allreduce(MPI.IN_PLACE, grown, op=MPI.SUM)
    return times, idle, {'rank_times': rank_times, 'counters': grown}


def spread(values):
    return {'min': float(min(values)),
            'median': float(statistics.median(values)),
            'max': float(max(values))}


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--rate-mbit', type=float, required=True,
                   help='the link rate, for the ring bound')
    p.add_argument('--reps', type=int, default=3)
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--sizes', type=int, nargs='*', default=[],
                   help='also time one buffer of each of these byte sizes')
    p.add_argument('--size-reps', type=int, default=5)
    p.add_argument('--skip-resnet', action='store_true')
    p.add_argument('--segment-bytes', type=int, default=ring.SEGMENT_BYTES)
    p.add_argument('--window', type=int, default=ring.WINDOW)
    p.add_argument('--json')
    args = p.parse_args()
    ring.SEGMENT_BYTES, ring.WINDOW = args.segment_bytes, args.window
    world = MPI.COMM_WORLD
    n_ranks = world.size
    rate = args.rate_mbit * 1e6 / 8   # bytes/s each direction

    def bound(nbytes):
        return 2.0 * (n_ranks - 1) / n_ranks * nbytes / rate

    result = {'n_ranks': n_ranks, 'rate_mbit': args.rate_mbit,
              'host': MPI.Get_processor_name(), 'reps': args.reps,
              'warmup': args.warmup, 'segment_bytes': ring.SEGMENT_BYTES,
              'window': ring.WINDOW, 'max_nap_s': waiting.PROMPT.max_nap,
              'argv': sys.argv, 'cases': [], 'sizes': []}
    if not args.skip_resnet:
        shapes = resnet50_grad_shapes()
        total = sum(int(numpy.prod(s)) for s in shapes)
        raw = world.Dup()
        cases = [
            ('mnopt flat float32, ring', flat('ring', shapes, world.rank)),
            ('mnopt flat float32, mpi (1 MiB buckets)',
             flat('mpi', shapes, world.rank)),
            ('raw ring, one buffer', raw_ring(raw, total)),
            ('raw MPI Allreduce, 1 MiB chunks',
             raw_mpi(raw, total, (1 << 20) // 4)),
        ]
        times, idle = run_cases(cases, world, args.reps, args.warmup)
        nbytes = total * 4
        for (label, _), t, cpu in zip(cases, times, idle):
            result['cases'].append({
                'case': label, 'bytes': nbytes, 'times_s': t.tolist(),
                'time_s': spread(t), 'cpu_idle': spread(cpu),
                'cpu_idle_all': cpu.tolist(),
                'bound_s': bound(nbytes),
                'x_bound': float(numpy.median(t)) / bound(nbytes)})
    for nbytes in args.sizes:
        n = nbytes // 4
        cases = [('ring', raw_ring(world, n)),
                 ('mpi', raw_mpi(world, n, n))]
        times, idle = run_cases(cases, world, args.size_reps, 1)
        row = {'bytes': nbytes, 'bound_s': bound(nbytes)}
        for (label, _), t, cpu in zip(cases, times, idle):
            row[label] = {'times_s': t.tolist(), 'time_s': spread(t),
                          'cpu_idle': spread(cpu)}
        row['mpi_over_ring'] = (row['mpi']['time_s']['median']
                                / row['ring']['time_s']['median'])
        result['sizes'].append(row)
    if world.rank != 0:
        return
    print('# N=%d ranks, one per node, %g Mbit/s links; slowest rank, %d '
          'reps (+%d warm-up), round-robin' % (n_ranks, args.rate_mbit,
                                                args.reps, args.warmup))
    print('| case | min s | median s | max s | x ring bound | CPU idle % '
          '(median) |')
    print('|---|---|---|---|---|---|')
    for c in result['cases']:
        t = c['time_s']
        print('| %s | %.3f | %.3f | %.3f | %.2f | %.0f |' % (
            c['case'], t['min'], t['median'], t['max'], c['x_bound'],
            100 * c['cpu_idle']['median']))
    if result['cases']:
        print('| ring bound 2(N-1)/N*B/rate | | %.3f | | 1.00 | |'
              % result['cases'][0]['bound_s'])
    if result['sizes']:
        print('\n| bytes | ring median ms (min-max) | MPI Allreduce median ms '
              '(min-max) | MPI / ring | bound ms |')
        print('|---|---|---|---|---|')
        for r in result['sizes']:
            print('| %d | %.2f (%.2f-%.2f) | %.2f (%.2f-%.2f) | %.2f | %.2f |'
                  % ((r['bytes'],) + tuple(
                      1e3 * r[k]['time_s'][m] for k in ('ring',)
                      for m in ('median', 'min', 'max')) + tuple(
                      1e3 * r[k]['time_s'][m] for k in ('mpi',)
                      for m in ('median', 'min', 'max')) +
                     (r['mpi_over_ring'], 1e3 * r['bound_s'])))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(result, f, indent=1)


if __name__ == '__main__':
    main()
