#!/usr/bin/env python
"""The digits MLP with PyTorch's post-local SGD, beside mnopt's local steps.

    mpiexec -n 4 .venv/gloo/bin/python -m mpi4py \\
        examples/digits/train_digits_torch.py --period 32 --seed 1

The reference for ``train_digits.py --local-steps H --outer-lr 1
--outer-momentum 0`` (plain model averaging every H updates): the same
MLP (Chainer's initial weights, copied), the same data split and order
per rank (mnopt.scatter_dataset and the same iterator), momentum SGD
(PyTorch's form equals Chainer's at a fixed lr), and
``PostLocalSGDOptimizer`` with ``PeriodicModelAverager(period=H)`` over
torch.distributed's gloo.  PyTorch's averager also averages after the
first update (its step 0), mnopt's first sync is after update H.  Rank 0
writes the same JSON as train_digits.py; the accuracy is that of the
mean of the ranks' replicas (what mnopt evaluates is its last synced
parameters).  Needs torch (the .venv/gloo environment of
benchmarks/gloo_bench.py).
"""

import argparse
import json
import os
import sys

import chainer
import numpy
import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import \
    PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer

import mnopt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_digits import MLP, load_digits  # NOQA


def torch_mlp(chainer_mlp):
    """torch.nn's MLP with the Chainer MLP's weights (both (out, in))."""
    layers = [chainer_mlp.l1, chainer_mlp.l2, chainer_mlp.l3]
    mods = []
    for i, link in enumerate(layers):
        lin = torch.nn.Linear(link.W.shape[1], link.W.shape[0])
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(link.W.array))
            lin.bias.copy_(torch.from_numpy(link.b.array))
        mods += [lin] + ([torch.nn.ReLU()] if i < 2 else [])
    return torch.nn.Sequential(*mods)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--period', type=int, required=True,
                   help='PeriodicModelAverager\'s period (H)')
    p.add_argument('--warmup-steps', type=int, default=0)
    p.add_argument('--total-batch', type=int, default=64)
    p.add_argument('--epoch', type=int, default=30)
    p.add_argument('--lr', type=float, default=0.05)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--json')
    args = p.parse_args()
    comm = mnopt.create_communicator('flat')
    os.environ.setdefault('MASTER_ADDR', '127.0.0.1')
    os.environ.setdefault('GLOO_SOCKET_IFNAME', 'lo')
    port = comm.bcast_obj(29500 + os.getpid() % 2000 if comm.rank == 0
                          else None)
    os.environ['MASTER_PORT'] = str(port)
    dist.init_process_group('gloo', rank=comm.rank, world_size=comm.size)
    batch = args.total_batch // comm.size
    (x_train, t_train), (x_test, t_test) = load_digits()
    train = chainer.datasets.TupleDataset(x_train, t_train) \
        if comm.rank == 0 else None
    train = mnopt.scatter_dataset(train, comm, shuffle=True, seed=args.seed)
    numpy.random.seed(args.seed)   # the same initial weights as mnopt's
    model = torch_mlp(MLP())
    opt = PostLocalSGDOptimizer(
        optim=torch.optim.SGD(model.parameters(), lr=args.lr,
                              momentum=0.9),
        averager=PeriodicModelAverager(period=args.period,
                                       warmup_steps=args.warmup_steps))
    it = chainer.iterators.SerialIterator(
        train, batch, order_sampler=chainer.iterators.ShuffleOrderSampler(
            numpy.random.RandomState(args.seed * 1000 + comm.rank)))
    x_test_t, t_test_t = torch.from_numpy(x_test), torch.from_numpy(
        t_test.astype(numpy.int64))
    curve = []
    while it.epoch < args.epoch:
        x, t = chainer.dataset.concat_examples(it.next())
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            model(torch.from_numpy(x)), torch.from_numpy(t.astype(
                numpy.int64)))
        loss.backward()
        opt.step()
        if it.is_new_epoch:
            with torch.no_grad():
                saved = [q.detach().clone() for q in model.parameters()]
                for q in model.parameters():   # the replicas' mean
                    dist.all_reduce(q.data)
                    q.data /= comm.size
                acc = float((model(x_test_t).argmax(1) == t_test_t)
                            .float().mean())
                for q, s in zip(model.parameters(), saved):
                    q.data.copy_(s)
            curve.append(acc)
    dist.destroy_process_group()
    if comm.rank == 0:
        print('test accuracy after %d epochs: %.4f' % (args.epoch, curve[-1]))
        if args.json:
            with open(args.json, 'w') as f:
                json.dump({'n_ranks': comm.size, 'seed': args.seed,
                           'torch': torch.__version__,
                           'post_local_sgd_period': args.period,
                           'warmup_steps': args.warmup_steps, 'lr': args.lr,
                           'total_batch': args.total_batch,
                           'epochs': args.epoch, 'test_accuracy': curve[-1],
                           'curve': curve}, f)


if __name__ == '__main__':
    main()
