#!/usr/bin/env python
"""Data-parallel ImageNet training with mnopt.

    mpiexec -n 2 python -m mpi4py examples/imagenet/train_imagenet.py
    mpiexec -n 8 python -m mpi4py examples/imagenet/train_imagenet.py \\
        TRAIN_LIST VAL_LIST --root IMAGES --mean mean.npy --arch resnet50

TRAIN_LIST and VAL_LIST hold ``path label`` lines, as Chainer's ImageNet
example takes them.  Without them, a small dataset of real PNG files is
built once (cached under ``--data-cache``) and used with 48-pixel crops, so
a run completes in about a minute on 2 CPU cores.  Each rank uses one GPU
(its intra-node rank) when CuPy and GPUs are present, the CPU otherwise.
"""

import argparse
import os
import sys
import time

# mnopt first: run from a checkout on PYTHONPATH (no .pth installed), its
# import gives Chainer the NumPy names NumPy 2 removed.
import mnopt  # NOQA
import chainer
import numpy
from chainer import training
from chainer.training import extensions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import embedded_data  # NOQA
import models  # NOQA


class PreprocessedDataset(chainer.dataset.DatasetMixin):
    """Crop (random for training, centred for validation), flip at random,
    subtract the mean image and scale to about [-1, 1]."""

    def __init__(self, pairs, root, mean, crop_size, random=True):
        self.base = chainer.datasets.LabeledImageDataset(pairs, root)
        self.mean = mean.astype(numpy.float32)
        self.crop_size = crop_size
        self.random = random

    def __len__(self):
        return len(self.base)

    def get_example(self, i):
        image, label = self.base[i]
        _, h, w = image.shape
        size = self.crop_size
        if self.random:
            top = numpy.random.randint(0, h - size + 1)
            left = numpy.random.randint(0, w - size + 1)
            if numpy.random.randint(2):
                image = image[:, :, ::-1]
        else:
            top, left = (h - size) // 2, (w - size) // 2
        image = image[:, top:top + size, left:left + size]
        mean = self.mean[:, top:top + size, left:left + size]
        return (image - mean) * (1.0 / 255.0), label


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('train', nargs='?', help='training list (path label)')
    p.add_argument('val', nargs='?', help='validation list (path label)')
    p.add_argument('--root', default='.', help='directory of the images')
    p.add_argument('--mean', help='mean image (.npy); default: the '
                                  'embedded set\'s, or none')
    p.add_argument('--arch', '-a', choices=sorted(models.ARCHS),
                   default='nin')
    p.add_argument('--n-classes', type=int, default=None,
                   help='default: 1000, or 8 for the embedded set')
    p.add_argument('--insize', type=int, default=None,
                   help='crop size; default: 224, or 48 for the embedded set')
    p.add_argument('--communicator', default='auto',
                   choices=mnopt.communicators.NAMES)
    p.add_argument('--allreduce-grad-dtype', default=None,
                   choices=['float32', 'float16', 'bfloat16'])
    p.add_argument('--double-buffering', action='store_true')
    p.add_argument('--mnbn', action='store_true',
                   help='batch normalization over every rank\'s batch '
                        '(MultiNodeBatchNormalization; for resnet50)')
    p.add_argument('--batchsize', '-B', type=int, default=32,
                   help='per rank')
    p.add_argument('--val-batchsize', type=int, default=50)
    p.add_argument('--epoch', '-E', type=int, default=None,
                   help='default: 10, or 20 for the embedded set')
    p.add_argument('--iteration', type=int, default=None,
                   help='stop after this many iterations (overrides --epoch)')
    p.add_argument('--lr', type=float, default=0.01)
    p.add_argument('--out', '-o', default='result')
    p.add_argument('--resume', help="snapshot to resume from, or 'auto': "
                   "the newest one in --out that every rank holds "
                   "completely (none: start afresh); for python -m "
                   "mnopt.launch")
    p.add_argument('--snapshot-interval', type=int, default=None,
                   help='iterations between snapshots (default: each epoch)')
    p.add_argument('--keep-snapshots', type=int, default=2,
                   help='how many of the latest snapshots to keep')
    p.add_argument('--loaderjob', '-j', type=int, default=0,
                   help='processes loading data per rank (0: in-process)')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--data-cache', default=os.path.join(
        os.path.expanduser('~'), '.cache', 'mnopt', 'imagenet-embedded'))
    p.add_argument('--cpu', action='store_true', help='never use a GPU')
    return p.parse_args(argv)


def choose_device(comm, cpu_only):
    if not cpu_only and chainer.backends.cuda.available:
        try:
            import cupy
            if cupy.cuda.runtime.getDeviceCount() > 0:
                device = comm.intra_rank % cupy.cuda.runtime.getDeviceCount()
                chainer.backends.cuda.get_device_from_id(device).use()
                return device
        except Exception:
            pass
    return -1


def load_datasets(args, comm):
    """Rank 0 reads (or builds) the data; every rank gets its share."""
    if args.train is None:
        train_list, val_list, mean_file, root = (None,) * 4
        if comm.rank == 0:
            train_list, val_list, mean_file, root = embedded_data.build(
                args.data_cache)
        args.train, args.val, mean_file, args.root = comm.bcast_obj(
            (train_list, val_list, mean_file, root))
        args.mean = args.mean or mean_file
        args.n_classes = args.n_classes or len(embedded_data.CLASSES)
        args.insize = args.insize or 48
        args.epoch = args.epoch or 20
    args.epoch = args.epoch or 10
    args.n_classes = args.n_classes or 1000
    args.insize = args.insize or 224
    train = val = None
    if comm.rank == 0:
        if args.mean:
            mean = numpy.load(args.mean)
        else:
            mean = numpy.zeros((3, args.insize, args.insize), numpy.float32)
        train = PreprocessedDataset(args.train, args.root, mean, args.insize)
        val = PreprocessedDataset(args.val, args.root, mean, args.insize,
                                  random=False)
    train = mnopt.scatter_dataset(train, comm, shuffle=True, seed=args.seed)
    val = mnopt.scatter_dataset(val, comm)
    return train, val


class Throughput(training.Extension):
    """Reports images per second (all ranks together) and the seconds per
    iteration each rank spent blocked in gradient averaging."""

    trigger = (1, 'iteration')
    priority = training.PRIORITY_WRITER

    def __init__(self, optimizer, images_per_iteration):
        self._optimizer = optimizer
        self._images = images_per_iteration
        self._last = None

    def __call__(self, trainer):
        now = time.perf_counter()
        comm_time = self._optimizer.communication_time
        if self._last is not None:
            t, c = self._last
            chainer.report({'images/sec': self._images / max(now - t, 1e-9),
                            'allreduce/sec': comm_time - c})
        self._last = (now, comm_time)


class SeedGpuRandom(training.Extension):
    """Dropout on the GPU draws from CuPy's generator, whose state cannot
    be saved in a snapshot: reseed it before every iteration from (seed,
    rank, iteration), so that a resumed run draws what the uninterrupted
    one drew (on the CPU, dropout draws from numpy's generator, which the
    rank snapshots save)."""

    trigger = (1, 'iteration')

    def __init__(self, seed, rank):
        self._base = (seed * 1000003 + rank) * 1000003

    def _reseed(self, trainer):
        import cupy
        cupy.random.seed((self._base + trainer.updater.iteration) % 2 ** 63)

    initialize = _reseed    # at the start of a run, resumed or not
    __call__ = _reseed      # after each iteration, for the next


def trainer_snapshot(comm):
    """The shared part of a snapshot: the trainer (model, optimizer state,
    iteration, epoch, rank 0's iterator, the log), the same on every rank,
    so one replica set and rank 0 writes it, to ``snapshot_iter_N.npz``
    (ChainerMN's multi_node_snapshot; Chainer's writer renames a finished
    temporary file)."""
    return mnopt.extensions.multi_node_snapshot(
        comm, extensions.snapshot(
            filename='snapshot_iter_{.updater.iteration}.npz',
            writer=extensions.snapshot_writers.SimpleWriter(
                compression=False)),   # 10x faster
        replica_sets=[list(range(comm.size))])


class Snapshot(training.Extension):
    """Every rank's own part of a snapshot, after the shared part
    (``trainer_snapshot``) of the same iteration: its iterator and random
    state in ``snapshot_iter_N.rankR.npz``, written under a temporary name
    and renamed.  Then every rank waits for all, and old snapshots beyond
    ``keep`` are removed."""

    priority = -101  # after the trainer's snapshot of the same iteration

    def __init__(self, comm, keep):
        self.comm = comm
        self.keep = keep
        self._written = []

    def __call__(self, trainer):
        path = os.path.join(trainer.out, 'snapshot_iter_%d.npz'
                            % trainer.updater.iteration)
        _atomic_save(rank_file(path, self.comm.rank),
                     _RankState(trainer.updater.get_iterator('main'),
                                self.comm.size))
        self.comm.allgather_obj(None)  # all files complete before going on
        self._written.append(path)
        while len(self._written) > self.keep:
            old = self._written.pop(0)
            for f in ((old,) if self.comm.rank == 0 else ()) + (
                    rank_file(old, self.comm.rank),):
                if os.path.exists(f):
                    os.remove(f)


class SnapshotTrigger(object):
    """Fires every ``interval`` and at the last iteration of the run, while
    the iterators are still alive (a finalized MultiprocessIterator cannot
    be serialized)."""

    def __init__(self, interval, length):
        self._interval = training.triggers.IntervalTrigger(*interval)
        self._length, self._unit = length

    def __call__(self, trainer):
        fired = self._interval(trainer)
        updater = trainer.updater
        done = (updater.iteration if self._unit == 'iteration'
                else updater.epoch_detail) >= self._length
        return fired or done

    def serialize(self, serializer):
        self._interval.serialize(serializer['interval'])


class SeededOrder(chainer.iterators.OrderSampler):
    """A shuffled order per epoch from a RandomState of its own, which
    snapshots save (Chainer's ShuffleOrderSampler keeps its generator
    private, so a resumed run drew other orders after the next epoch
    boundary than the uninterrupted one)."""

    def __init__(self, seed):
        self.random = numpy.random.RandomState(seed)

    def __call__(self, current_order, current_position):
        return self.random.permutation(len(current_order))


def _serialize_random_state(serializer, random):
    """Save or restore a numpy RandomState through a Chainer serializer."""
    _, keys, pos, has_gauss, gauss = random.get_state()
    keys = serializer('keys', keys)
    pos = int(serializer('pos', pos))
    has_gauss = int(serializer('has_gauss', has_gauss))
    gauss = float(serializer('gauss', gauss))
    if isinstance(serializer, chainer.serializer.Deserializer):
        random.set_state(('MT19937', keys, pos, has_gauss, gauss))


class _RankState(object):
    """What differs between ranks: the iterator and its order's generator,
    and the global generator the augmentation draws from."""

    def __init__(self, iterator, size):
        self.iterator, self.size = iterator, size

    def serialize(self, serializer):
        self.iterator.serialize(serializer['iterator'])
        # numpy.random's global generator, as a RandomState view of it.
        state = numpy.random.RandomState()
        state.set_state(numpy.random.get_state())
        _serialize_random_state(serializer['rng'], state)
        order = getattr(self.iterator, 'order_sampler', None)
        if isinstance(order, SeededOrder):
            _serialize_random_state(serializer['order_rng'], order.random)
        serializer('n_ranks', self.size)
        if isinstance(serializer, chainer.serializer.Deserializer):
            numpy.random.set_state(state.get_state())


def _start_epoch(iterator, epoch):
    """Put a fresh iterator at the beginning of ``epoch`` (through its own
    serialization: its attributes are read-only)."""
    state = {}
    iterator.serialize(chainer.serializers.DictionarySerializer(state))
    state['epoch'] = numpy.asarray(epoch)
    state['previous_epoch_detail'] = numpy.asarray(float(epoch))
    iterator.serialize(chainer.serializers.NpzDeserializer(state))


def rank_file(path, rank):
    return path[:-len('.npz')] + '.rank%d.npz' % rank


def _atomic_save(path, obj):
    tmp = path + '.tmp%d' % os.getpid()
    chainer.serializers.save_npz(tmp, obj, compression=False)  # 10x faster
    os.replace(tmp, path)


def resume(path, trainer, comm):
    """Load a snapshot on every rank; every rank raises the same clear error
    if any of them cannot.  With the number of ranks it was written with,
    each rank also gets its iterator and random state back; with another,
    the data is split anew and the epoch restarts from its beginning."""
    error = None
    try:
        if not os.path.isfile(path):
            raise FileNotFoundError('no snapshot at %r' % path)
        with numpy.load(path) as f:
            saved_size = None
            rank_path = rank_file(path, 0)
            if os.path.isfile(rank_path):
                with numpy.load(rank_path) as r:
                    saved_size = int(r['n_ranks'])
            epoch = int(f['updater/iterator:main/epoch'])
        same_layout = saved_size == comm.size
        chainer.serializers.load_npz(
            path, trainer, ignore_names=(
                None if same_layout else
                lambda key: key.startswith('updater/iterator:')))
        if same_layout:
            chainer.serializers.load_npz(
                rank_file(path, comm.rank),
                _RankState(trainer.updater.get_iterator('main'), comm.size))
        else:
            _start_epoch(trainer.updater.get_iterator('main'), epoch)
    except Exception as e:
        error = '%s: %s' % (type(e).__name__, e)
    errors = comm.allgather_obj(error)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        raise RuntimeError('cannot resume from %r (missing, corrupt or not '
                           'a snapshot of this model): %s' % (
                               path, '; '.join('rank %d: %s' % b for b in bad)))
    return same_layout


def _complete(path, rank):
    """Whether this rank can resume from ``path``: the shared file and
    this rank's file (where the snapshot has one for it) are whole."""
    from mnopt.extensions.multi_node_snapshot import npz_is_whole as whole
    if not whole(path) or not whole(rank_file(path, 0)):
        return False
    with numpy.load(rank_file(path, 0)) as f:
        saved_size = int(f['n_ranks'])
    return rank >= saved_size or whole(rank_file(path, rank))


def newest_complete_snapshot(out, comm):
    """The newest snapshot in ``out`` that every rank holds completely
    (a crash mid-write leaves the others behind), or None."""
    import re
    mine = []
    for name in os.listdir(out) if os.path.isdir(out) else ():
        m = re.match(r'snapshot_iter_(\d+)\.npz$', name)
        if m and _complete(os.path.join(out, name), comm.rank):
            mine.append(int(m.group(1)))
    everyone = comm.allgather_obj(mine)
    common = set(everyone[0]).intersection(*everyone[1:])
    return os.path.join(out, 'snapshot_iter_%d.npz' % max(common)) \
        if common else None


def check_writable(out, comm):
    """Raise on every rank, before any training, unless every rank can
    write its snapshots into ``out``."""
    import tempfile
    error = None
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix='.writable'):
            pass
    except OSError as e:
        error = '%s: %s' % (type(e).__name__, e)
    bad = [(r, e) for r, e in enumerate(comm.allgather_obj(error)) if e]
    if bad:
        raise RuntimeError('cannot write snapshots and logs to %r: %s' % (
            out, '; '.join('rank %d: %s' % b for b in bad)))


def check_identical_parameters(model, comm):
    """Raise on every rank unless all ranks hold the same parameters."""
    import hashlib
    h = hashlib.sha256()
    for name, p in sorted(model.namedparams()):
        if p.array is not None:
            h.update(name.encode())
            h.update(chainer.backend.CpuDevice().send(p.array).tobytes())
    digests = comm.allgather_obj(h.hexdigest())
    if len(set(digests)) != 1:
        raise RuntimeError('parameters differ across ranks after resuming')


def main(argv=None):
    args = parse_args(argv)
    comm = mnopt.create_communicator(
        args.communicator, allreduce_grad_dtype=args.allreduce_grad_dtype)
    device = choose_device(comm, args.cpu)
    check_writable(args.out, comm)
    numpy.random.seed(args.seed + comm.rank)
    train, val = load_datasets(args, comm)
    model = models.ARCHS[args.arch](args.n_classes)
    if args.mnbn:
        model = mnopt.links.create_mnbn_model(model, comm)
    if device >= 0:
        model.to_gpu()
    optimizer = mnopt.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(lr=args.lr, momentum=0.9), comm,
        double_buffering=args.double_buffering)
    optimizer.setup(model)
    optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))

    order = SeededOrder(args.seed + comm.rank)
    if args.loaderjob > 0:
        train_iter = chainer.iterators.MultiprocessIterator(
            train, args.batchsize, n_processes=args.loaderjob,
            order_sampler=order)
        val_iter = chainer.iterators.MultiprocessIterator(
            val, args.val_batchsize, repeat=False, shuffle=False,
            n_processes=args.loaderjob)
    else:
        train_iter = chainer.iterators.SerialIterator(
            train, args.batchsize, order_sampler=order)
        val_iter = chainer.iterators.SerialIterator(
            val, args.val_batchsize, repeat=False, shuffle=False)

    updater = training.StandardUpdater(train_iter, optimizer, device=device)
    stop = ((args.iteration, 'iteration') if args.iteration
            else (args.epoch, 'epoch'))
    trainer = training.Trainer(updater, stop, out=args.out)

    log_interval = (1, 'iteration') if args.iteration and \
        args.iteration <= 20 else (5, 'iteration')
    val_interval = (1, 'epoch') if not args.iteration else stop
    snapshot_interval = ((args.snapshot_interval, 'iteration')
                         if args.snapshot_interval else (1, 'epoch'))
    evaluator = extensions.Evaluator(val_iter, model, device=device)
    trainer.extend(mnopt.create_multi_node_evaluator(evaluator, comm),
                   trigger=val_interval, name='validation')
    trainer.extend(Throughput(optimizer, args.batchsize * comm.size))
    if device >= 0:
        trainer.extend(SeedGpuRandom(args.seed, comm.rank))
    trainer.extend(trainer_snapshot(comm), name='snapshot',
                   trigger=SnapshotTrigger(snapshot_interval, stop))
    trainer.extend(Snapshot(comm, args.keep_snapshots), name='rank_snapshot',
                   trigger=SnapshotTrigger(snapshot_interval, stop))
    if comm.rank == 0:   # the other ranks stay quiet unless they fail
        trainer.extend(extensions.LogReport(trigger=log_interval))
        trainer.extend(extensions.observe_lr(), trigger=log_interval)
        trainer.extend(extensions.PrintReport(
            ['epoch', 'iteration', 'main/loss', 'validation/main/loss',
             'main/accuracy', 'validation/main/accuracy', 'images/sec',
             'allreduce/sec', 'elapsed_time']), trigger=log_interval)
        trainer.extend(extensions.ProgressBar(update_interval=1))
        if extensions.PlotReport.available():
            trainer.extend(extensions.PlotReport(
                ['main/loss', 'validation/main/loss'], 'epoch',
                file_name='loss.png'))
            trainer.extend(extensions.PlotReport(
                ['main/accuracy', 'validation/main/accuracy'], 'epoch',
                file_name='accuracy.png'))

    if comm.rank == 0:
        print('mnopt ImageNet example: %d ranks, communicator %s, wire %s%s%s, '
              '%s, %s, batch %d per rank, %d training images'
              % (comm.size, comm.name, comm.allreduce_grad_dtype or 'float32',
                 ', double buffering' if args.double_buffering else '',
                 ', multi-node batch normalization' if args.mnbn else '',
                 args.arch, 'GPU' if device >= 0 else 'CPU', args.batchsize,
                 len(train) * comm.size))
    if args.resume == 'auto':
        args.resume = newest_complete_snapshot(args.out, comm)
        if comm.rank == 0 and os.environ.get('MNOPT_RESTART', '0') != '0':
            print('restart %s: %s' % (os.environ['MNOPT_RESTART'], (
                'resuming from ' + args.resume) if args.resume else
                'no complete snapshot yet, starting afresh'))
    if args.resume:
        same = resume(args.resume, trainer, comm)
        check_identical_parameters(model, comm)
        if comm.rank == 0:
            print('resumed from %s at iteration %d%s' % (
                args.resume, updater.iteration,
                '' if same else ' (data split anew for %d ranks)' % comm.size))
    trainer.run()
    return trainer


if __name__ == '__main__':
    main()
