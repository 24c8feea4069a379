"""ChainerMN's iterators: one rank's batches for every rank, and the same
shuffled order on every rank.

Both check at creation that the ranks agree (which rank is the master, how
long the dataset is) and raise the same error on every rank if not, instead
of leaving some ranks waiting for batches that never come.
"""

import numpy
from chainer.iterators import ShuffleOrderSampler


def _agree(communicator, what, value):
    """Raise ValueError on every rank unless every rank passed the same
    ``value``."""
    values = communicator.allgather_obj(value)
    if any(v != values[0] for v in values):
        raise ValueError('ranks disagree on %s: %s' % (what, ', '.join(
            'rank %d: %r' % rv for rv in enumerate(values))))


class _MultiNodeIterator(object):
    """The master iterates ``actual_iterator``; every rank receives each
    batch (with the epoch counters) by broadcast.  At the end of a
    non-repeating iterator every rank raises StopIteration together."""

    def __init__(self, actual_iterator, communicator, rank_master):
        self.actual_iterator = actual_iterator
        self.communicator = communicator
        self.rank_master = rank_master
        self.is_master = communicator.rank == rank_master
        self.epoch, self.is_new_epoch = 0, False
        self.epoch_detail, self.previous_epoch_detail = 0.0, None
        if self.is_master:
            self._take_counters()

    def _take_counters(self):
        it = self.actual_iterator
        self.epoch = it.epoch
        self.is_new_epoch = it.is_new_epoch
        self.epoch_detail = it.epoch_detail
        self.previous_epoch_detail = getattr(it, 'previous_epoch_detail',
                                             None)

    def __iter__(self):
        return self

    def __next__(self):
        message = None
        if self.is_master:
            try:
                batch = self.actual_iterator.next()
                self._take_counters()
                message = ('batch', batch, self.epoch, self.is_new_epoch,
                           self.epoch_detail, self.previous_epoch_detail)
            except StopIteration:
                message = ('stop',)
        message = self.communicator.bcast_obj(message, root=self.rank_master)
        if message[0] == 'stop':
            raise StopIteration
        (_, batch, self.epoch, self.is_new_epoch, self.epoch_detail,
         self.previous_epoch_detail) = message
        return batch

    next = __next__

    def reset(self):
        if self.is_master:
            self.actual_iterator.reset()
            self._take_counters()
        state = self.communicator.bcast_obj(
            (self.epoch, self.is_new_epoch, self.epoch_detail,
             self.previous_epoch_detail), root=self.rank_master)
        (self.epoch, self.is_new_epoch, self.epoch_detail,
         self.previous_epoch_detail) = state

    def finalize(self):
        if self.is_master and hasattr(self.actual_iterator, 'finalize'):
            self.actual_iterator.finalize()

    @property
    def batch_size(self):
        return getattr(self.actual_iterator, 'batch_size', None)

    def serialize(self, serializer):
        """The master's iterator state; the other ranks keep only the
        epoch counters (they hold no data)."""
        if self.is_master:
            self.actual_iterator.serialize(serializer)
            self._take_counters()
        else:
            self.epoch = int(serializer('epoch', self.epoch))
            self.is_new_epoch = bool(serializer('is_new_epoch',
                                                self.is_new_epoch))

    def __getattr__(self, name):
        return getattr(self.actual_iterator, name)


def create_multi_node_iterator(actual_iterator, communicator, rank_master=0):
    """An iterator whose batches come from ``actual_iterator`` on
    ``rank_master`` and are broadcast to every rank (model parallelism:
    only one rank holds the input data).  Other ranks may pass any
    iterator (or None): it is not read."""
    _agree(communicator, 'rank_master of create_multi_node_iterator',
           rank_master)
    if not 0 <= rank_master < communicator.size:
        raise ValueError('rank_master %d is not a rank of a communicator of '
                         'size %d' % (rank_master, communicator.size))
    return _MultiNodeIterator(actual_iterator, communicator, rank_master)


def create_synchronized_iterator(actual_iterator, communicator):
    """Make ``actual_iterator`` (a SerialIterator, MultiprocessIterator...
    with shuffling) draw the same order on every rank: its order sampler is
    replaced by a ShuffleOrderSampler seeded from rank 0, and it is reset.
    Every rank must hold a dataset of the same length."""
    _agree(communicator, 'the length of the dataset of '
           'create_synchronized_iterator', len(actual_iterator.dataset))
    seed = communicator.bcast_obj(
        numpy.random.randint(0, 2 ** 31) if communicator.rank == 0
        else None, root=0)
    actual_iterator.order_sampler = ShuffleOrderSampler(
        numpy.random.RandomState(seed))
    actual_iterator.reset()
    return actual_iterator
