#!/usr/bin/env python
"""Train an MLP on the UCI handwritten digits (digits.csv.gz) with mnopt.

    mpiexec -n 4 python -m mpi4py examples/digits/train_digits.py \\
        --allreduce-grad-dtype float16 --double-buffering --seed 1

The total batch is fixed (``--total-batch``) and split over the ranks, so
runs on different numbers of ranks take the same optimisation steps up to
rounding and staleness.  Rank 0 prints (or writes with ``--json``) the test
accuracy after every epoch.
"""

import argparse
import contextlib
import json
import os

import chainer
import chainer.functions as F
import chainer.links as L
import numpy

import mnopt


class MLP(chainer.Chain):

    def __init__(self, n_hidden=128, n_out=10):
        super(MLP, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(64, n_hidden)
            self.l2 = L.Linear(n_hidden, n_hidden)
            self.l3 = L.Linear(n_hidden, n_out)

    def forward(self, x):
        return self.l3(F.relu(self.l2(F.relu(self.l1(x)))))


#: The test set of the UCI optical handwritten digits (1797 8x8 images,
#: pixels 0..16), one image a row: 64 pixels, then the label.  The same
#: file scikit-learn's ``load_digits`` reads; DATA.md says where it is from.
DIGITS_CSV = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          'digits.csv.gz')


def load_digits(test_fraction=0.2):
    """(train, test) as float32 features in [0, 1] and int32 labels, split
    by a fixed permutation so every run sees the same split."""
    rows = numpy.loadtxt(DIGITS_CSV, delimiter=',', dtype=numpy.int64)
    x = (rows[:, :64] / 16.0).astype(numpy.float32)
    t = rows[:, 64].astype(numpy.int32)
    order = numpy.random.RandomState(12345).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return (x[train], t[train]), (x[test], t[test])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--communicator', default='flat')
    p.add_argument('--allreduce-grad-dtype', default=None,
                   choices=['float32', 'float16', 'bfloat16'])
    p.add_argument('--double-buffering', action='store_true')
    p.add_argument('--compression', default=None,
                   choices=['sign', 'powersgd'],
                   help='sign: majority vote of the gradients\' signs; '
                   'powersgd: low-rank factors of each weight matrix')
    p.add_argument('--powersgd-rank', type=int, default=1,
                   help='rank of the factors with --compression powersgd')
    p.add_argument('--no-error-feedback', action='store_true')
    p.add_argument('--warmup-steps', type=int, default=0,
                   help='uncompressed steps before --compression starts')
    p.add_argument('--optimizer', default='momentum_sgd',
                   choices=['momentum_sgd', 'signum'])
    p.add_argument('--local-steps', type=int, default=None,
                   help='DiLoCo: average the parameters every this many '
                   'local updates, with an outer Nesterov step '
                   '(docs/local_sgd.md)')
    p.add_argument('--fragments', type=int, default=1,
                   help='with --local-steps: sync this many fragments in '
                   'turn (Streaming DiLoCo)')
    p.add_argument('--fragment-sync-delay', type=int, default=0,
                   help='with --local-steps: apply each sync this many '
                   'local updates later, averaging in the background')
    p.add_argument('--sync-warmup-steps', type=int, default=0,
                   help='with --local-steps: this many synchronous updates '
                   'first')
    p.add_argument('--outer-lr', type=float, default=0.7)
    p.add_argument('--outer-momentum', type=float, default=0.9)
    p.add_argument('--total-batch', type=int, default=64)
    p.add_argument('--epoch', type=int, default=30)
    p.add_argument('--lr', type=float, default=0.05)
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--json', help='rank 0 writes the results here')
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    comm = mnopt.create_communicator(
        args.communicator, allreduce_grad_dtype=args.allreduce_grad_dtype,
        compression=args.compression,
        error_feedback=not args.no_error_feedback,
        warmup_steps=args.warmup_steps,
        # Only with PowerSGD: other compressions refuse a rank.
        powersgd_rank=args.powersgd_rank
        if args.compression == 'powersgd' else None)
    if args.total_batch % comm.size:
        raise ValueError('--total-batch %d does not split over %d ranks'
                         % (args.total_batch, comm.size))
    batch = args.total_batch // comm.size
    (x_train, t_train), (x_test, t_test) = load_digits()
    train = chainer.datasets.TupleDataset(x_train, t_train) \
        if comm.rank == 0 else None
    train = mnopt.scatter_dataset(train, comm, shuffle=True, seed=args.seed)

    numpy.random.seed(args.seed)  # rank 0's initial weights are broadcast
    model = L.Classifier(MLP())
    actual = mnopt.Signum(lr=args.lr, momentum=0.9) \
        if args.optimizer == 'signum' else \
        chainer.optimizers.MomentumSGD(lr=args.lr, momentum=0.9)
    local = {} if args.local_steps is None else {
        'local_steps': args.local_steps, 'fragments': args.fragments,
        'fragment_sync_delay': args.fragment_sync_delay,
        'sync_warmup_steps': args.sync_warmup_steps,
        'outer_optimizer': mnopt.OuterNesterov(
            lr=args.outer_lr, momentum=args.outer_momentum)}
    optimizer = mnopt.create_multi_node_optimizer(actual, comm,
        double_buffering=args.double_buffering, **local).setup(model)
    # With local steps the replicas differ between syncs: evaluate (and
    # compare) the synced parameters, the same on every rank.
    synced = optimizer.using_synced_parameters if local else \
        contextlib.nullcontext
    it = chainer.iterators.SerialIterator(
        train, batch, order_sampler=chainer.iterators.ShuffleOrderSampler(
            numpy.random.RandomState(args.seed * 1000 + comm.rank)))
    curve = []
    while it.epoch < args.epoch:
        x, t = chainer.dataset.concat_examples(it.next())
        optimizer.update(model, x, t)
        if it.is_new_epoch:
            if hasattr(optimizer, 'wait'):
                optimizer.wait()
            with chainer.using_config('train', False), \
                    chainer.no_backprop_mode(), synced():
                acc = float(F.accuracy(model.predictor(x_test), t_test).array)
            curve.append(acc)
    result = {'n_ranks': comm.size, 'communicator': comm.name,
              'allreduce_grad_dtype': args.allreduce_grad_dtype or 'float32',
              'double_buffering': args.double_buffering, 'seed': args.seed,
              'compression': args.compression,
              'powersgd_rank': args.powersgd_rank
              if args.compression == 'powersgd' else None,
              'warmup_steps': args.warmup_steps, 'lr': args.lr,
              'error_feedback': not args.no_error_feedback,
              'optimizer': args.optimizer,
              'local_steps': args.local_steps, 'fragments': args.fragments,
              'fragment_sync_delay': args.fragment_sync_delay,
              'sync_warmup_steps': args.sync_warmup_steps,
              'outer_lr': args.outer_lr if local else None,
              'outer_momentum': args.outer_momentum if local else None,
              'total_batch': args.total_batch, 'epochs': args.epoch,
              'test_accuracy': curve[-1], 'curve': curve}
    # Every rank must hold the same parameters.
    with synced():
        params = [p.array.copy() for _, p in sorted(model.namedparams())]
    digest = float(sum(numpy.abs(p).sum() for p in params))
    digests = comm.allgather_obj(digest)
    assert all(d == digests[0] for d in digests), digests
    if comm.rank == 0:
        print('test accuracy after %d epochs: %.4f' % (args.epoch, curve[-1]))
        if args.json:
            with open(args.json, 'w') as f:
                json.dump(result, f)


if __name__ == '__main__':
    main()
