"""Gradient accumulation (accumulation_steps=K) against K=1, side by side
in one run: the seconds each update spends averaging (the optimizer's
``communication_time``) per sample, and per update the whole step.

    python -m mnopt.netsim run --nodes 4 --rate 100mbit -- \\
        .venv/numpy2/bin/python -m mpi4py benchmarks/accumulation.py \\
        --json docs/results/netsim/accumulation_4nodes_100mbit.json

Each of ``--runs`` rounds trains ``--updates`` updates of each K (the
order alternating round by round) after two warm-up updates (the
broadcast, then one that allocates), over micro-batches of ``--batch``
rows per rank: K=4 makes 4 calls of ``update(lossfun, ...)`` per update,
K=1 one call.  Rank 0 prints, per K, min/median/max over the rounds of
the averaging seconds per sample (all ranks' samples) and per update.
"""

import argparse
import json
import statistics
import time

import numpy

import mnopt   # before Chainer: Chainer's NumPy 2 names
import chainer
import chainer.functions as F
import chainer.links as L


class MLP(chainer.Chain):
    def __init__(self, width):
        super(MLP, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(64, width)
            self.l2 = L.Linear(width, width)
            self.l3 = L.Linear(width, 10)

    def __call__(self, x, t):
        h = F.relu(self.l2(F.relu(self.l1(x))))
        return F.softmax_cross_entropy(self.l3(h), t)


def one_round(comm, steps, args, rng):
    """(averaging seconds, wall seconds) of ``args.updates`` updates."""
    model = MLP(args.width)
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(lr=0.01), comm,
        accumulation_steps=steps).setup(model)

    def update():
        for _ in range(steps):
            x = rng.standard_normal((args.batch, 64)).astype(numpy.float32)
            t = rng.randint(0, 10, args.batch).astype(numpy.int32)
            opt.update(model, x, t)

    for _ in range(2):
        update()
    comm.barrier() if hasattr(comm, 'barrier') else comm.mpi_comm.Barrier()
    opt.communication_time = 0.0
    start = time.perf_counter()
    for _ in range(args.updates):
        update()
    wall = time.perf_counter() - start
    return opt.communication_time, wall


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--steps', default='1,4', help='values of K')
    p.add_argument('--batch', type=int, default=16,
                   help='rows per micro-batch per rank')
    p.add_argument('--width', type=int, default=512,
                   help='hidden width (512: 0.3M parameters, 1.2 MB)')
    p.add_argument('--updates', type=int, default=6)
    p.add_argument('--runs', type=int, default=3)
    p.add_argument('--communicator', default='flat')
    p.add_argument('--json')
    args = p.parse_args()
    comm = mnopt.create_communicator(args.communicator)
    rng = numpy.random.RandomState(comm.rank)
    ks = [int(k) for k in args.steps.split(',')]
    rounds = {k: [] for k in ks}
    for r in range(args.runs):
        for k in (ks if r % 2 == 0 else ks[::-1]):
            averaging, wall = one_round(comm, k, args, rng)
            # The slowest rank's: the step waits for it.
            averaging = max(comm.allgather_obj(averaging))
            wall = max(comm.allgather_obj(wall))
            samples = args.updates * k * args.batch * comm.size
            rounds[k].append({
                'averaging_s_per_sample': averaging / samples,
                'averaging_s_per_update': averaging / args.updates,
                'step_s_per_sample': wall / samples})
    if comm.rank == 0:
        print('%d ranks, %s, micro-batch %d per rank, %d updates x %d runs'
              % (comm.size, args.communicator, args.batch, args.updates,
                 args.runs))
        print('%3s  %-32s  %-32s' % ('K', 'averaging ms/sample min/med/max',
                                     'averaging ms/update min/med/max'))
        for k in ks:
            cols = []
            for key in ('averaging_s_per_sample', 'averaging_s_per_update'):
                xs = [1e3 * x[key] for x in rounds[k]]
                cols.append('%.3f / %.3f / %.3f' % (
                    min(xs), statistics.median(xs), max(xs)))
            print('%3d  %-32s  %-32s' % (k, cols[0], cols[1]))
        if args.json:
            with open(args.json, 'w') as f:
                json.dump({'size': comm.size, 'args': vars(args),
                           'rounds': {str(k): v for k, v in rounds.items()}},
                          f, indent=1)
    comm.finalize()


if __name__ == '__main__':
    main()
