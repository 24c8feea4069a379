"""The example's snapshot modes beside train_imagenet.py: written in the
background (``--async-snapshots``: the state copied to host memory at the
step, a thread writes it under a temporary name, flushes, reads it back
and renames it), and the epoch's position across ranks in every rank file,
so that a resume on another number of ranks reads the rest of the
interrupted epoch, split among the new ranks (mnopt's
mnopt/iterators/epoch_position.py)."""

import functools
import os

import chainer
import numpy
from chainer.training import extensions

from mnopt.extensions.background_writer import BackgroundWriter
from mnopt.iterators.epoch_position import epoch_record, resume_epochs

#: Where a rank file keeps the epoch's position across ranks.
EPOCH_RECORD = 'epoch_record/'


def shared_writer(asynchronous):
    """The writer of the shared file (rank 0's): uncompressed (10x faster
    to write; the parameters compress little), in the background with
    ``asynchronous``.  (The writer's own keywords would not do: Chainer
    7.8's Writer.save calls the save function without them.)"""
    if asynchronous:
        return BackgroundWriter(compression=False)
    return extensions.snapshot_writers.SimpleWriter(
        savefun=functools.partial(chainer.serializers.save_npz,
                                  compression=False))


def atomic_save(path, obj):
    tmp = path + '.tmp%d' % os.getpid()
    chainer.serializers.save_npz(tmp, obj, compression=False)  # 10x faster
    os.replace(tmp, path)


class RankWriter(object):
    """Writes a rank's file: in line (a temporary name, renamed), or with
    ``asynchronous`` in the background.  ``wait()`` waits for a write in
    flight and raises its error."""

    def __init__(self, asynchronous):
        self.background = BackgroundWriter(compression=False) \
            if asynchronous else None

    def __call__(self, path, obj):
        if self.background is None:
            atomic_save(path, obj)
            return
        state = {}
        chainer.serializers.DictionarySerializer(state).save(obj)
        self.background(os.path.basename(path), os.path.dirname(path) or
                        '.', state)

    def wait(self):
        if self.background is not None:
            self.background.wait()


def record_epoch(trainer, comm):
    """The epoch's position across ranks, keys prefixed for a rank file
    (collective: every rank calls it at the snapshot)."""
    return {EPOCH_RECORD + k: v for k, v in
            epoch_record(trainer, comm).items()}


def save_record(serializer, record):
    for key, value in sorted(record.items()):
        serializer(key, value)


def read_record(path):
    """The epoch record of the rank file ``path`` ({} where it has none:
    written before the example recorded it, or missing)."""
    try:
        with numpy.load(path) as f:
            return {k[len(EPOCH_RECORD):]: f[k] for k in f.files
                    if k.startswith(EPOCH_RECORD)}
    except OSError:
        return {}


def resume_rest_of_epoch(record, trainer, comm, what):
    """Place the iterator at the rest of the recorded epoch, split among
    this job's ranks (collective); rank 0 says so."""
    notes = resume_epochs(record, trainer, comm, what)
    if notes and comm.rank == 0:
        print('%s: %s' % (what, '; '.join(notes)), flush=True)
