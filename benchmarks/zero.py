"""Sharded optimizer state (shard_state=True) vs the unsharded multi-node
optimizer, side by side in one run: the optimizer's state bytes per rank
(Adam by default: --optimizer) and the time of one update (averaging,
update rules, and for the sharded one the parameter all-gather), and how
far the two modes' parameters end apart.

    mpiexec -n 2 python -m mpi4py benchmarks/zero.py --json out.json

Each of ``--runs`` rounds times ``--steps`` updates of each mode (the
order alternating round by round) after two warm-up updates (the
broadcast, then the one that allocates the state); a round's
figure is its median update.  The gradients are fixed (set before each
update, no backward), so the modes average, update and gather the same
bytes.  Rank 0 prints min/median/max over the rounds.

``--memory`` measures memory instead of time, one mode after the other in
the same run, each with a communicator of its own (freed before the next
mode starts):

    MNOPT_ALLREDUCE=ring mpiexec -n 2 python -m mpi4py benchmarks/zero.py \
        --model resnet50 --memory --json out.json

per rank: the optimizer state's bytes; the NumPy bytes the mode holds
between updates (tracemalloc: parameters, the gradients left, state,
communicator buffers); the peak during one update (a fresh gradient per
parameter, as a backward allocates, then the update), both counted from
before the model was made; and the bytes this rank sent on mnopt's ring
in that update (``ring.bytes_sent``: with MNOPT_ALLREDUCE=ring the
unsharded ``flat`` averaging runs on the ring too; MPI's own collectives
are not counted).

``--backward`` (the MLP only: ResNet-50's arrays have no forward) makes
each step a real one, ``update(lossfun)``: forward, backward and update
of a batch of ``--batch`` rows, so the peak is a training step's.  Mode
``stage2`` (``shard_state=True, overlap=True``: the gradients sharded
too, reduce-scattered bucket by bucket during backward) needs it: its
saving is in backward.

    mpiexec -n 2 python -m mpi4py benchmarks/zero.py --memory --backward \
        --modes unsharded,sharded,stage2 --json out.json

``--partition`` computes, without launching the ranks (every rank
computes the same partition from the parameters' shapes, so the split is
exact for any N), the optimizer state per rank (Adam: two float32 arrays
per element) of the one-dominant-array MLP (``--model dominant``) and of
ResNet-50 at N = 2, 3, 4, 8 and 16: the element partition's largest
rank against total/N, beside whole-parameter ownership (the greedy
by-bytes assignment mnopt used before):

    python benchmarks/zero.py --partition --json out.json
"""

import argparse
import gc
import json
import statistics
import time
import tracemalloc

import numpy

import mnopt  # before Chainer: NumPy 2 names for it
from mnopt.transport import ring
from mnopt.benchmark.harness import spread
from mnopt.benchmark.workloads import resnet50_grad_shapes
import chainer  # NOQA
from mnopt import zero  # NOQA
import chainer.functions as F  # NOQA
import chainer.links as L  # NOQA

MODES = ('unsharded', 'sharded')
#: --memory's modes: (shard_state, overlap) of each.
MEMORY_MODES = {'unsharded': (False, False), 'sharded': (True, False),
                'stage2': (True, True)}
OPTIMIZERS = {'Adam': lambda: chainer.optimizers.Adam(alpha=1e-4),
              'MomentumSGD': lambda: chainer.optimizers.MomentumSGD(lr=1e-4),
              'SGD': lambda: chainer.optimizers.SGD(lr=1e-4)}


def make_model(width, layers, model='mlp'):
    numpy.random.seed(0)
    if model == 'resnet50':
        # ResNet-50's parameters
        # (mnopt.benchmark.workloads.resnet50_grad_shapes: Chainer's
        # ImageNet example's), without its forward: the update sees
        # arrays, not layers.
        link = chainer.Link()
        with link.init_scope():
            for i, shape in enumerate(resnet50_grad_shapes()):
                setattr(link, 'p%03d' % i, chainer.Parameter(
                    (numpy.random.standard_normal(shape) * 0.01)
                    .astype(numpy.float32)))
        return link
    if model == 'dominant':
        # One array holds 99% of the parameters: Linear(1200, 400), then
        # Linear(400, 10).
        return chainer.Sequential(L.Linear(1200, 400), L.Linear(400, 10))
    return chainer.Sequential(*[L.Linear(width, width)
                                for _ in range(layers)])


def whole_parameter_owners(sizes, n):
    """Whole-parameter ownership as mnopt had it: largest first, each to
    the rank with the fewest elements so far (ties: the lowest rank)."""
    load = [0] * n
    for _, size in sorted(sizes, key=lambda x: (-x[1], x[0])):
        rank = min(range(n), key=lambda r: (load[r], r))
        load[rank] += size
    return load


def partition_table(args):
    """The state per rank, by element against by whole parameter."""
    rows = []
    for model in ('dominant', 'resnet50'):
        link = make_model(0, 0, model)
        specs = [(n, p.array.size, p.array.dtype.name)
                 for n, p in sorted(link.namedparams())]
        total = sum(s for _, s, _ in specs)
        for n in (2, 3, 4, 8, 16):
            by_element = zero.elements_per_rank(
                zero.partition(specs, n), n)
            by_param = whole_parameter_owners(
                [(name, s) for name, s, _ in specs], n)
            state = 8   # Adam: m and v, float32
            rows.append({
                'model': model, 'N': n, 'state_total_MB': total * state / 1e6,
                'even_share_MB': total * state / n / 1e6,
                'largest_by_element_MB': max(by_element) * state / 1e6,
                'smallest_by_element_MB': min(by_element) * state / 1e6,
                'largest_by_element_over_even': max(by_element) * n / total,
                'largest_by_element_minus_even_elements':
                    max(by_element) - total / n,
                'largest_by_parameter_MB': max(by_param) * state / 1e6,
                'smallest_by_parameter_MB': min(by_param) * state / 1e6,
                'largest_by_parameter_over_even': max(by_param) * n / total})
    print('| model | N | total/N MB | by element: largest / smallest MB | '
          'largest / (total/N) | by whole parameter: largest / smallest MB '
          '| largest / (total/N) |')
    print('|---|---|---|---|---|---|---|')
    for r in rows:
        print('| %s | %d | %.3f | %.3f / %.3f | %.5f | %.3f / %.3f | %.3f |'
              % (r['model'], r['N'], r['even_share_MB'],
                 r['largest_by_element_MB'], r['smallest_by_element_MB'],
                 r['largest_by_element_over_even'],
                 r['largest_by_parameter_MB'], r['smallest_by_parameter_MB'],
                 r['largest_by_parameter_over_even']))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'align': zero.ALIGN, 'rows': rows}, f, indent=1)


def describe_model(model):
    params = list(model.params())
    return '%d parameters, %d bytes' % (
        len(params), sum(p.array.nbytes for p in params))


class DeviceMemory(object):
    """Bytes in use on the GPU (CuPy's pool), as tracemalloc's calls."""

    def __init__(self, cupy):
        self.pool = cupy.get_default_memory_pool()

    def start(self):
        pass

    stop = reset_peak = start

    def get_traced_memory(self):
        return self.pool.used_bytes(), None


def measure_memory(args):
    """Memory and wire bytes per rank, each mode in turn (see the module)."""
    world = mnopt.create_communicator(args.communicator)
    xp, memory = numpy, tracemalloc
    if args.gpu:
        import cupy as xp
        memory = DeviceMemory(xp)
    first = make_model(args.width, args.layers, args.model)
    rng = numpy.random.RandomState(world.rank)
    grads = {n: xp.asarray(rng.standard_normal(p.shape).astype(p.dtype))
             for n, p in first.namedparams()}
    param_bytes = sum(p.array.nbytes for p in first.params())
    model_text = describe_model(first)
    del first
    memory.start()
    result = {'ranks': world.size, 'communicator': args.communicator,
              'device': 'gpu' if args.gpu else 'cpu',
              'optimizer': args.optimizer, 'model': args.model,
              'model_params': model_text, 'parameter_bytes': param_bytes,
              'allreduce': mnopt.transport.allreduce.allreduce_algorithm()}
    modes = args.modes.split(',')
    x = xp.asarray(rng.standard_normal((args.batch, args.width))
                   .astype(numpy.float32))
    result['step'] = ('forward, backward and update of %d rows' % args.batch
                      if args.backward else 'fixed gradients, update')
    for mode in modes:
        gc.collect()
        base = memory.get_traced_memory()[0]
        comm = mnopt.create_communicator(args.communicator)
        model = make_model(args.width, args.layers, args.model)
        if args.gpu:
            model.to_gpu()
        shard_state, overlap = MEMORY_MODES[mode]
        opt = mnopt.create_multi_node_optimizer(
            OPTIMIZERS[args.optimizer](), comm, shard_state=shard_state,
            overlap=overlap).setup(model)

        def step():
            if args.backward:
                opt.update(lambda: F.sum(F.tanh(model(x))))
                return
            for name, param in model.namedparams():
                param.grad = None   # a backward allocates anew
                param.grad = grads[name].copy()
            opt.update()

        for _ in range(3):   # broadcast, first update (state; stage 2's
            step()           # plan), one more
        gc.collect()
        held = memory.get_traced_memory()[0] - base
        memory.reset_peak()
        sent = ring.bytes_sent
        step()
        sent = ring.bytes_sent - sent
        peak = memory.get_traced_memory()[1]
        peak = None if peak is None else peak - base
        figures = {
            'state_bytes': state_nbytes(model),
            'held_bytes': held,
            'step_peak_bytes': peak,
            'ring_bytes_sent': sent,
            'scratch_bytes': comm.shard_buffer_nbytes(),
        }
        result[mode] = {k: world.allgather_obj(v)
                        for k, v in figures.items()}
        state = result[mode]['state_bytes']
        result[mode]['state_max_over_mean'] = (
            max(state) * len(state) / sum(state) if sum(state) else 1.0)
        del model, opt, step
        comm.finalize()
        del comm
    memory.stop()
    if world.rank == 0:
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, 'w') as f:
                json.dump(result, f, indent=1)
    world.finalize()


def state_nbytes(model):
    return sum(getattr(v, 'nbytes', 0) for p in model.params()
               for v in (p.update_rule.state or {}).values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--communicator', default='flat')
    parser.add_argument('--width', type=int, default=1024)
    parser.add_argument('--layers', type=int, default=6)
    parser.add_argument('--steps', type=int, default=10)
    parser.add_argument('--runs', type=int, default=5)
    parser.add_argument('--optimizer', default='Adam',
                        choices=sorted(OPTIMIZERS))
    parser.add_argument('--json', help='also write the result here')
    parser.add_argument('--model', default='mlp',
                        choices=['mlp', 'dominant', 'resnet50'],
                        help='mlp: --layers x Linear(--width, --width); '
                        'dominant: Linear(1200, 400) + Linear(400, 10); '
                        "resnet50: ResNet-50's 162 parameter arrays")
    parser.add_argument('--partition', action='store_true',
                        help='the state per rank at N = 2-16, computed '
                        '(no ranks launched)')
    parser.add_argument('--memory', action='store_true',
                        help='measure memory and wire bytes, not time')
    parser.add_argument('--modes', default=','.join(MODES),
                        help='with --memory: which modes, in this order '
                        '(of %s)' % ', '.join(MEMORY_MODES))
    parser.add_argument('--backward', action='store_true',
                        help='with --memory and the MLP: real steps '
                        '(forward, backward, update), not fixed gradients')
    parser.add_argument('--batch', type=int, default=32,
                        help='rows per step with --backward')
    parser.add_argument('--gpu', action='store_true',
                        help='with --memory: the model on the GPU (CuPy)')
    args = parser.parse_args()
    if args.partition:
        return partition_table(args)
    modes = args.modes.split(',')
    if any(m not in MEMORY_MODES for m in modes):
        parser.error('--modes: each of %s' % ', '.join(MEMORY_MODES))
    if args.backward and (args.model != 'mlp' or not args.memory):
        parser.error('--backward needs --memory and the MLP')
    if args.gpu and not args.memory:
        parser.error('--gpu needs --memory')
    if 'stage2' in modes and not args.backward:
        parser.error('mode stage2 reduces gradients during backward: it '
                     'needs --backward')
    if args.memory:
        return measure_memory(args)
    comm = mnopt.create_communicator(args.communicator)
    models, opts, grads = {}, {}, {}
    for mode in MODES:
        model = make_model(args.width, args.layers, args.model)
        opt = mnopt.create_multi_node_optimizer(
            OPTIMIZERS[args.optimizer](), comm,
            shard_state=(mode == 'sharded')).setup(model)
        rng = numpy.random.RandomState(comm.rank)
        grads[mode] = {n: rng.standard_normal(p.shape).astype(p.dtype)
                       for n, p in model.namedparams()}
        models[mode], opts[mode] = model, opt

    def step(mode):
        for name, param in models[mode].namedparams():
            param.grad = grads[mode][name].copy()
        opts[mode].update()

    for mode in MODES:
        step(mode)   # broadcast
        step(mode)   # first update: state allocated
    times = {m: [] for m in MODES}
    for run in range(args.runs):
        order = MODES if run % 2 == 0 else MODES[::-1]
        for mode in order:
            per_step = []
            for _ in range(args.steps):
                comm.mpi_comm.Barrier()
                start = time.perf_counter()
                step(mode)
                per_step.append(time.perf_counter() - start)
            # The slowest rank sets the pace.
            worst = comm.mpi_comm.allreduce(statistics.median(per_step),
                                            op=mnopt_max())
            times[mode].append(worst)
    state = {m: comm.allgather_obj(state_nbytes(models[m])) for m in MODES}
    scratch = comm.allgather_obj(comm.shard_buffer_nbytes())
    params = sum(p.array.nbytes for p in models['sharded'].params())
    # Both modes applied the same gradients the same number of times.
    diff = max(float(abs(a.array - b.array).max()) for a, b in zip(
        models['sharded'].params(), models['unsharded'].params()))
    diff = comm.mpi_comm.allreduce(diff, op=mnopt_max())
    differing = comm.mpi_comm.allreduce(sum(
        int((a.array != b.array).sum()) for a, b in zip(
            models['sharded'].params(), models['unsharded'].params())),
        op=mnopt_max())
    result = {
        'ranks': comm.size, 'communicator': args.communicator,
        'optimizer': args.optimizer,
        'model': ('%d x Linear(%d, %d), %d parameter bytes' % (
            args.layers, args.width, args.width, params)
            if args.model == 'mlp' else 'resnet50: ' + describe_model(
                models['sharded'])),
        'state_bytes_per_rank': state,
        # What the sharded collectives keep besides (the unsharded flat
        # averaging packs only arrays under 64 KiB or needing a cast).
        'sharded_buffer_bytes_per_rank': scratch,
        'update_s': {m: spread(times[m]) for m in MODES},
        'runs': args.runs, 'steps_per_run': args.steps,
        'updates': 2 + args.runs * args.steps,
        'max_parameter_difference': diff,
        'differing_elements': differing,
        'elements': params // 4,
    }
    if comm.rank == 0:
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, 'w') as f:
                json.dump(result, f, indent=1)
    comm.finalize()


def mnopt_max():
    from mpi4py import MPI
    return MPI.MAX


if __name__ == '__main__':
    main()
