"""Loading a snapshot whose iterators read shards of another length (a
resume on another number of ranks: ``scatter_dataset`` gave each rank
another share of the data).

A shuffled iterator's saved ``order`` is a permutation of its old shard's
positions: it means nothing for the new shard (and Chainer cannot load it
into an order of another length).  Such an iterator goes on in the same
epoch, at about the same fraction of it (its position scaled to the new
shard: ``epoch_detail`` continues, so epoch triggers and schedules do), in
a new order drawn by its own order sampler; the examples that new order
puts before that position are not read again until the next epoch, so no
example is read twice in an epoch on a rank.  Every rank learns which
ranks' iterators were rebuilt, and rank 0 warns once.

The scaled position is moved back (by less than a batch) to where the
rest of the epoch is a whole number of batches: otherwise the batch that
ends the epoch would also take the next epoch's first examples, from a
newly drawn order that may repeat one just read, so that batch (the one
``is_new_epoch`` marks as the epoch's last) would hold an example twice.
Both of Chainer's iterators (``SerialIterator``, ``MultiprocessIterator``)
step the same state machine and behave alike here.

Iterators over a ``scatter_dataset`` share whose snapshot records the
epoch's position across ranks are then placed at the rest of that epoch,
split among the ranks (mnopt/iterators/epoch_position.py): no example of
the epoch is read twice or skipped, on any number of ranks.

Iterators that save no order (``shuffle=False``) load as Chainer loads
them.  Only iterators at Chainer's serialization paths are found: a
trainer's ``updater/iterator:NAME`` or an updater's ``iterator:NAME``.
"""

import numpy
from chainer.serializers import NpzDeserializer

from mnopt.common import log
from mnopt.iterators.epoch_position import SEEN_KEY, resume_epochs

logger = log.get(__name__)


class _Overlay(object):
    """A snapshot's arrays with some replaced and some hidden (as if not
    saved: Chainer then works them out itself)."""

    def __init__(self, npz, replaced, hidden):
        self.npz, self.replaced, self.hidden = npz, replaced, hidden

    def __contains__(self, key):
        return key in self.replaced or (key in self.npz and
                                        key not in self.hidden)

    def __getitem__(self, key):
        if key in self.replaced:
            return self.replaced[key]
        if key in self.hidden:
            raise KeyError(key)
        return self.npz[key]


def _live_iterator(target, group):
    """The iterator of ``target`` that serializes to ``group`` (a key
    prefix ending in '/'), or None."""
    parts = group.strip('/').split('/')
    obj = target
    if parts[0] == 'updater' and hasattr(obj, 'updater'):
        obj, parts = obj.updater, parts[1:]
    if len(parts) != 1 or not parts[0].startswith('iterator:') or \
            not hasattr(obj, 'get_iterator'):
        return None
    try:
        return obj.get_iterator(parts[0][len('iterator:'):])
    except KeyError:
        return None


def _aligned(position, n, batch_size):
    """The greatest position not after ``position`` from which the rest of
    an epoch of ``n`` examples is whole batches of ``batch_size`` (the
    epoch's last batch ends it exactly); ``position`` itself when there is
    none (fewer examples before it than ``n % batch_size``) or no batch
    size."""
    if not batch_size or batch_size <= 0:
        return position
    back = (position - n) % batch_size
    return position - back if position - back >= 0 else position


def _rebuilt(npz, target):
    """(replaced, hidden, descriptions) for the iterators whose saved
    order is of another length than their dataset now."""
    replaced, hidden, notes = {}, set(), []
    for key in npz.files:
        if not key.endswith('/order'):
            continue
        group = key[:-len('order')]
        if group + 'current_position' not in npz.files:
            continue
        order = npz[key]
        live = _live_iterator(target, group)
        dataset = getattr(live, 'dataset', None)
        if order.ndim != 1 or dataset is None or len(dataset) == len(order):
            continue
        n_old, n = len(order), len(dataset)
        saved = int(npz[group + 'current_position'])
        position = _aligned(saved * n // n_old, n,
                            getattr(live, 'batch_size', None))
        sampler = getattr(live, 'order_sampler', None)
        new_order = sampler(numpy.arange(n), position) if sampler else \
            numpy.random.permutation(n)
        replaced[group + 'current_position'] = numpy.asarray(position)
        replaced[key] = numpy.asarray(new_order)
        # Chainer guesses it from the position, as for an older file.
        hidden.add(group + 'previous_epoch_detail')
        if group + SEEN_KEY in npz.files:
            continue   # placed by the epoch's record (epoch_position.py)
        notes.append('%s: %d examples saved at %d, %d now, resumed at %d'
                     % (group.rstrip('/'), n_old, saved, n, position))
    return replaced, hidden, notes


def load_resizing_iterators(path, target, comm, what):
    """``chainer.serializers.load_npz(path, target)``, with each iterator
    whose shard changed length rebuilt as the module says.  Collective:
    every rank calls it (with its own file); rank 0 warns, naming each
    rank's rebuilt iterators.  Returns this rank's notes."""
    problem = None
    with numpy.load(path) as npz:
        replaced, hidden, notes = _rebuilt(npz, target)
        try:
            NpzDeserializer(_Overlay(npz, replaced, hidden)).load(target)
        except (ValueError, KeyError, TypeError) as e:
            # Said on every rank below: another job's snapshot in the
            # folder (other shapes, other names) is no bare NumPy error.
            problem = '%s: %s: %s' % (path, type(e).__name__, e)
        record = {k: npz[k] for k in npz.files if '/mnopt_epoch' in k}
    problems = [p for p in comm.everyone(problem, what + ': loaded') if p]
    if problems:
        raise ValueError(
            '%s does not fit this model (%s): is it another run\'s or '
            'another model\'s snapshot?  Move it out of the folder, or give '
            'this run a folder of its own' % (what, '; '.join(problems)))
    placed = resume_epochs(record, target, comm, what)
    if placed and comm.rank == 0:
        logger.info('mnopt: %s: %s', what, '; '.join(placed))
    said = comm.everyone(notes, what + ': iterators rebuilt')
    rebuilt = ['rank %d: %s' % (r, n) for r, ns in enumerate(said)
               for n in ns]
    if rebuilt and comm.rank == 0:
        # A report, not a fault in the user's code: logger
        # mnopt.iterators.resize (mnopt/common/log.py).
        logger.warning(
            'mnopt: warning: %s: the iterators read shards of another length '
            'than when it was saved (another number of ranks); each goes on '
            'in the same epoch at the same fraction of it, in a new order of '
            'its shard (mnopt.iterators.resize): %s', what, '; '.join(rebuilt))
    return notes
