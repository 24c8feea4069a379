"""The epoch's position across ranks: which examples of the whole dataset
an interrupted epoch has read, recorded in each snapshot, and at a resume
on any number of ranks the rest of that epoch split among the ranks, so
that over the epoch no example is read twice and none is skipped.

It works for iterators (Chainer's ``SerialIterator`` and
``MultiprocessIterator``) over a ``scatter_dataset`` share
(``mnopt.datasets.scatter.ScatteredDataset``, which knows the whole
dataset's index of each of its examples).

At a snapshot every rank says which of the whole dataset's examples its
iterator has read in the current epoch (its order up to its position,
mapped to the whole dataset's indices; a bit each, packed); the union is
recorded beside the iterator's own state (``ITERATOR/mnopt_epoch_seen``,
``.../mnopt_epoch`` and ``.../mnopt_epoch_n_total``), the same in every
file.

An exact resume needs shares of one length (``force_equal_length=True``,
``scatter_dataset``'s default).  With ``force_equal_length=False`` the
shares differ by one example and every rank reads a batch a step, so the
ranks' epochs drift apart: a rank of the shorter share starts its next
epoch first, and the gap grows by an epoch every few epochs.  While the
ranks are at most one epoch apart the record is of the earliest epoch: a
rank already in the next one counts its whole share as read, and what it
read of the next epoch is not recorded, so a resume (on any number of
ranks, on the same number too unless every rank is in one epoch) reads
those examples again.  Once ranks are two epochs apart no position is
recorded (rank 0 warns, once per iterator): a resume on another number of
ranks goes on as for an iterator over another dataset (``resize``).

At a resume on the number of ranks that wrote the snapshot, where what
the iterators' loaded states say they read is what the record says (each
rank loaded its own state, or all drew the same orders), they are left as
loaded: the resume is the uninterrupted run, bit for bit.  Otherwise
the examples not read yet, in the order ``scatter_dataset``
drew for the whole dataset, are cut into one share per rank exactly as
``scatter_dataset`` cuts a dataset (so with ``force_equal_length`` every
rank reads the same number and the epoch ends at the same iteration
everywhere; the padding that asks for repeats fewer than one example per
rank, as ``scatter_dataset``'s own padding does).  Each rank's share is
its dataset's *detour*, read at positions past its own examples, which
only the resumed epoch's order names: the iterator is placed that many
examples before the end of its epoch.  The next epoch is a plain epoch of
the rank's own share.  An unshuffled ``SerialIterator`` is given an order
that keeps its examples in place (so that its epoch can hold the detour).

A ``MultiprocessIterator`` must be resumed before its first batch (its
workers copy the dataset when they start): a trainer's autoload is.
"""

import weakref

import numpy
from chainer import serializer as chainer_serializer
from chainer.serializers import DictionarySerializer

from mnopt.common import log
from mnopt.datasets.scatter import ScatteredDataset, share_bounds

logger = log.get(__name__)

#: Key suffixes (beside the iterator's own state) of the record.
SEEN_KEY = 'mnopt_epoch_seen'
EPOCH_KEY = 'mnopt_epoch'
N_TOTAL_KEY = 'mnopt_epoch_n_total'
SIZE_KEY = 'mnopt_epoch_ranks'

#: iterator -> (epoch, seen): what a resume found read before it, for a
#: snapshot taken later in the same (resumed) epoch.
_read_before_resume = weakref.WeakKeyDictionary()
#: The iterators whose ranks were found two epochs apart (warned once).
_apart = weakref.WeakSet()


def scattered_iterators(target):
    """``{key prefix: iterator}`` of ``target``'s iterators (a trainer's
    ``updater/iterator:NAME/``, an updater's ``iterator:NAME/``) that read
    a ``scatter_dataset`` share."""
    prefix, updater = ('updater/', target.updater) if hasattr(
        target, 'updater') else ('', target)
    if not hasattr(updater, 'get_iterator'):
        return {}
    # Chainer's updaters name their iterators only in their private
    # dict (and when they serialize everything, the model included).
    iterators = getattr(updater, '_iterators', None) or \
        {'main': updater.get_iterator('main')}
    found = {}
    for name, it in sorted(iterators.items()):
        if isinstance(getattr(it, 'dataset', None), ScatteredDataset):
            found['%siterator:%s/' % (prefix, name)] = it
    return found


def _order(iterator):
    """The iterator's order of its examples this epoch (None: in place):
    Chainer's iterators keep it in their state (read, not serialized: a
    MultiprocessIterator that serializes drops what it prefetched), any
    other iterator as its serialize() states it."""
    state = getattr(iterator, '_state', None)
    if hasattr(state, 'order'):
        return state.order
    state = DictionarySerializer()
    iterator.serialize(state)
    return state.target.get('order')


def _read_this_epoch(iterator):
    """(epoch, bool array over the whole dataset) of what ``iterator`` has
    read in its current epoch; IndexError where its order names positions
    its dataset does not have (a detour of another process)."""
    dataset = iterator.dataset
    position = iterator.current_position
    order = _order(iterator)
    positions = numpy.arange(position) if order is None else \
        numpy.asarray(order[:position])
    positions = positions[positions >= 0]   # the resumed epoch's fillers
    if len(positions) and positions.max() >= len(dataset) + len(
            dataset.detour):
        raise IndexError('position %d of %d' % (positions.max(),
                                                 len(dataset)))
    seen = numpy.zeros(dataset.n_total, dtype=bool)
    seen[dataset.global_index(positions)] = True
    before = _read_before_resume.get(iterator)
    if before is not None and before[0] == iterator.epoch:
        seen |= before[1]
    return iterator.epoch, seen


def _union(said, dataset_n_total):
    """(epoch, seen) of the whole job from every rank's (epoch, packed
    seen, whole-share packed): the earliest epoch; a rank in the next one
    counts its whole share; None where ranks are further apart."""
    epochs = [e for e, _, _ in said]
    epoch = min(epochs)
    if max(epochs) > epoch + 1:
        return None
    seen = numpy.zeros(dataset_n_total, dtype=bool)
    for e, bits, share in said:
        packed = share if e > epoch else bits
        seen |= numpy.unpackbits(packed, count=dataset_n_total).astype(bool)
    return epoch, seen


def epoch_record(target, comm):
    """The record of every scattered iterator's epoch, as ``{key: array}``
    to write beside ``target``'s state, the same on every rank.
    Collective: every rank calls it."""
    mine = {}
    it_of = scattered_iterators(target)
    for group, it in it_of.items():
        epoch, seen = _read_this_epoch(it)
        share = numpy.zeros(it.dataset.n_total, dtype=bool)
        share[it.dataset.global_indices] = True
        mine[group] = (epoch, numpy.packbits(seen), numpy.packbits(share),
                       it.dataset.n_total)
    gathered = comm.gather_obj(mine, root=0)
    if comm.rank == 0:
        record = {}
        for group in mine:
            said = [g.get(group) for g in gathered]
            if any(s is None or s[3] != mine[group][3] for s in said):
                continue
            union = _union([s[:3] for s in said], mine[group][3])
            if union is None:
                _warn_apart(it_of[group], group, [s[0] for s in said])
                continue
            record[group + EPOCH_KEY] = numpy.asarray(union[0])
            record[group + SEEN_KEY] = numpy.packbits(union[1])
            record[group + N_TOTAL_KEY] = numpy.asarray(mine[group][3])
            record[group + SIZE_KEY] = numpy.asarray(comm.size)
    else:
        record = None
    return comm.bcast_obj(record, root=0)


def _warn_apart(iterator, group, epochs):
    if iterator in _apart:
        return
    _apart.add(iterator)
    # A report, not a fault in the user's code: logger
    # mnopt.iterators.epoch_position (mnopt/common/log.py).
    logger.warning(
        'mnopt: warning: %s: the ranks are in epochs %d to %d (shares of '
        'unequal length: scatter_dataset(force_equal_length=False)): '
        'snapshots record no position in the epoch, and a resume on another '
        'number of ranks reads examples twice or skips them; '
        'force_equal_length=True keeps the ranks in one epoch',
        group.rstrip('/'), min(epochs), max(epochs))


class _KeepOrder(object):
    """An order sampler that keeps the examples in place (an unshuffled
    iterator's order, made explicit so that a resumed epoch can hold a
    detour)."""

    def __call__(self, current_order, current_position):
        return numpy.arange(len(current_order))


class _Values(chainer_serializer.Deserializer):
    """A deserializer that hands an iterator the state it is to take (a
    missing key raises KeyError, which Chainer's iterators answer by
    working the value out)."""

    def __init__(self, values):
        self.values = values

    def __getitem__(self, key):
        return self

    def __call__(self, key, value):
        new = self.values[key]
        if isinstance(value, numpy.ndarray):
            numpy.copyto(value, new)
            return value
        return new


def _place(iterator, epoch, detour, rng):
    """Give ``iterator`` the rest of epoch ``epoch``: ``detour`` (the
    whole dataset's indices) read at the end of the epoch."""
    dataset = iterator.dataset
    n = len(dataset)
    if _order(iterator) is None:
        iterator.order_sampler = _KeepOrder()
        iterator.reset()
    shuffled = not isinstance(iterator.order_sampler, _KeepOrder)
    dataset.detour = numpy.asarray(detour, dtype=numpy.int64)
    order = numpy.full(n, -1, dtype=numpy.int64)
    tail = n + (rng.permutation(len(detour)) if shuffled
                else numpy.arange(len(detour)))
    order[n - len(detour):] = tail
    iterator.serialize(_Values({
        'current_position': n - len(detour), 'epoch': epoch,
        'is_new_epoch': False, 'order': order}))


def _rest_of_epoch(record, group, dataset, comm):
    """This rank's share of the examples the recorded epoch has not read,
    or None where nothing of it was read (it starts afresh)."""
    seen = numpy.unpackbits(record[group + SEEN_KEY],
                            count=dataset.n_total).astype(bool)
    if not seen.any():
        return None
    order = dataset.root_order
    rest = order[~seen[order]]
    begin, end = share_bounds(len(rest), comm.size,
                              dataset.force_equal_length)[comm.rank]
    return rest[begin:end]


def _loaded_as_read(npz, group, iterator, comm):
    """Whether the iterators as loaded already read the rest of the
    recorded epoch exactly: the same number of ranks, and what their
    states say they read is what the record says (each rank loaded its
    own state, or every rank drew the same orders); then they are left as
    loaded, and a resume is bit for bit the uninterrupted run.
    Collective."""
    try:
        epoch, claimed = _read_this_epoch(iterator)
        mine = (epoch, numpy.packbits(claimed))
    except IndexError:
        mine = None
    said = comm.allgather_obj(mine)
    size = int(npz[group + SIZE_KEY]) if group + SIZE_KEY in npz else None
    if size != comm.size:
        return False
    epoch = int(npz[group + EPOCH_KEY])
    if any(s is None or s[0] != epoch for s in said):
        return False
    union = numpy.bitwise_or.reduce([s[1] for s in said])
    return numpy.array_equal(union, npz[group + SEEN_KEY])


def resume_epochs(npz, target, comm, what):
    """Place every scattered iterator of ``target`` (just loaded from
    ``npz``, a mapping of the snapshot's arrays) at the rest of its
    recorded epoch.  Collective.  Returns this rank's notes, one per
    iterator resumed mid-epoch; an iterator without a record (an older
    snapshot) or of another dataset is left as loaded."""
    notes, problem = [], None
    rng = numpy.random.RandomState()
    for group, it in scattered_iterators(target).items():
        if group + SEEN_KEY not in npz or \
                int(npz[group + N_TOTAL_KEY]) != it.dataset.n_total:
            continue
        if _loaded_as_read(npz, group, it, comm):
            continue
        epoch = int(npz[group + EPOCH_KEY])
        rest = _rest_of_epoch(npz, group, it.dataset, comm)
        if rest is None:   # at the epoch's start: as loaded, at 0
            it.serialize(_Values({'current_position': 0, 'epoch': epoch,
                                  'is_new_epoch': it.is_new_epoch,
                                  'order': _order(it)}))
            continue
        if len(rest) > len(it.dataset):
            problem = ValueError(
                '%s: %s: %d examples of the interrupted epoch fall to this '
                'rank, more than its share of %d: scatter the same dataset '
                'with the same force_equal_length as the run that wrote the '
                'snapshot' % (what, group.rstrip('/'), len(rest),
                              len(it.dataset)))
            continue
        _place(it, epoch, rest, rng)
        seen = numpy.unpackbits(npz[group + SEEN_KEY],
                                count=it.dataset.n_total).astype(bool)
        _read_before_resume[it] = (epoch, seen)
        notes.append('%s: epoch %d resumed with %d of its examples not '
                     'read yet, %d of them here' % (
                         group.rstrip('/'), epoch,
                         int((~seen).sum()), len(rest)))
    comm.raise_together(problem, what + ': the rest of the epoch')
    return notes
