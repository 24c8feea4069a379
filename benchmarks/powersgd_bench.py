"""PowerSGD training steps, mnopt beside PyTorch DDP on gloo, in the same
processes and the same run on the simulated cluster: is low-rank
compression faster where the link is slow, and never slower (with
``compression='auto'``) where it is fast?

Setup (once; .venv/ is git-ignored): as benchmarks/gloo_bench.py, plus
Chainer (this benchmark trains through Chainer's optimizer), all beside
PyTorch's CPU wheel under NumPy 2:

    python3.11 -m venv .venv/gloo
    .venv/gloo/bin/pip install \\
        /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
    PIP_CONSTRAINT=constraints/numpy2.txt \\
        .venv/gloo/bin/pip install -e '.[mpich]' chainer==7.8.1

(the wheel file is the local copy of ``torch==2.13.0+cpu``; Chainer's
build needs constraints/numpy2.txt's ``setuptools<70``, and pip then says
torch wants a newer setuptools: torch needs it only to build extensions.)

Smoke test (2 nodes, the first 10 MB of the gradients, about a minute):

    .venv/gloo/bin/python -m mnopt.netsim run --nodes 2 --rate 100mbit -- \\
        .venv/gloo/bin/python -m mpi4py benchmarks/powersgd_bench.py \\
        --rate-mbit 100 --max-mb 10 --reps 2

The full grid (run it alone on the machine; about 40 minutes on 2 cores,
most of it the uncompressed cases at 100 Mbit/s; 4 nodes take 2, 2 and
9 minutes at 10, 1 and 0.1 Gbit/s).  Every case at once needs 3.3 GB per
rank (each holds its own optimizer state and buffers), so 8 ranks do not
fit in 24 GiB: at 8 nodes the mnopt cases run in one job (1.4 GB per
rank) and torch's beside mnopt float32 and PowerSGD in another (1.8 GB):

    for r in 10gbit:10000 1gbit:1000 100mbit:100; do
      run="--timeout 1500 -- .venv/gloo/bin/python -m mpi4py \\
        benchmarks/powersgd_bench.py --rate-mbit ${r#*:} --reps 3"
      out=docs/results/netsim
      cases="mnopt flat float32,mnopt powersgd r4,"
      cases+="torch DDP float32,buckets serialized"
      .venv/gloo/bin/python -m mnopt.netsim run --nodes 4 --rate ${r%:*} \\
        $run --json $out/powersgd_4_${r%:*}.json
      .venv/gloo/bin/python -m mnopt.netsim run --nodes 8 --rate ${r%:*} \\
        $run --no-torch --no-local --no-rank1 --json $out/powersgd_8_${r%:*}.json
      .venv/gloo/bin/python -m mnopt.netsim run --nodes 8 --rate ${r%:*} \\
        $run --no-local --json $out/powersgd_8_${r%:*}_torch.json "--cases=$cases"
    done
    .venv/gloo/bin/python benchmarks/powersgd_report.py \\
        docs/results/netsim/powersgd_[48]_*.json

(docs/results/netsim/powersgd.md: the tables with the text around them.)

Each case is one training step as a user writes it, timed whole (forward,
backward, averaging, update; the slowest rank's time, ring_bench.run_cases:
an MPI barrier before each case, round-robin within each repetition, so
drift hits every case alike).  The model is ResNet-50's 162 parameter
shapes (102.2 MB of float32) with a loss whose gradients are dense and
cheap: loss = sum over parameters of (parameter * C).sum(), C a fixed
standard normal array per parameter and rank, so each rank's gradient is
its own C and the ranks' mean is not any one rank's.  (Random matrices
are full-rank: PowerSGD's approximation is poor on them, its cost is not:
this benchmark times, the convergence study judges accuracy.)

- mnopt: a Chainer Link with those parameters,
  ``mnopt.create_multi_node_optimizer(MomentumSGD(lr, 0.9), comm)``,
  ``optimizer.update(model)``, comm one of: ``flat`` float32; ``flat``
  with a float16 wire; ``flat`` with ``compression='powersgd'`` at rank 4
  and rank 1; ``flat`` with ``compression='auto'`` at rank 4 (PowerSGD
  only where the guard's timed trials found it quicker), with the float32
  wire and with the float16 one (its plain way is then float16);
- PyTorch: a Module with the same parameter shapes in
  ``DistributedDataParallel`` on gloo, ``torch.optim.SGD(lr,
  momentum=0.9)``: plain (float32 allreduce of DDP's own 25 MiB buckets
  during backward), and with ``powerSGD_hook`` at
  matrix_approximation_rank 4 in one bucket (``bucket_cap_mb`` above the
  model) or in DDP's buckets with each bucket's hook started after the
  previous one's end (``serialized``).  As it comes, on DDP's buckets,
  the hook fails within a few steps on gloo (``--stock-hook`` runs it
  anyway): it starts a bucket's second and third all_reduce from future
  callbacks, on another thread than the next bucket's first, so the
  ranks can start them in different orders.
- the step's own compute, for scale: the Chainer step with MomentumSGD
  alone and the torch step with SGD alone (no averaging, no DDP).

Warm-up, untimed, each case as many steps as it needs for its steady
state: mnopt's first update broadcasts rank 0's parameters instead of
averaging; ``warmup_steps=1`` averaging is plain; 'auto' then times its
gradient set plain, compressed, plain, compressed (4 averagings) before
it chooses; DDP rebuilds its buckets after its first iteration; the hook
averages plain for ``start_powerSGD_iter`` = 2 iterations (torch requires
more than 1 with error feedback).  Then one more step each, and
``--warmup`` round-robin repetitions.  The script checks that every
PowerSGD case is compressing and that 'auto' has chosen before it times.

Bytes per step and rank, three ways:

- mnopt's own count: ``comm.communication_stats()['bytes_sent']`` (the
  payload this rank sent, by its algorithm: 2(N-1)/N of each ring's
  buffer), read after each timed step;
- analytic, for both: the elements each rank puts into the allreductions
  (``powersgd.wire_elements``: P and Q of every compressed matrix, the
  other arrays whole; torch's hook compresses by the same rule, bucket by
  bucket) times the wire dtype's size times the ring's 2(N-1)/N;
- measured: the growth of eth0's tx_bytes (/proc/net/dev: each simulated
  node is a network namespace of its own, one rank per node) over the
  step: Ethernet, IP and TCP headers and ACKs included, also the barrier's
  few bytes.

CPU: 8 ranks on 2 cores are CPU-bound at 1 and 10 Gbit/s (the times
there are mostly compute and copies, not the link); CPU idle % beside each
time says which.  Keep --reps modest: a 100 Mbit/s repetition at 8 nodes
is about 40 s.
"""

import argparse
import datetime
import hashlib
import json
import os
import resource
import sys
import time

import numpy
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                '..'))
import mnopt  # NOQA
from mnopt.codecs import powersgd  # NOQA
from mnopt.benchmark.workloads import grad_list, resnet50_grad_shapes  # NOQA
from gloo_bench import gloo_here  # NOQA
from ring_bench import run_cases, spread  # NOQA

LR = 1e-4              # small: the parameters drift, nothing diverges
MOMENTUM = 0.9
PLAIN_STEPS_FIRST = 1     # averagings plain before PowerSGD starts
TORCH_START_ITER = 2       # torch's least with error feedback
RANK = 4


def ring_factor(n):
    """Bytes each rank sends per byte of an allreduce's payload (ring)."""
    return 2.0 * (n - 1) / n if n > 1 else 0.0


def cut_shapes(shapes, max_mb):
    """The first shapes, up to ``max_mb`` MB of float32 (a quick run)."""
    if not max_mb:
        return shapes
    kept, total = [], 0
    for s in shapes:
        total += 4 * int(numpy.prod(s))
        if total > max_mb * 1e6:
            break
        kept.append(s)
    return kept


def net_counters(iface='eth0'):
    """This namespace's [tx_bytes, rx_bytes] of ``iface`` (zeros where
    there is none: outside netsim)."""
    with open('/proc/net/dev') as f:
        for line in f:
            name, _, rest = line.partition(':')
            if name.strip() == iface:
                fields = rest.split()
                return numpy.array([int(fields[8]), int(fields[0])],
                                   numpy.int64)
    return numpy.zeros(2, numpy.int64)


# -- mnopt: the user's path ---------------------------------------------------

def chainer_model(weights, consts):
    """A Chainer Link whose parameters hold the arrays ``weights`` (not
    copies) and whose loss is sum((p * C).sum()): p's gradient is C."""
    import chainer
    import chainer.functions as F

    class Params(chainer.Link):
        def __init__(self):
            super(Params, self).__init__()
            with self.init_scope():
                for i, w in enumerate(weights):
                    setattr(self, 'p%03d' % i, chainer.Parameter(w))

        def forward(self):
            loss = 0
            for i, c in enumerate(consts):
                loss += F.sum(getattr(self, 'p%03d' % i) * c)
            return loss

    return Params()


def torch_model(weights, consts):
    """``chainer_model``'s twin in PyTorch: a Module whose parameters
    share the arrays ``weights`` and whose loss is sum((p * C).sum())."""
    import torch

    class Params(torch.nn.Module):
        def __init__(self):
            super(Params, self).__init__()
            self.ps = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.from_numpy(w)) for w in weights])
            # Not buffers: DDP would broadcast them every forward.
            self.consts = [torch.from_numpy(c) for c in consts]

        def forward(self):
            return sum((p * c).sum() for p, c in zip(self.ps, self.consts))

    return Params()


class MnoptCase(object):
    """One mnopt training setup: model, communicator, multi-node
    optimizer; ``step()`` is one update, and keeps what the communicator
    said it sent."""

    def __init__(self, label, weights, consts, **comm_args):
        import chainer
        self.label, self.comm_args = label, comm_args
        self.comm = mnopt.create_communicator('flat', **comm_args)
        self.model = chainer_model(weights, consts)
        self.optimizer = mnopt.create_multi_node_optimizer(
            chainer.optimizers.MomentumSGD(lr=LR, momentum=MOMENTUM),
            self.comm)
        self.optimizer.setup(self.model)
        self.sent = []

    def step(self):
        self.optimizer.update(self.model)
        # The next update clears them anyway; cleared now, seven other
        # cases' gradients are not held while one case runs.
        self.model.cleargrads()
        stats = self.comm.communication_stats()
        # (bytes sent, seconds blocked on averaging, seconds in the wire)
        self.sent.append((stats['bytes_sent'], stats['exposed'],
                          stats['wire']))

    def warmup_steps(self):
        """Updates until the steady state: the first broadcasts, then
        warmup_steps plain averagings, then 'auto''s 4 trial averagings
        (mnopt/averaging/compression_guard.py: ROUNDS of each way)."""
        compression = self.comm_args.get('compression')
        n = 1 + self.comm_args.get('warmup_steps', 0)
        if compression == 'auto':
            from mnopt.averaging.compression_guard import ROUNDS
            n += 2 * ROUNDS
        return n + 1   # and one in the steady state

    def state(self):
        """What the compression is doing now (for the JSON, and the check
        that timing starts in the steady state).  Reads the communicator's
        PowerSGD state directly: it has no public accessor for it, and a
        benchmark that times the wrong phase is worse than one that
        reaches in."""
        low_rank = self.comm.averaging.low_rank
        if low_rank is None:
            return None
        out = {'compressing': [s.compressing and s.iteration > 0
                               for s in low_rank.states.values()]}
        if low_rank.guard is not None:
            out['auto_choices'] = sorted(
                '%s: %s' % (label, way) for (label, _), way in
                low_rank.guard.choices.items())
            out['auto_trials_open'] = len(getattr(low_rank.guard, 'trials',
                                                  {}))
        return out


class ChainerLocal(MnoptCase):
    """The same Chainer step with no averaging: MomentumSGD alone (what a
    step costs before any communication)."""

    def __init__(self, label, weights, consts):
        import chainer
        self.label, self.comm_args, self.comm = label, {}, None
        self.model = chainer_model(weights, consts)
        self.optimizer = chainer.optimizers.MomentumSGD(lr=LR,
                                                        momentum=MOMENTUM)
        self.optimizer.setup(self.model)
        self.sent = []

    def step(self):
        self.optimizer.update(self.model)
        self.model.cleargrads()

    def warmup_steps(self):
        return 2

    def state(self):
        return None


# -- PyTorch DDP on gloo ------------------------------------------------------

class TorchCase(object):
    """DDP on gloo with parameters ``weights`` (shared, not copied), the
    same loss; with ``hook``, torch's powerSGD_hook at ``rank``."""

    def __init__(self, label, weights, consts, hook=False, rank=RANK,
                 one_bucket=False, serialize=False, local=False):
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        self.label, self.hook = label, hook
        # init_sync=False: the parameters start alike (zeros) everywhere,
        # and DDP's broadcast of 102 MB at start-up would cost a minute at
        # 100 Mbit/s and 8 nodes.
        # One bucket: ``bucket_cap_mb`` above the model's size (then the
        # first bucket is no smaller either: DDP's _BucketCapacityConfig).
        # local: no DDP, no averaging (the step's own compute).
        self.model = torch_model(weights, consts) if local else DDP(
            torch_model(weights, consts), init_sync=False,
            bucket_cap_mb=1 << 20 if one_bucket else None)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR,
                                         momentum=MOMENTUM)
        self.state = None
        if hook:
            from torch.distributed.algorithms.ddp_comm_hooks import \
                powerSGD_hook as psgd
            self.state = psgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=rank,
                start_powerSGD_iter=TORCH_START_ITER)
            hook_fn = psgd.powerSGD_hook
            if serialize:
                hook_fn = serialized(hook_fn)
            self.model.register_comm_hook(self.state, hook_fn)
        self.dist = dist

    def step(self):
        self.model().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()   # as cleargrads in MnoptCase.step

    def warmup_steps(self):
        return (TORCH_START_ITER if self.hook else 1) + 1

    def describe(self):
        if self.state is None:
            return None
        state = self.state
        return {'compressing': state.iter >= state.start_powerSGD_iter,
                'iter': state.iter}


def serialized(hook):
    """``hook`` with each bucket's collectives started only once the
    previous bucket's are done (the wait is on DDP's autograd thread).

    powerSGD_hook starts a bucket's second and third all_reduce from its
    futures' callbacks, on another thread than the one starting the next
    bucket's first: the ranks can start them in different orders, and
    gloo then matches one rank's P with another's Q ("Received data size
    doesn't match expected size", seen here at 2 ranks on one host).  A
    bucket waiting for the previous one keeps the order alike."""
    last = {}

    def run(state, bucket):
        previous = last.pop('fut', None)
        if previous is not None:
            previous.wait()
        fut = hook(state, bucket)
        last['fut'] = fut
        return fut
    return run


# -- bytes --------------------------------------------------------------------

def analytic(shapes, n_ranks, rank=None, itemsize=4):
    """Payload elements per rank per step and the bytes each rank sends
    by a ring: the whole gradients (``rank`` None) or PowerSGD's P, Q and
    uncompressed arrays at ``rank``."""
    if rank is None:
        elements = sum(int(numpy.prod(s)) for s in shapes)
    else:
        elements = powersgd.wire_elements(powersgd.plan(shapes, rank))
    payload = elements * itemsize
    return {'payload_bytes': payload,
            'sent_bytes': payload * ring_factor(n_ranks)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--rate-mbit', type=float, required=True,
                   help='the link rate (for the JSON and the table)')
    p.add_argument('--reps', type=int, default=3)
    p.add_argument('--warmup', type=int, default=1,
                   help='round-robin repetitions, untimed, after every '
                   'case reached its steady state')
    p.add_argument('--max-mb', type=float,
                   help='only the first parameters, up to this many MB '
                   '(a quick run)')
    p.add_argument('--no-rank1', action='store_true',
                   help='skip mnopt PowerSGD at rank 1')
    p.add_argument('--no-torch', action='store_true')
    p.add_argument('--no-local', action='store_true',
                   help='skip the steps without averaging (Chainer alone, '
                   'torch alone)')
    p.add_argument('--stock-hook', action='store_true',
                   help="also powerSGD_hook as it comes, on DDP's own "
                   'buckets (on gloo the ranks can start its collectives '
                   'in different orders: see serialized)')
    p.add_argument('--cases',
                   help='comma-separated: only the cases whose label '
                   'contains one of these (default: all)')
    p.add_argument('--json')
    args = p.parse_args()
    world = MPI.COMM_WORLD
    n = world.size
    started = time.perf_counter()
    shapes = cut_shapes(resnet50_grad_shapes(), args.max_mb)
    total = sum(int(numpy.prod(s)) for s in shapes)
    # This rank's constants: each parameter's gradient, every step.
    consts = [c for _, c in grad_list(shapes, world.rank)]
    # One set of weights for every case's model (zeros: alike on every
    # rank), each case updating it in turn: the gradients do not depend
    # on the weights, and 8 copies of 102 MB per rank do not fit 8 ranks
    # in 24 GiB.  Each case keeps its own optimizer state and buffers.
    weights = [numpy.zeros(s, numpy.float32) for s in shapes]
    wanted = args.cases.split(',') if args.cases else None

    def chosen(label):
        return wanted is None or any(w in label for w in wanted)

    cases = []
    ps = dict(compression='powersgd', warmup_steps=PLAIN_STEPS_FIRST)
    for label, comm_args in (
            ('mnopt flat float32', {}),
            ('mnopt flat float16 wire',
             {'allreduce_grad_dtype': 'float16'}),
            ('mnopt powersgd r4', dict(ps, powersgd_rank=RANK)),
            ('mnopt powersgd r1', dict(ps, powersgd_rank=1)),
            ('mnopt auto r4', dict(ps, compression='auto',
                                   powersgd_rank=RANK)),
            # 'auto' against the float16 wire: its plain way is float16.
            ('mnopt auto r4, float16 wire', dict(
                ps, compression='auto', powersgd_rank=RANK,
                allreduce_grad_dtype='float16'))):
        if label.endswith('r1') and args.no_rank1:
            continue
        if chosen(label):
            cases.append(MnoptCase(label, weights, consts, **comm_args))
    if chosen('chainer step, no averaging') and not args.no_local:
        cases.append(ChainerLocal('chainer step, no averaging', weights,
                                  consts))
    torch_note = None
    if args.no_torch:
        torch_note = 'torch cases skipped (--no-torch)'
    else:
        # Quiet c10d's warning that a netsim node cannot name its peer.
        os.environ.setdefault('TORCH_CPP_LOG_LEVEL', 'ERROR')
        try:
            import torch
        except ImportError as e:
            torch_note = 'torch cases skipped: no torch (%s)' % e
    gloo = None
    if torch_note is None:
        gloo = gloo_here(world)   # also torch's threads: netsim's share
        for label, options in (
                ('torch DDP float32', {}),
                ('torch DDP powerSGD_hook r4, one bucket',
                 {'hook': True, 'one_bucket': True}),
                ('torch DDP powerSGD_hook r4, buckets serialized',
                 {'hook': True, 'serialize': True}),
                ("torch DDP powerSGD_hook r4, DDP's buckets",
                 {'hook': True}),
                ('torch step, no averaging', {'local': True})):
            if label.endswith("DDP's buckets") and not args.stock_hook:
                continue
            if label.endswith('no averaging') and args.no_local:
                continue
            if chosen(label):
                cases.append(TorchCase(label, weights, consts, **options))
    if torch_note and world.rank == 0:
        print(torch_note)

    # Warm-up to the steady state, untimed, round-robin.
    need = [c.warmup_steps() for c in cases]
    for k in range(max(need)):
        for case, steps in zip(cases, need):
            if k < steps:
                world.Barrier()
                case.step()
    for case in cases:
        case.sent = []
    states = {}
    for case in cases:
        st = case.state() if isinstance(case, MnoptCase) else \
            case.describe()
        states[case.label] = st
        problem = None
        if st is not None and not all(numpy.atleast_1d(st['compressing'])):
            problem = 'not compressing yet'
        if st is not None and st.get('auto_trials_open'):
            problem = "'auto' still timing its trials"
        if problem:
            raise RuntimeError('%s: %s after warm-up: %r'
                               % (case.label, problem, st))
    if world.rank == 0:
        sys.stderr.write('set up and warmed up in %.1f s\n'
                         % (time.perf_counter() - started))

    times, idle, extra = run_cases([(c.label, c.step) for c in cases],
                                   world, args.reps, args.warmup,
                                   counters=net_counters)
    # Every rank's mnopt byte counts (the timed steps' only: the last reps).
    sent = {}
    for case in cases:
        if isinstance(case, MnoptCase) and case.comm is not None:
            mine = numpy.array(case.sent[-args.reps:], numpy.float64)
            sent[case.label] = numpy.array(world.allgather(mine.tolist()))
    # Every rank must apply the same mean: the shared weights set to zero,
    # one more step of a case, their digest compared across the ranks
    # (a rank whose means or momentum differ ends with other weights).
    # The cases without averaging differ by design: not checked.
    agree = {}
    for case in cases:
        if case.label.endswith('no averaging'):
            agree[case.label] = None
            continue
        for w in weights:
            w[...] = 0
        case.step()
        h = hashlib.sha1()
        for a in weights:
            h.update(a.tobytes())
        digests = world.allgather(h.hexdigest())
        agree[case.label] = len(set(digests)) == 1
    # Peak resident memory of the ranks (every case's model, optimizer
    # and buffers live at once: what limits the ranks on one machine).
    peak_rss = world.gather(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if gloo is not None:
        gloo.dist.destroy_process_group()
    if world.rank != 0:
        return

    result = {'bench': 'powersgd', 'n_ranks': n,
              'rate_mbit': args.rate_mbit,
              'date': datetime.date.today().isoformat(),
              'host': MPI.Get_processor_name(), 'reps': args.reps,
              'warmup': args.warmup, 'bytes': 4 * total,
              'n_params': len(shapes), 'argv': sys.argv,
              'max_mb': args.max_mb, 'lr': LR, 'momentum': MOMENTUM,
              'mnopt_warmup_steps': PLAIN_STEPS_FIRST,
              'torch_start_powerSGD_iter': TORCH_START_ITER,
              'torch_note': torch_note, 'numpy': numpy.__version__,
              'peak_rss_bytes': peak_rss,
              'blas_threads': os.environ.get('MNOPT_BLAS_THREADS'),
              'analytic': {
                  'float32': analytic(shapes, n),
                  'float16': analytic(shapes, n, itemsize=2),
                  'powersgd_r4': analytic(shapes, n, RANK),
                  'powersgd_r1': analytic(shapes, n, 1),
                  'powersgd_r4_float16': analytic(shapes, n, RANK, 2),
                  'compression_rate_r4': powersgd.compression_rate(
                      powersgd.plan(shapes, RANK)),
                  'compression_rate_r1': powersgd.compression_rate(
                      powersgd.plan(shapes, 1)),
                  'resnet50_compression_rate_r4': powersgd.compression_rate(
                      powersgd.plan(resnet50_grad_shapes(), RANK))},
              'cases': []}
    if torch_note is None:
        result['torch'] = torch.__version__
    wire_of = {'mnopt flat float32': 'float32',
               'mnopt flat float16 wire': 'float16',
               'mnopt powersgd r4': 'powersgd_r4',
               'mnopt powersgd r1': 'powersgd_r1',
               'mnopt auto r4': 'powersgd_r4',
               'mnopt auto r4, float16 wire': 'powersgd_r4_float16',
               'torch DDP float32': 'float32',
               'torch DDP powerSGD_hook r4, one bucket': 'powersgd_r4',
               'torch DDP powerSGD_hook r4, buckets serialized':
               'powersgd_r4',
               "torch DDP powerSGD_hook r4, DDP's buckets": 'powersgd_r4',
               'chainer step, no averaging': None,
               'torch step, no averaging': None}
    base = None
    for case, t, cpu, rank_t, grown in zip(
            cases, times, idle, extra['rank_times'], extra['counters']):
        # grown: (reps, ranks, [tx, rx]) bytes of eth0 over each step.
        tx = grown[:, :, 0].astype(numpy.float64)
        row = {'case': case.label, 'times_s': t.tolist(),
               'time_s': spread(t), 'cpu_idle': spread(cpu),
               'rank_times_s': rank_t.tolist(),
               'eth0_tx_bytes_per_rank': float(numpy.median(tx.mean(1))),
               'eth0_tx_bytes_max_rank': float(numpy.median(tx.max(1))),
               'analytic_sent_bytes': result['analytic'][
                   wire_of[case.label]]['sent_bytes']
               if wire_of[case.label] else 0.0,
               'state': states[case.label],
               'replicas_agree': agree[case.label]}
        if case.label in sent:
            # (ranks, reps, [bytes, exposed s, wire s])
            per_rank = sent[case.label]
            row['mnopt_bytes_sent_per_rank'] = float(
                numpy.median(per_rank[:, :, 0].mean(0)))
            # The communicator's own split of its averaging (mean over
            # the ranks, median over the reps): all of it, and the part
            # inside collectives; the rest is packing, PowerSGD's
            # arithmetic, unpacking.
            row['mnopt_averaging_s'] = float(
                numpy.median(per_rank[:, :, 1].mean(0)))
            row['mnopt_wire_s'] = float(
                numpy.median(per_rank[:, :, 2].mean(0)))
        if case.label == 'mnopt flat float32':
            base = float(numpy.median(t))
        result['cases'].append(row)
    for row in result['cases']:
        row['x_flat_float32'] = (row['time_s']['median'] / base
                                 if base else None)
    print(format_table(result))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(result, f, indent=1)


def format_table(result):
    """One run's Markdown table."""
    lines = ['# N=%d ranks, one per node, %g Mbit/s links; %d parameters, '
             '%.1f MB; slowest rank, %d reps (+%d warm-up), round-robin'
             % (result['n_ranks'], result['rate_mbit'], result['n_params'],
                result['bytes'] / 1e6, result['reps'], result['warmup']),
             '| case | min s | median s | max s | x flat float32 | '
             'MB sent/rank (mnopt) | MB sent/rank (analytic) | '
             'MB eth0 tx/rank | CPU idle % |',
             '|---|---|---|---|---|---|---|---|---|']
    for c in result['cases']:
        t = c['time_s']
        mine = c.get('mnopt_bytes_sent_per_rank')
        lines.append('| %s | %.3f | %.3f | %.3f | %s | %s | %.2f | %.2f | '
                     '%.0f |' % (
                         c['case'], t['min'], t['median'], t['max'],
                         '%.2f' % c['x_flat_float32']
                         if c['x_flat_float32'] else '',
                         '' if mine is None else '%.2f' % (mine / 1e6),
                         c['analytic_sent_bytes'] / 1e6,
                         c['eth0_tx_bytes_per_rank'] / 1e6,
                         100 * c['cpu_idle']['median']))
    return '\n'.join(lines)


if __name__ == '__main__':
    main()
