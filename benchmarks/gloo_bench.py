"""mnopt's gradient averaging beside PyTorch's gloo backend, in the same
processes and the same run on the simulated cluster (issue 23).

Setup (once; .venv/ is git-ignored).  PyTorch's CPU wheel with mnopt and
MPICH beside it; torch does not pin NumPy and runs under NumPy 2:

    python3 -m venv .venv/gloo
    .venv/gloo/bin/pip install 'torch==2.13.0+cpu'   # the CPU build *
    PIP_CONSTRAINT=constraints/numpy2.txt \\
        .venv/gloo/bin/pip install -e '.[mpich]'

    * Where PyTorch's own wheel index is reachable, the same with
      ``pip install torch --index-url https://download.pytorch.org/whl/cpu``;
      PyPI's plain ``torch`` for Linux is the CUDA build, which pulls in
      gigabytes of NVIDIA libraries.

Smoke test (2 nodes, the first 10 MB of the gradients, about 30 s):

    .venv/gloo/bin/python -m mnopt.netsim run --nodes 2 --rate 100mbit -- \\
        .venv/gloo/bin/python -m mpi4py benchmarks/gloo_bench.py \\
        --rate-mbit 100 --max-mb 10 --reps 2

The full measurement (run it when nothing else uses the machine; 250
Mbit/s keeps the links, not the 2 cores, the limit; about 2-4 minutes a
node count; MNOPT_TIMEOUT ends a run that stalls, see below):

    for n in 4 8 16; do
      MNOPT_TIMEOUT=300 \\
      .venv/gloo/bin/python -m mnopt.netsim run --nodes $n --rate 250mbit \\
        -- .venv/gloo/bin/python -m mpi4py benchmarks/gloo_bench.py \\
        --rate-mbit 250 --reps 3 --json docs/results/netsim/gloo_${n}.json
    done
    .venv/gloo/bin/python benchmarks/ring_report.py \\
        docs/results/netsim/gloo_{4,8,16}.json > docs/results/netsim/gloo.md

(netsim is started with the gloo environment's Python so that its
mpiexec, MPICH's hydra from the 'mpich' wheel, matches the ranks' MPI.)

Cases, round-robin within each repetition, each time the slowest rank's
(ring_bench.run_cases: an MPI barrier before each case, the CPU's idle
share beside it), on ResNet-50's 162 gradients (102.2 MB of float32; with
``--max-mb``, the first gradients up to that size):

- mnopt flat float32: ``mean_grads`` on ``create_communicator('flat')``
  (MNOPT_ALLREDUCE as set, by default auto: the ring across nodes);
- mnopt flat float16 wire: the same with allreduce_grad_dtype='float16'
  (bound: half the float32 one);
- mnopt reduction_server colocated float32: ``mean_grads`` on
  ``create_communicator('reduction_server')`` in a job without server
  processes (every worker serves one shard; the ring's bound);
- raw MPI Allreduce, 1 MiB chunks of one packed buffer (no packing);
- gloo, DDP's buckets: what DistributedDataParallel does after its first
  iteration: the gradients in reverse order, cut into buckets as
  torch.distributed's ``_compute_bucket_assignment_by_size`` does (a first
  bucket of _DEFAULT_FIRST_BUCKET_BYTES = 1 MiB, then 25 MiB; a bucket
  closes with the gradient that fills it, so ResNet-50's 8.2 MB fc weight
  makes the first bucket 8.2 MB: 5 buckets), each gradient copied into its
  bucket divided by N (DDP's reducer divides while copying), each bucket's
  ``all_reduce(async_op=True)`` started as soon as it is full, all in
  flight, then waited, and copied back into the gradients;
- gloo, one bucket: the same with every gradient in one 102 MB bucket
  (one all_reduce);
- gloo fp16 hook: DDP with ``fp16_compress_hook``: each bucket copied in,
  cast to float16 and divided by N, all_reduce'd (async, all in flight),
  copied back into the float32 bucket and the gradients.

After the timed repetitions every case's gradients are compared with the
float64 mean of the starting gradients at every 97th element (the largest
difference over the largest mean: max_rel_err in the JSON).
Without torch the gloo cases are skipped with a one-line message.

Seen in the smoke tests (2 nodes, 100 Mbit/s, 1 run in about 6): the
ranks stalled in mnopt's ring (``flat#0.mean_grads``, the case after gloo's
fp16 one), each waiting on MPI sends/receives that never completed, and
rank 1's stall watchdog did not answer either: MPI traffic between the two
(MPICH over UCX's TCP transport, UCX_TLS=tcp) had stopped.  Not
reproduced in the next runs; whether gloo's sockets on the same link have
a part in it is open.
"""

import argparse
import json
import os
import socket
import sys
import time

import numpy
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                '..'))
import mnopt  # NOQA
from mnopt import netsim  # NOQA
from mnopt.transport import allreduce  # NOQA
from mnopt.benchmark.workloads import grad_list, resnet50_grad_shapes  # NOQA
from ring_bench import raw_mpi, run_cases, spread  # NOQA

FIRST_BUCKET_BYTES = 1 << 20   # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
BUCKET_BYTES = 25 << 20        # DDP's bucket_cap_mb=25
DDP_BUCKETS = [FIRST_BUCKET_BYTES, BUCKET_BYTES]   # Gloo.case's limits
CHECK_STRIDE = 97              # the results checked at every 97th element


def bucket_assignment(nbytes, limits):
    """Indices into ``nbytes`` (sizes in DDP's order) per bucket, as
    torch.distributed's _compute_bucket_assignment_by_size: a bucket closes
    with the tensor that brings it to its limit; the limits go in turn,
    the last one repeating."""
    buckets, current, size, k = [], [], 0, 0
    for i, n in enumerate(nbytes):
        current.append(i)
        size += n
        if size >= limits[k]:
            buckets.append(current)
            current, size, k = [], 0, min(k + 1, len(limits) - 1)
    if current:
        buckets.append(current)
    return buckets


def mnopt_case(grads, wire, name='flat'):
    """``comm.mean_grads(grads)`` on a new ``name`` communicator."""
    comm = mnopt.create_communicator(name, allreduce_grad_dtype=wire)
    return lambda: comm.mean_grads(grads), [g for _, g in grads]


class Gloo:
    """torch.distributed over gloo, rank and size from MPI's world."""

    def __init__(self, world, addr, iface):
        import torch
        import torch.distributed as dist
        self.torch, self.dist, self.n = torch, dist, world.size
        threads = os.environ.get('MNOPT_BLAS_THREADS')
        if threads:   # netsim's share of the cores for each rank
            torch.set_num_threads(int(threads))
        if iface:
            os.environ.setdefault('GLOO_SOCKET_IFNAME', iface)
        port = None
        if world.rank == 0:
            with socket.socket() as s:
                s.bind((addr, 0))
                port = s.getsockname()[1]
        port = world.bcast(port)
        dist.init_process_group('gloo', init_method='tcp://%s:%d'
                                % (addr, port), rank=world.rank,
                                world_size=world.size)

    def check_buckets(self, tensors, limits):
        """Our bucketing against torch's own, where it has it."""
        fn = getattr(self.dist, '_compute_bucket_assignment_by_size', None)
        if fn is None:
            return None
        ours = bucket_assignment([t.numel() * t.element_size()
                                  for t in tensors], limits)
        theirs = [list(b) for b in fn(tensors, limits,
                                      [False] * len(tensors))[0]]
        assert ours == theirs, (ours, theirs)
        return True

    def case(self, arrays, limits, wire='float32'):
        """DDP's reduction of the gradient ``arrays`` (in place) in
        buckets of ``limits`` (sys.maxsize: one bucket), wire float32 (the
        default hook) or float16 (fp16_compress_hook)."""
        torch, dist, n = self.torch, self.dist, self.n
        grads = [torch.from_numpy(a) for a in arrays][::-1]   # DDP's order
        self.check_buckets(grads, limits)
        buckets = []
        for idx in bucket_assignment(
                [g.numel() * g.element_size() for g in grads], limits):
            flat = torch.empty(sum(grads[i].numel() for i in idx))
            views, start = [], 0
            for i in idx:
                views.append((grads[i].view(-1),
                              flat[start:start + grads[i].numel()]))
                start += grads[i].numel()
            buckets.append((flat, views))
        inv = 1.0 / n
        half = wire == 'float16'

        def run():
            works = []
            for flat, views in buckets:
                for g, v in views:
                    if half:   # the hook sees the bucket undivided
                        v.copy_(g)
                    else:      # the reducer divides as it copies
                        torch.mul(g, inv, out=v)
                if half:
                    wire_buf = flat.to(torch.float16).div_(n)
                else:
                    wire_buf = flat
                works.append((dist.all_reduce(wire_buf, async_op=True),
                              flat, wire_buf, views))
            for work, flat, wire_buf, views in works:
                work.wait()
                if half:
                    flat.copy_(wire_buf)
                for g, v in views:
                    g.copy_(v)
        return run, arrays, [f.numel() * 4 for f, _ in buckets]


def gloo_here(world, addr=None, iface=None):
    """A Gloo group of ``world``'s ranks, rendezvous at ``addr`` over
    ``iface``: by default netsim's node 0 over eth0 inside a simulated
    cluster (``python -m mnopt.netsim``), else this host over lo."""
    inside = MPI.Get_processor_name().startswith(netsim.PREFIX)
    return Gloo(world,
                addr or (netsim.node_address(0) if inside else '127.0.0.1'),
                iface or ('eth0' if inside else 'lo'))


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--rate-mbit', type=float, required=True,
                   help='the link rate, for the ring bound')
    p.add_argument('--reps', type=int, default=3)
    p.add_argument('--warmup', type=int, default=1)
    p.add_argument('--max-mb', type=float,
                   help='only the first gradients, up to this many MB '
                   '(a quick run)')
    p.add_argument('--gloo-addr',
                   help='rank 0\'s address for torch.distributed '
                   '(default: netsim\'s node 0 inside netsim, else '
                   '127.0.0.1)')
    p.add_argument('--gloo-iface',
                   help='GLOO_SOCKET_IFNAME unless set (default: eth0 '
                   'inside netsim, else lo)')
    p.add_argument('--no-gloo', action='store_true')
    p.add_argument('--cases',
                   help='comma-separated: only the cases whose label '
                   'contains one of these (default: all)')
    p.add_argument('--shared-grads', action='store_true',
                   help='every case averages one working copy of the '
                   'gradients, checked afterwards in a pass of its own '
                   '(a copy per case does not fit 16 ranks in 24 GiB)')
    p.add_argument('--json')
    args = p.parse_args()
    world = MPI.COMM_WORLD
    n_ranks = world.size
    rate = args.rate_mbit * 1e6 / 8   # bytes/s each direction

    shapes = resnet50_grad_shapes()
    if args.max_mb:
        kept, total = [], 0
        for s in shapes:
            total += 4 * int(numpy.prod(s))
            if total > args.max_mb * 1e6:
                break
            kept.append(s)
        shapes = kept
    total = sum(int(numpy.prod(s)) for s in shapes)
    nbytes = 4 * total

    def bound(wire_bytes):
        return 2.0 * (n_ranks - 1) / n_ranks * wire_bytes / rate

    wanted = args.cases.split(',') if args.cases else None

    def chosen(label):
        return wanted is None or any(w in label for w in wanted)

    # (label, fn, wire, the gradients it averages in place or None)
    start = time.perf_counter()
    # This rank's gradients (standard normal): every case averages its own
    # copy of them in place (or, --shared-grads, all the same one).
    base = grad_list(shapes, world.rank)
    shared = ([(name, g.copy()) for name, g in base] if args.shared_grads
              else None)

    def working_copy():
        return shared or [(name, g.copy()) for name, g in base]

    cases = []
    for label, wire, comm_name in (
            ('mnopt flat float32', 'float32', 'flat'),
            ('mnopt flat, float16 wire', 'float16', 'flat'),
            # Without server processes in the job every worker serves one
            # shard (colocated): the ring's bytes on each link, its bound.
            ('mnopt reduction_server colocated float32', 'float32',
             'reduction_server')):
        if chosen(label):
            fn, grads = mnopt_case(working_copy(), wire, comm_name)
            cases.append((label, fn, wire, grads))
    label = 'raw MPI Allreduce, 1 MiB chunks'
    if chosen(label):
        cases.append((label, raw_mpi(world.Dup(), total, (1 << 20) // 4),
                      'float32', None))
    bucket_bytes = {}
    gloo_note = None
    if args.no_gloo:
        gloo_note = 'gloo cases skipped (--no-gloo)'
    else:
        # Quiet c10d's warning that a netsim node cannot name its peer
        # (no reverse DNS between the namespaces); errors still show.
        os.environ.setdefault('TORCH_CPP_LOG_LEVEL', 'ERROR')
        try:
            import torch  # NOQA
        except ImportError as e:
            gloo_note = 'gloo cases skipped: no torch (%s)' % e
    if gloo_note is None:
        gloo = gloo_here(world, args.gloo_addr, args.gloo_iface)
        for label, limits, wire in (
                ("gloo, DDP's buckets", DDP_BUCKETS, 'float32'),
                ('gloo, one bucket', [sys.maxsize], 'float32'),
                ("gloo fp16 hook, DDP's buckets", DDP_BUCKETS, 'float16')):
            if not chosen(label):
                continue
            fn, grads, sizes = gloo.case([g for _, g in working_copy()],
                                         limits, wire)
            bucket_bytes[label] = sizes
            cases.append((label, fn, wire, grads))
    if gloo_note and world.rank == 0:
        print(gloo_note)

    # What each case should end with: the float64 mean of every rank's
    # starting gradients, at every CHECK_STRIDE-th element (a small
    # allreduce; the whole would cost more than a case).
    sample = numpy.concatenate([g.ravel() for _, g in base])[::CHECK_STRIDE]
    expected = sample.astype(numpy.float64)
    world.Allreduce(MPI.IN_PLACE, expected)
    expected /= n_ranks
    del sample
    if shared is None:
        del base
    if world.rank == 0:
        sys.stderr.write('set up in %.1f s\n' % (time.perf_counter() - start))

    times, idle = run_cases([(c[0], c[1]) for c in cases], world,
                            args.reps, args.warmup)
    results = {}   # label -> the gradients as the case left them
    for label, fn, wire, grads in cases:
        if grads is None:
            continue
        if shared is not None:   # once more, from the starting gradients
            for (_, g), (_, b) in zip(shared, base):
                numpy.copyto(g, b)
            world.Barrier()
            fn()
        # A copy: the strided view would keep the whole 102 MB alive.
        results[label] = numpy.concatenate([g.ravel() for g in grads])[
            ::CHECK_STRIDE].copy()
    result = {'bench': 'gloo', 'n_ranks': n_ranks,
              'rate_mbit': args.rate_mbit,
              'host': MPI.Get_processor_name(), 'reps': args.reps,
              'warmup': args.warmup, 'bytes': nbytes,
              'shared_grads': args.shared_grads,
              'n_grads': len(shapes), 'argv': sys.argv,
              'mnopt_allreduce': os.environ.get('MNOPT_ALLREDUCE', 'auto'),
              'mnopt_float32_by': 'ring' if allreduce.uses_ring(
                  world, 'float32', nbytes) else 'MPI Allreduce',
              'gloo_note': gloo_note, 'cases': [], 'sizes': []}
    if gloo_note is None:
        import torch
        result['torch'] = torch.__version__
    result['numpy'] = numpy.__version__
    ddp_median = None
    for (label, fn, wire, grads), t, cpu in zip(cases, times, idle):
        err = None
        if grads is not None:
            err = float(numpy.max(numpy.abs(results[label] - expected))
                        / numpy.max(numpy.abs(expected)))
            err = world.allreduce(err, op=MPI.MAX)
        b = bound(nbytes / 2 if wire == 'float16' else nbytes)
        row = {'case': label, 'wire': wire, 'bytes': nbytes,
               'times_s': t.tolist(), 'time_s': spread(t),
               'cpu_idle': spread(cpu), 'cpu_idle_all': cpu.tolist(),
               'bound_s': b, 'x_bound': float(numpy.median(t)) / b,
               'max_rel_err': err}
        if label in bucket_bytes:
            row['bucket_bytes'] = bucket_bytes[label]
        if label == "gloo, DDP's buckets":
            ddp_median = float(numpy.median(t))
        result['cases'].append(row)
    for row in result['cases']:
        row['x_gloo_ddp'] = (row['time_s']['median'] / ddp_median
                             if ddp_median else None)
    if gloo_note is None:
        gloo.dist.destroy_process_group()
    if world.rank != 0:
        return
    print('# N=%d ranks, one per node, %g Mbit/s links; %d gradients, '
          '%.1f MB; slowest rank, %d reps (+%d warm-up), round-robin'
          % (n_ranks, args.rate_mbit, len(shapes), nbytes / 1e6, args.reps,
             args.warmup))
    print('| case | min s | median s | max s | bound s | x bound | '
          'x gloo DDP | CPU idle % (median) | max rel. error |')
    print('|---|---|---|---|---|---|---|---|---|')
    for c in result['cases']:
        t = c['time_s']
        print('| %s | %.3f | %.3f | %.3f | %.3f | %.2f | %s | %.0f | %s |' % (
            c['case'], t['min'], t['median'], t['max'], c['bound_s'],
            c['x_bound'], '%.2f' % c['x_gloo_ddp'] if c['x_gloo_ddp']
            else '', 100 * c['cpu_idle']['median'],
            '%.1e' % c['max_rel_err'] if c['max_rel_err'] is not None
            else ''))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(result, f, indent=1)


if __name__ == '__main__':
    main()
