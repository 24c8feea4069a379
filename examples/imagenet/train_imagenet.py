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
import json
import os
import re
import secrets
import sys
import time

# mnopt first: run from a checkout on PYTHONPATH (no .pth installed), its
# import gives Chainer the NumPy names NumPy 2 removed.
import mnopt  # NOQA
import mnopt.communicators
import chainer
import numpy
from chainer import training
from chainer.training import extensions
from mnopt.extensions.loadable import (
    newest_loadable, npz_is_whole, npz_problem, rank_file_problem)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import embedded_data  # NOQA
import local_steps_flags  # NOQA
import models  # NOQA
import plots  # NOQA
import run_summary  # NOQA
import snapshot_modes  # NOQA
import table  # NOQA


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


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(
            'must be at least 1 (the snapshot just written), not %d' % value)
    return value


def _bytes_or_auto(text):
    if text == 'auto':
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            "takes a number of bytes >= 1 or 'auto', not %r" % text)
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('train', nargs='?', help='training list (path label)')
    p.add_argument('val', nargs='?', help='validation list (path label)')
    p.add_argument('--root', default='.', help='directory of the images')
    p.add_argument('--mean', help='mean image (.npy); default: the '
                                  'embedded set\'s, or none')
    p.add_argument('--arch', '-a', choices=sorted(models.ARCHS),
                   help="default: nin, or smallcnn for the embedded set")
    p.add_argument('--n-classes', type=int, default=None,
                   help='default: 1000, or 8 for the embedded set')
    p.add_argument('--insize', type=int, default=None,
                   help='crop size; default: 224, or 48 for the embedded set')
    p.add_argument('--communicator', default='auto',
                   choices=mnopt.communicators.NAMES)
    p.add_argument('--allreduce-grad-dtype', default=None,
                   choices=['float32', 'float16', 'bfloat16'])
    # The settings python -m mnopt.report's advice names (docs/tuning.md).
    p.add_argument('--bucket-bytes', type=_bytes_or_auto, metavar='N|auto',
                   help="bytes of gradients per averaging (auto: tuned "
                        "in the first averagings; not with --overlap or "
                        "--shard-state)")
    p.add_argument('--segment-bytes', type=_bytes_or_auto, metavar='N|auto',
                   help="the ring's message size (flat, hierarchical)")
    p.add_argument('--chunk-bytes', type=_bytes_or_auto, metavar='N|auto',
                   help='the reduction server\'s pieces (reduction_server)')
    p.add_argument('--window', type=_bytes_or_auto, metavar='N|auto',
                   help='pieces in flight (reduction_server)')
    p.add_argument('--double-buffering', action='store_true',
                   help='average the previous iteration\'s gradients '
                        'during this one (updates one step stale)')
    p.add_argument('--overlap', action='store_true',
                   help='average gradients during backward, bucket by '
                        'bucket (exact: no staleness)')
    p.add_argument('--shard-state', action='store_true',
                   help='shard the optimizer state over the ranks (ZeRO '
                        'stage 1, docs/zero.md): each rank keeps and '
                        'updates its share of the parameters; with '
                        '--overlap the gradients too (stage 2); snapshots '
                        'hold each rank\'s share in its rank file')
    p.add_argument('--accumulation-steps', type=int, default=1,
                   metavar='K', help='average and update once per K '
                   'iterations, each of --batchsize per rank: one update '
                   'over K times the batch (docs/accumulation.md); '
                   '--iteration, --epoch and the lr schedule count '
                   'iterations')
    p.add_argument('--compression', choices=['sign', 'powersgd', 'auto'],
                   help='gradient compression (docs/compression.md): sign, '
                   'majority vote of signs; powersgd, low-rank factors of '
                   'each weight matrix (a conv kernel as out x in*kh*kw); '
                   'auto, PowerSGD where it is quicker than plain')
    p.add_argument('--powersgd-rank', type=int, default=None,
                   help='rank of the factors with powersgd or auto '
                   '(default 1)')
    p.add_argument('--warmup-steps', type=int, default=0,
                   help='with --compression, iterations averaged plain '
                   'first')
    local_steps_flags.add_arguments(p)
    p.add_argument('--mnbn', action='store_true',
                   help='batch normalization over every rank\'s batch '
                        '(MultiNodeBatchNormalization; for the models with '
                        'batch normalization: smallcnn, resnet50)')
    p.add_argument('--batchsize', '-B', type=int, default=32,
                   help='per rank')
    p.add_argument('--val-batchsize', type=int, default=50)
    p.add_argument('--epoch', '-E', type=int, default=None,
                   help='default: 10, or 8 for the embedded set')
    p.add_argument('--iteration', type=int, default=None,
                   help='stop after this many iterations (overrides --epoch)')
    p.add_argument('--lr', type=float, default=None,
                   help='default: 0.01, or 0.05 for the embedded set')
    p.add_argument('--lr-schedule', choices=['constant', 'linear'],
                   default=None, help='linear: down to 0 at the end; '
                   'default: constant, or linear for the embedded set')
    p.add_argument('--out', '-o', default='result')
    p.add_argument('--resume', help="snapshot to resume from, or 'auto': "
                   "the newest one in --out that every rank holds "
                   "completely (none: start afresh); for python -m "
                   "mnopt.launch")
    p.add_argument('--snapshot-interval', type=int, default=None,
                   help='iterations between snapshots (default: each epoch)')
    p.add_argument('--async-snapshots', action='store_true',
                   help='write snapshots in the background: the state is '
                        'copied to host memory at the step, a thread '
                        'writes it (docs/reliability.md)')
    p.add_argument('--keep-snapshots', type=_positive_int, default=2,
                   help='how many of the latest snapshots in --out to '
                        'keep (at least 1): this configuration\'s whole '
                        'ones, earlier runs\' included; another '
                        'configuration\'s and damaged ones are left alone')
    p.add_argument('--loaderjob', '-j', type=int, default=0,
                   help='processes loading data per rank (0: in-process)')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--data-cache', default=os.path.join(
        os.path.expanduser('~'), '.cache', 'mnopt', 'imagenet-embedded'))
    p.add_argument('--cpu', action='store_true', help='never use a GPU')
    p.add_argument('--noplot', dest='plot', action='store_false',
                   help='draw no loss, accuracy and communication plots '
                        '(rank 0 draws them each epoch otherwise, with '
                        'matplotlib)')
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
        args.arch = args.arch or 'smallcnn'
        args.epoch = args.epoch or 8
        args.lr = args.lr or 0.05
        args.lr_schedule = args.lr_schedule or 'linear'
    args.epoch = args.epoch or 10
    args.n_classes = args.n_classes or 1000
    args.insize = args.insize or 224
    args.arch = args.arch or 'nin'
    args.lr = args.lr or 0.01
    args.lr_schedule = args.lr_schedule or 'constant'
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


def trainer_snapshot(comm, config, asynchronous=False):
    """The shared part of a snapshot: the trainer (model, optimizer state,
    iteration, epoch, rank 0's iterator, the log), the same on every rank,
    so rank 0 alone writes it, to ``snapshot_iter_N.npz`` (Chainer's
    writer renames a finished temporary file; multi_node_snapshot would
    name it ``snapshot_iter_N.npz.0``, as ChainerMN's)."""
    if comm.rank != 0:
        return lambda trainer: None
    return WarnOfOverwriting(extensions.snapshot(
        filename='snapshot_iter_{.updater.iteration}.npz',
        writer=snapshot_modes.shared_writer(asynchronous)), config)


class WarnOfOverwriting(training.Extension):
    """The trainer's snapshot ``write`` (rank 0's), warning once where it
    replaces a snapshot of another configuration (another run in the same
    --out, which reached the same iteration)."""

    priority = -100   # Chainer's snapshot's

    def __init__(self, write, config):
        self.write, self.config = write, config
        self.warned = False

    def initialize(self, trainer):
        self.write.initialize(trainer)

    def __call__(self, trainer):
        path = os.path.join(trainer.out, 'snapshot_iter_%d.npz'
                            % trainer.updater.iteration)
        if not self.warned and npz_is_whole(path):
            differs = other_config(path, self.config)
            if differs:
                self.warned = True
                print('train_imagenet.py: warning: replacing %s, a snapshot '
                      'of another run (%s); give each configuration its '
                      'own --out to keep both' % (path, differs),
                      file=sys.stderr, flush=True)
        self.write(trainer)

    def on_error(self, trainer, exc, tb):
        self.write.on_error(trainer, exc, tb)

    def finalize(self):
        self.write.finalize()


#: The name of the ``Snapshot`` extension in the trainer, so the keys under
#: which the shared file records how many ranks wrote the snapshot and the
#: write it belongs to.
RANK_SNAPSHOT = 'rank_snapshot'
N_RANKS_KEY = 'extensions/%s/n_ranks' % RANK_SNAPSHOT
WRITE_ID_KEY = 'extensions/%s/write_id' % RANK_SNAPSHOT
#: The settings a snapshot can be resumed with only alike (JSON).
CONFIG_KEY = 'extensions/%s/config' % RANK_SNAPSHOT


class Snapshot(training.Extension):
    """Every rank's own part of a snapshot, after the shared part
    (``trainer_snapshot``) of the same iteration: its iterator and random
    state in ``snapshot_iter_N.rankR.npz``, written under a temporary name
    and renamed.  Then every rank waits for all, and the snapshots in the
    output directory beyond the newest ``keep`` (an earlier run's too) are
    removed.  The shared part records the number of ranks (``serialize``),
    so a rank's missing file is never taken for a change of size.

    Every file of a snapshot records its write id: this job's (drawn by
    rank 0, one for every rank) and the iteration.  A rank file of another
    write (a crash between the shared write and a rank's, an earlier run's
    file of the same name left) is never loaded with the shared file."""

    priority = -101  # after the trainer's snapshot of the same iteration

    def __init__(self, comm, keep, optimizer=None, config=None,
                 asynchronous=False, replica=None):
        self.comm = comm
        self.keep = keep
        #: In the background: the write in flight is no snapshot yet.
        self.asynchronous = asynchronous
        self.write = snapshot_modes.RankWriter(asynchronous)
        self.config = config or {}
        self.written = None   #: the shared file this run wrote last
        self.optimizer = optimizer   #: a sharded one: its share is saved
        #: A local-steps one: the rank's model and optimizer are saved.
        self.replica = replica
        self.job = comm.everyone(secrets.token_hex(6),
                                 'the snapshots\' job id')[0]
        self.updater = None
        self._checked = {}   #: _ours' answers

    def initialize(self, trainer):
        self.updater = trainer.updater

    def write_id(self):
        return '%s.%d' % (self.job, self.updater.iteration)

    def serialize(self, serializer):
        # Only written: resume() reads them from the file before loading.
        if isinstance(serializer, chainer.serializer.Serializer):
            serializer('n_ranks', self.comm.size)
            serializer('write_id', self.write_id())
            serializer('config', json.dumps(self.config, sort_keys=True))

    def __call__(self, trainer):
        out, iteration = trainer.out, trainer.updater.iteration
        path = os.path.join(out, 'snapshot_iter_%d.npz' % iteration)
        self.write.wait()   # the previous write, in the background
        model = trainer.updater.get_optimizer('main').target
        self.write(rank_file(path, self.comm.rank),
                   _RankState(trainer.updater.get_iterator('main'),
                              self.comm.size, self.optimizer,
                              self.write_id(), self.comm,
                              model if self.replica is None else None,
                              snapshot_modes.record_epoch(trainer,
                                                          self.comm),
                              replica=self.replica))
        # Rank 0's listing, taken before anyone removes anything, says
        # what to prune; gathering it also waits until every rank's file
        # is complete.
        doomed = self.comm.allgather_obj(
            self._beyond_keep(out, iteration) if self.comm.rank == 0
            else None)[0]
        self.written = path
        for old in doomed:
            self._remove(out, old)

    def _beyond_keep(self, out, iteration):
        """The snapshots to remove: this configuration's loadable ones
        (another configuration's, and damaged or incomplete ones, are
        neither counted nor removed) but the newest ``keep``, this one
        included.  Older by the time they were written: a run on another
        number of ranks in the same --out reaches other iterations."""
        older = [i for i in snapshots_by_write(out) if i != iteration and
                 self._ours(os.path.join(out, 'snapshot_iter_%d.npz' % i))]
        keep = self.keep if self.asynchronous else self.keep - 1
        return older[:max(0, len(older) - keep)]

    def _ours(self, path):
        """Whether rank 0 can resume from ``path`` (``_resume_problem``:
        the shared file whole, rank 0's file, or on another number of
        ranks with a sharded state every rank's, whole and of its write)
        and it is of this run's configuration; remembered by the files'
        times and sizes (every zip member's CRC is read once)."""
        try:
            prefix = os.path.basename(path)[:-len('.npz')] + '.rank'
            folder = os.path.dirname(path)
            files = [path] + sorted(
                os.path.join(folder, n) for n in os.listdir(folder)
                if n.startswith(prefix) and n.endswith('.npz'))
            seen = tuple((f, s.st_mtime_ns, s.st_size) for f, s in
                         ((f, os.stat(f)) for f in files))
            if seen not in self._checked:
                self._checked[seen] = \
                    _resume_problem(path, self.comm) is None and \
                    other_config(path, self.config) is None
            return self._checked[seen]
        except (OSError, ValueError):   # removed meanwhile
            return False

    def finalize(self):
        self.write.wait()

    def _remove(self, out, iteration):
        """This rank's part of snapshot ``iteration``; on rank 0 also the
        parts of ranks an earlier, larger run had, then the shared file
        (last: without it, what is left is no snapshot)."""
        path = os.path.join(out, 'snapshot_iter_%d.npz' % iteration)
        parts = [rank_file(path, self.comm.rank)]
        if self.comm.rank == 0:
            parts += [os.path.join(out, name) for name in os.listdir(out)
                      if _part_of_a_rank_gone(name, iteration,
                                              self.comm.size)]
            parts.append(path)
        for f in parts:
            try:
                os.remove(f)
            except FileNotFoundError:
                pass


def _part_of_a_rank_gone(name, iteration, size):
    """Whether ``name`` is the part of snapshot ``iteration`` of a rank
    the run of ``size`` ranks does not have."""
    m = re.match(r'snapshot_iter_%d\.rank(\d+)\.npz$' % iteration, name)
    return m is not None and int(m.group(1)) >= size


class SnapshotTrigger(object):
    """Fires every ``interval`` and at the last iteration of the run, while
    the iterators are still alive (a finalized MultiprocessIterator cannot
    be serialized)."""

    def __init__(self, interval, length):
        self._interval = training.triggers.IntervalTrigger(*interval)
        self._length, self._unit = length
        self.fired_at = None   #: the iteration it last fired at

    def __call__(self, trainer):
        fired = self._interval(trainer)
        updater = trainer.updater
        done = (updater.iteration if self._unit == 'iteration'
                else updater.epoch_detail) >= self._length
        if fired or done:
            self.fired_at = updater.iteration
        return fired or done

    def serialize(self, serializer):
        self._interval.serialize(serializer['interval'])


class EveryAndLast(SnapshotTrigger):
    """SnapshotTrigger's firing, saved as the IntervalTrigger it extends
    (the keys of a snapshot written when the log's trigger was one)."""

    def serialize(self, serializer):
        self._interval.serialize(serializer)


class FiredWith(object):
    """Fires at the iterations ``trigger`` fired at, asked after it.  The
    rank files of a snapshot follow its shared file; a trigger of their
    own would be saved in the shared file before it is asked in that
    iteration, a step behind, and fire alone right after a resume."""

    def __init__(self, trigger):
        self._trigger = trigger

    def __call__(self, trainer):
        return self._trigger.fired_at == trainer.updater.iteration


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


#: Where a rank file holds the rank's share of a sharded optimizer's state.
SHARE_KEY = 'optimizer/'


#: Where a rank file keeps the rank's batch normalizations.
BATCH_NORMS_KEY = 'batch_norms'
#: With --local-steps, where a rank file keeps the rank's replica: its
#: model and its multi-node optimizer (inner state, local-steps state,
#: compression state).
REPLICA_MODEL_KEY, REPLICA_OPTIMIZER_KEY = 'replica/model', \
    'replica/optimizer'


class _RankState(object):
    """What differs between ranks: the iterator and its order's generator,
    the global generator the augmentation draws from, with ``optimizer``
    (a sharded one) its share of the optimizer state, with ``comm``
    this rank's compression state (error-feedback residuals; PowerSGD's
    Qs), with ``model`` its batch normalizations' running statistics,
    with ``replica`` (a local-steps optimizer: between syncs each rank's
    parameters and inner state are its own) the whole model and
    optimizer instead of those two; when saved, the snapshot's
    ``write_id``."""

    def __init__(self, iterator, size, optimizer=None, write_id=None,
                 comm=None, model=None, epoch_record=None, replica=None):
        self.iterator, self.size = iterator, size
        self.epoch_record = epoch_record or {}
        self.optimizer = optimizer
        self.write_id = write_id
        self.comm = comm
        self.model = model
        self.replica = replica

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
        if self.optimizer is not None:
            self.optimizer.serialize(serializer[SHARE_KEY.rstrip('/')])
        if self.replica is not None:
            # After the shared file (rank 0's replica): this rank's own,
            # its parameters and batch normalizations, then its optimizer
            # (its residuals with it).
            self.replica.target.serialize(serializer[REPLICA_MODEL_KEY])
            self.replica.serialize(serializer[REPLICA_OPTIMIZER_KEY])
        elif self.comm is not None:
            # The shared file, rank 0's alone, holds rank 0's residuals:
            # each rank's own make the resume exact (nothing without
            # compression; a file without them loads and changes nothing).
            self.comm.serialize_compression(serializer['compression'],
                                            shared=False)
        if self.write_id is not None:
            serializer('write_id', self.write_id)
        if isinstance(serializer, chainer.serializer.Serializer):
            # The epoch's position across ranks: a resume on another
            # number of ranks reads the rest of the epoch (snapshot_modes).
            snapshot_modes.save_record(serializer, self.epoch_record)
        if self.model is not None:
            # Each rank's batch normalizations' running statistics: they
            # follow the rank's own batches (without --mnbn), and the
            # shared file holds rank 0's.  Every rank validates its share
            # of the set with its own.  Their statistics alone: gamma and
            # beta are parameters, the shared file's (a file written
            # before holds them too, unread).
            for name, link in sorted(self.model.namedlinks()):
                if isinstance(link, chainer.links.BatchNormalization):
                    _serialize_statistics(
                        link, serializer[BATCH_NORMS_KEY + name])
        if isinstance(serializer, chainer.serializer.Deserializer):
            numpy.random.set_state(state.get_state())


def _serialize_statistics(link, serializer):
    """Save or restore the persistent values of ``link`` (a batch
    normalization's running mean, variance and count), not its
    parameters (as Chainer's ``Link.serialize`` does them)."""
    values = link.__dict__
    for name in sorted(link._persistent):
        values[name] = serializer(name, values[name])


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


#: The shared file's key that says its optimizer state is sharded (rank
#: 0's share; each rank's is in its rank file), and by how many ranks.
SHARDED_KEY = 'updater/optimizer:main/mnopt_shard/size'


def sharded_by(path):
    """How many ranks a sharded optimizer's state in the snapshot whose
    shared file is ``path`` was sharded over; None where it is not
    sharded."""
    with numpy.load(path) as f:
        return int(f[SHARDED_KEY]) if SHARDED_KEY in f.files else None


def _write_id(path, key):
    """The write id ``path`` records under ``key``, or None (a snapshot
    written before the example recorded them)."""
    with numpy.load(path) as f:
        return str(f[key]) if key in f.files else None


def mixed_writes(path, parts):
    """None if the rank files ``parts`` are of the write of the shared
    file ``path`` (or it records none: an old snapshot), else why not."""
    shared = _write_id(path, WRITE_ID_KEY)
    if shared is None:
        return None
    for part in parts:
        mine = _write_id(part, 'write_id')
        if mine != shared:
            return ('its files are of different writes (%s: write %s, %s: '
                    'write %s)' % (os.path.basename(path), shared,
                                   os.path.basename(part), mine))
    return None


def ranks_that_wrote(path):
    """How many ranks wrote the snapshot whose shared file is ``path``: the
    shared file says (a snapshot written before it did: rank 0's file), or
    None where neither does."""
    with numpy.load(path) as f:
        if N_RANKS_KEY in f.files:
            return int(f[N_RANKS_KEY])
    legacy = rank_file(path, 0)
    if npz_is_whole(legacy):
        with numpy.load(legacy) as f:
            return int(f['n_ranks'])
    return None


def resume(path, trainer, comm, optimizer, args=None):
    """Load a snapshot on every rank; every rank raises the same clear error
    if any of them cannot.  With the number of ranks it was written with,
    each rank also gets its iterator and random state back (a rank's
    missing file is an error naming it), and its share of a sharded
    optimizer's state, or with local steps its own model and optimizer
    (the shared file holds rank 0's); a local-steps snapshot whose
    settings are not ``args``' is refused before anything is loaded
    (``local_steps_flags.resume_problem``).  With another number of
    ranks, the data is split anew, the examples the interrupted epoch has
    not read are split among the ranks (rank 0's file records them:
    snapshot_modes; without that file, whole and of the same write, the
    snapshot is incomplete: a known reason; a snapshot written before the
    example recorded them restarts the epoch, with a warning), and a
    sharded optimizer's state is re-sharded from every rank file
    (``optimizer.load_shards``).
    Returns (whether the number of ranks is the same, the number of ranks
    the optimizer state was re-sharded from or None)."""
    error = None
    resharded = None
    record = {}
    try:
        if not os.path.isfile(path):
            raise KnownReason('there is no such file')
        if rank_file_problem(path):
            raise KnownReason(rank_file_problem(path))
        saved_size = ranks_that_wrote(path)
        if saved_size is None:
            raise KnownReason('it does not say how many ranks wrote it, and '
                             '%s is missing' % rank_file(path, 0))
        same_layout = saved_size == comm.size
        own = rank_file(path, comm.rank)
        if same_layout and not os.path.isfile(own):
            raise KnownReason(
                'written by %d ranks, as many as now, but rank %d\'s part '
                '%s is missing' % (saved_size, comm.rank, own))
        mixed = mixed_writes(path, [own]) if same_layout else None
        if mixed:
            raise KnownReason(mixed)
        if not same_layout:
            # Rank 0's file records the interrupted epoch's position: a
            # snapshot without it whole, of its write, is incomplete (a
            # crash at the snapshot step), never an epoch restarted.
            problem = _record_problem(path, saved_size)
            if problem:
                raise KnownReason(problem)
            record = snapshot_modes.read_record(rank_file(path, 0))
        with numpy.load(path) as f:
            epoch = int(f['updater/iterator:main/epoch'])
            # The epoch goes on where the record says: its sums too.
            skip_plots = plots.keys_to_skip(f.files,
                                            same_layout or bool(record))
            earlier_points = plots.points_of_plot_reports(f)
            position = int(f['updater/iterator:main/current_position']) \
                if 'updater/iterator:main/current_position' in f.files \
                else 0
        if not same_layout and not record and position and comm.rank == 0:
            print('train_imagenet.py: warning: %s records no position of '
                  'epoch %d across ranks (written before the example '
                  'recorded it): the epoch starts again from its beginning'
                  % (os.path.basename(path), epoch), flush=True)
        shards = sharded_by(path)
        sharded = hasattr(optimizer, 'load_shards')
        if shards is not None and not sharded:
            raise KnownReason('its optimizer state is sharded over %d ranks '
                             '(written with --shard-state): resume with '
                             '--shard-state' % shards)
        mismatch = None if args is None else \
            local_steps_flags.resume_problem(path, args)
        if mismatch:
            raise KnownReason(mismatch)
        # On another number of ranks the iterators start afresh.
        chainer.serializers.load_npz(path, trainer, ignore_names=(
            lambda key: (not same_layout and
                         key.startswith('updater/iterator:')) or
            skip_plots(key)))
        if earlier_points and comm.rank == 0:   # rank 0 plots
            trainer.get_extension(plots.NAME).points = earlier_points
        if sharded and shards is None:
            # An unsharded snapshot, split into shares: Chainer's updater
            # loads the optimizer before the model, whose lazily sized
            # layers then had no data to assign owners by; again, now.
            chainer.serializers.load_npz(path, optimizer,
                                         path='updater/optimizer:main/')
        if same_layout:
            # A sharded snapshot's rank files hold the ranks' shares; with
            # local steps each holds the rank's model and optimizer.  A
            # rank file written before it kept them has no batch
            # normalizations (no replica): they stay rank 0's.
            with numpy.load(own) as f:
                keys = f.files
            replica = local_steps_flags.local_steps_optimizer(optimizer) \
                if any(k.startswith(REPLICA_MODEL_KEY + '/')
                       for k in keys) else None
            model = trainer.updater.get_optimizer('main').target if (
                replica is None and any(k.startswith(BATCH_NORMS_KEY)
                                        for k in keys)) else None
            chainer.serializers.load_npz(
                own, _RankState(trainer.updater.get_iterator('main'),
                                comm.size, optimizer if shards else None,
                                comm=comm, model=model, replica=replica))
        else:
            _start_epoch(trainer.updater.get_iterator('main'), epoch)
        if shards is not None and (not same_layout or shards != comm.size):
            parts = [rank_file(path, r) for r in range(shards)]
            problem = (mixed_writes(path, parts) or
                       optimizer.load_shards(parts, SHARE_KEY))
            if problem is not None:
                raise KnownReason(problem)
            resharded = shards
    except KnownReason as e:
        error = (True, str(e))
    except Exception as e:
        error = (False, '%s: %s' % (type(e).__name__, e))
    bad = [(r, e) for r, e in enumerate(comm.allgather_obj(error)) if e]
    if bad:
        raise CannotResume(why_not_resumed(path, bad))
    if not same_layout:
        snapshot_modes.resume_rest_of_epoch(record, trainer, comm,
                                            os.path.basename(path))
    return same_layout, resharded


class KnownReason(ValueError):
    """A snapshot that loads no further, for a reason the example names."""


class CannotResume(Exception):
    """Every rank's one message: why the snapshot did not load."""


def why_not_resumed(path, bad):
    """One message from ``bad``, each failing rank's (rank, (whether the
    reason is known, what it says)): a reason every rank gives is said
    once; an unforeseen one (an exception the example did not raise) may
    be a damaged or foreign file, and the message says so."""
    reasons = [said for _, (_, said) in bad]
    if len(bad) > 1 and len(set(reasons)) == 1:
        told = reasons[0]
    else:
        told = '; '.join('rank %d: %s' % (r, said) for r, (_, said) in bad)
    guess = '' if all(known for _, (known, _) in bad) else \
        ' (missing, corrupt or not a snapshot of this model)'
    return 'cannot resume from %s%s: %s' % (path, guess, told)


def _resume_problem(path, comm):
    """None if this rank can resume from ``path``, else why not: the shared
    file must be whole, and on as many ranks as wrote it, this rank's own
    file too, of the same write; on another number, rank 0's file (the
    epoch's position), or with a sharded state every rank's."""
    problem = npz_problem(path)
    if problem is not None:
        return problem
    saved_size = ranks_that_wrote(path)
    if saved_size is None:
        return '%s does not say how many ranks wrote it' % (
            os.path.basename(path))
    if saved_size == comm.size:
        parts = [rank_file(path, comm.rank)]
    elif sharded_by(path) is not None:
        # Re-sharded: the state of this rank's parameters is in their
        # previous owners' files.
        parts = [rank_file(path, r) for r in range(saved_size)]
    else:
        return _record_problem(path, saved_size)
    for part in parts:
        problem = npz_problem(part)
        if problem is not None:
            return problem
    return mixed_writes(path, parts)


def _record_problem(path, saved_size):
    """None if rank 0's file of the snapshot whose shared file is
    ``path`` is whole and of the shared file's write, else why not: on
    another number of ranks it is read for the position of the
    interrupted epoch (the same in every rank file; without it the epoch
    would start again from its beginning)."""
    part = rank_file(path, 0)
    problem = npz_problem(part)
    if problem is not None:
        return ('written by %d ranks, and on another number rank 0\'s '
                'part, which records where its epoch is, is needed: %s' % (
                    saved_size, problem))
    return mixed_writes(path, [part])


def snapshot_iterations(out):
    """The iterations of the snapshots in ``out``, by their shared files'
    names, in order."""
    found = []
    for name in os.listdir(out) if os.path.isdir(out) else ():
        m = re.match(r'snapshot_iter_(\d+)\.npz$', name)
        if m:
            found.append(int(m.group(1)))
    return sorted(found)


def snapshots_by_write(out):
    """The iterations of the snapshots in ``out``, oldest written first
    (by their shared files' times; a tie by iteration)."""
    def written(i):
        try:
            return os.stat(os.path.join(
                out, 'snapshot_iter_%d.npz' % i)).st_mtime_ns, i
        except FileNotFoundError:   # removed meanwhile
            return 0, i
    return sorted(snapshot_iterations(out), key=written)


def newest_complete_snapshot(out, comm, config):
    """The newest written snapshot in ``out`` of this run's ``config``
    that every rank can resume from (a crash mid-write leaves the others
    behind; damaged bytes are found by the zip CRCs), or None; rank 0 warns
    naming each newer one skipped.  Newest by when it was written (rank
    0's listing, for every rank), not by its iteration: another run in the
    same --out.  Exits on every rank, saying why, where the newest written
    snapshot is whole and of another ``config`` (another run's folder); an
    older one of another config, reached past damaged ones, is skipped."""
    order = comm.everyone(snapshots_by_write(out) if comm.rank == 0
                          else None, 'the order of the snapshots')[0]
    position = {'snapshot_iter_%d.npz' % i: k for k, i in enumerate(order)}
    names = ['snapshot_iter_%d.npz' % i for i in snapshot_iterations(out)]
    problems = {name: _resume_problem(os.path.join(out, name), comm)
                for name in names}
    refusal = None
    if comm.rank == 0:   # the shared files: one reader says for everyone
        differs = {name: other_config(os.path.join(out, name), config)
                   for name in names if problems[name] is None}
        problems.update((n, p) for n, p in differs.items() if p)
        newest = 'snapshot_iter_%d.npz' % order[-1] if order else None
        if differs.get(newest):
            refusal = (
                '--resume auto: the newest snapshot in %s is %s, and %s. Run '
                'with its settings to continue it, give another --out to '
                'start afresh, or --resume PATH to name a snapshot' % (
                    out, newest, differs[newest]))
    # Rank 0's word, the same message on every rank.
    refusal = comm.everyone(refusal, 'whether the snapshot fits this run')[0]
    if refusal:
        refuse(comm, refusal)
    newest = newest_loadable(comm, problems,
                             key=lambda n: position.get(n, -1))
    return None if newest is None else os.path.join(out, newest)


def refuse(comm, message):
    """End the run on every rank with a non-zero status, ``message`` said
    once, by rank 0 (every rank's copy interleaved on a shared terminal).
    ``message`` must be the same on every rank (agreed).  The others wait
    until rank 0 has said it: ``python -m mpi4py`` aborts the job as soon
    as one of them exits non-zero."""
    if comm.rank == 0:
        print('train_imagenet.py: ' + message, file=sys.stderr, flush=True)
    comm.everyone(None, 'the refusal said')
    sys.exit(1)


def other_config(path, config):
    """None where the snapshot whose shared file is ``path`` was written
    with ``config`` (or records none: written before the example recorded
    it), else how the two differ, in the example's flags."""
    with numpy.load(path) as f:
        saved = json.loads(str(f[CONFIG_KEY])) if CONFIG_KEY in f.files \
            else None
    if saved is None or saved == config:
        return None
    return 'it is of a run with %s; this run has %s' % (_flags(saved),
                                                        _flags(config))


def _flags(config):
    return ' '.join('--%s %s' % (k.replace('_', '-'), v)
                    for k, v in sorted(config.items()))


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


def check_identical_parameters(model, comm, optimizer=None):
    """Raise on every rank unless all ranks hold the same parameters: with
    local steps (``optimizer``'s) the synced ones (between syncs each
    rank's own differ, by design)."""
    import contextlib
    import hashlib
    synced = getattr(optimizer, 'using_synced_parameters', None)
    h = hashlib.sha256()
    with synced() if synced is not None else contextlib.nullcontext():
        for name, p in sorted(model.namedparams()):
            if p.array is not None:
                h.update(name.encode())
                h.update(chainer.backend.CpuDevice().send(p.array).tobytes())
    digests = comm.allgather_obj(h.hexdigest())
    if len(set(digests)) != 1:
        raise RuntimeError('%sparameters differ across ranks after resuming'
                           % ('synced ' if synced is not None else ''))


def main(argv=None):
    args = parse_args(argv)
    local_steps_flags.note_lr_given(args)
    # The pipeline's settings only where given: not every communicator
    # takes them (each says so, on every rank).
    pipeline = {k: getattr(args, k) for k in (
        'bucket_bytes', 'segment_bytes', 'chunk_bytes', 'window')
        if getattr(args, k) is not None}
    try:
        comm = mnopt.create_communicator(
            args.communicator, allreduce_grad_dtype=args.allreduce_grad_dtype,
            compression=args.compression, warmup_steps=args.warmup_steps,
            powersgd_rank=args.powersgd_rank, **pipeline)
    except (ValueError, TypeError) as e:
        sys.exit('train_imagenet.py: %s' % e)
    # Before anything slow: options the optimizer refuses (--shard-state
    # with --overlap, or on a communicator without a sharded path) are
    # the same error on every rank.
    try:
        optimizer = mnopt.create_multi_node_optimizer(
            chainer.optimizers.MomentumSGD(momentum=0.9), comm,
            double_buffering=args.double_buffering, overlap=args.overlap,
            shard_state=args.shard_state,
            accumulation_steps=args.accumulation_steps,
            **local_steps_flags.optimizer_kwargs(args))
    except (ValueError, TypeError) as e:
        sys.exit('train_imagenet.py: %s' % e)
    device = choose_device(comm, args.cpu)
    check_writable(args.out, comm)
    numpy.random.seed(args.seed + comm.rank)
    train, val = load_datasets(args, comm)
    local_steps_flags.set_inner_lr(args, comm)
    optimizer.lr = args.lr   # its default depends on the data set
    model = models.ARCHS[args.arch](args.n_classes)
    if args.mnbn:
        model = mnopt.links.create_mnbn_model(model, comm)
    if device >= 0:
        model.to_gpu()
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
    if args.lr_schedule == 'linear':
        last = args.iteration or args.epoch * len(train_iter.dataset) \
            // args.batchsize
        trainer.extend(extensions.LinearShift(
            'lr', (args.lr, 0.0), (0, last)))

    log_every = (1, 'iteration') if args.iteration and \
        args.iteration <= 20 else (5, 'iteration')

    # The log, its table and the validation also at the last iteration
    # (a run of 54 iterations logged at 50 last: its end never showed).
    def log_interval():
        return EveryAndLast(log_every, stop)
    val_interval = EveryAndLast((1, 'epoch'), stop) \
        if not args.iteration else stop
    snapshot_interval = ((args.snapshot_interval, 'iteration')
                         if args.snapshot_interval else (1, 'epoch'))
    evaluator = local_steps_flags.evaluating_synced(
        extensions.Evaluator(val_iter, model, device=device), optimizer)
    trainer.extend(mnopt.create_multi_node_evaluator(evaluator, comm),
                   trigger=val_interval, name='validation')
    throughput = run_summary.Throughput(optimizer,
                                        args.batchsize * comm.size)
    trainer.extend(throughput)
    if device >= 0:
        trainer.extend(SeedGpuRandom(args.seed, comm.rank))
    snapshot_trigger = SnapshotTrigger(snapshot_interval, stop)
    config = {'arch': args.arch, 'n_classes': args.n_classes,
              'insize': args.insize}
    trainer.extend(trainer_snapshot(comm, config, args.async_snapshots),
                   name='snapshot', trigger=snapshot_trigger)
    rank_snapshot = Snapshot(
        comm, args.keep_snapshots, optimizer if args.shard_state else None,
        config, args.async_snapshots,
        replica=local_steps_flags.local_steps_optimizer(optimizer))
    trainer.extend(rank_snapshot, name=RANK_SNAPSHOT,
                   trigger=FiredWith(snapshot_trigger))
    # Each step's communication (comm/exposed, comm/hidden, comm/busbw,
    # comm/straggler, ...: docs/observability.md), on every rank: the ranks
    # exchange who arrived last once per log interval.
    communication = mnopt.extensions.CommunicationReport(
        comm, trigger=log_every, at_end=True)
    trainer.extend(communication)
    if comm.rank == 0:   # the other ranks stay quiet unless they fail
        trainer.extend(extensions.LogReport(trigger=log_interval()))
        trainer.extend(extensions.observe_lr(), trigger=log_interval())
        # Within 80 columns, in units (table.py).
        # Named as the PrintReport it replaced: its snapshot keys.
        trainer.extend(table.Table(), trigger=log_interval(),
                       name='PrintReport')
        trainer.extend(extensions.ProgressBar(update_interval=1))
        # Loss, accuracy, and the seconds per step blocked on
        # communication and hidden behind compute: means per epoch, drawn
        # at the end of each (drawn every iteration, matplotlib made rank 0
        # a quarter second late to every step of a short run).  Kept with
        # --noplot too, undrawn, so a run with plots can resume from it.
        trainer.extend(plots.EpochPlots(draw=args.plot), name=plots.NAME,
                       trigger=plots.every_iteration)

    if comm.rank == 0:
        print(run_summary.wrapped(
            'mnopt ImageNet example: %d ranks, communicator %s, %s, %s, %s, '
            'batch %d per rank, %d training images'
            % (comm.size, comm.name, run_summary.modes(args, comm),
               args.arch, 'GPU' if device >= 0 else 'CPU', args.batchsize,
               len(train) * comm.size)))
    if args.resume == 'auto':
        args.resume = newest_complete_snapshot(args.out, comm, config)
        if comm.rank == 0 and os.environ.get('MNOPT_RESTART', '0') != '0':
            print('restart %s: %s' % (os.environ['MNOPT_RESTART'], (
                'resuming from ' + args.resume) if args.resume else
                'no complete snapshot yet, starting afresh'))
    if args.resume:
        try:
            same, resharded = resume(args.resume, trainer, comm, optimizer,
                                     args)
        except CannotResume as e:
            refuse(comm, str(e))
        check_identical_parameters(model, comm, optimizer)
        local_steps_flags.warn_of_resumed_lr(args, comm, same)
        if comm.rank == 0:
            print('resumed from %s at iteration %d%s%s' % (
                args.resume, updater.iteration,
                '' if same else ' (data split anew for %d ranks)' % comm.size,
                '' if resharded is None else ' (optimizer state re-sharded '
                'from %d to %d ranks)' % (resharded, comm.size)))
    start = time.perf_counter()
    trainer.run()
    wire = 4 if str(comm.allreduce_grad_dtype or 'float32') == 'float32' \
        else 2
    run_summary.summary(
        trainer, comm, args, throughput, comm.averaging_seconds,
        time.perf_counter() - start, report=communication,
        snapshot=rank_snapshot.written, gradient_bytes=wire * sum(
            p.size for p in model.params() if p.array is not None))
    return trainer


if __name__ == '__main__':
    main()
