"""create_synchronized_iterator: every rank draws the same shuffled order
from its own copy of the dataset (no batches sent)."""

import numpy
from chainer.dataset import iterator as iterator_module
from chainer.iterators import ShuffleOrderSampler

from mnopt.communicators.any_communicator import same_on_every_rank


class _SynchronizedIterator(iterator_module.Iterator):
    """``actual_iterator`` with an order sampler seeded alike on every
    rank; everything else (attributes, serialization) is the wrapped
    iterator's."""

    def __init__(self, actual_iterator, communicator, seed):
        object.__setattr__(self, 'actual_iterator', actual_iterator)
        object.__setattr__(self, 'communicator', communicator)
        actual_iterator.order_sampler = ShuffleOrderSampler(
            numpy.random.RandomState(seed))
        actual_iterator.reset()

    def __next__(self):
        return self.actual_iterator.__next__()

    next = __next__

    def serialize(self, serializer):
        self.actual_iterator.serialize(serializer)

    def finalize(self):
        actual = self.__dict__.get('actual_iterator')
        if actual is not None and hasattr(actual, 'finalize'):
            actual.finalize()

    def __getattr__(self, name):
        actual = self.__dict__.get('actual_iterator')
        if actual is None or name.startswith('__'):
            raise AttributeError(name)
        return getattr(actual, name)

    def __setattr__(self, name, value):
        # As ChainerMN's: setting an attribute sets the wrapped iterator's
        # (batch_size, order_sampler, ...).
        setattr(self.actual_iterator, name, value)


def create_synchronized_iterator(actual_iterator, communicator):
    """Make ``actual_iterator`` (a SerialIterator, MultiprocessIterator...:
    one with an ``order_sampler``) draw the same order on every rank: its
    order sampler is replaced by a ShuffleOrderSampler seeded from rank 0,
    and it is reset.  Every rank must hold a dataset of the same length;
    an iterator without ``order_sampler`` (or datasets of different
    lengths) is a ValueError on every rank."""
    try:
        length = len(actual_iterator.dataset)
    except Exception as e:   # every rank must hear of it, not wait
        length = 'no dataset length (%s: %s)' % (type(e).__name__, e)
    has_sampler = hasattr(actual_iterator, 'order_sampler')
    missing = communicator.allgather_obj(not has_sampler)
    if any(missing):
        raise ValueError('actual_iterator must have order_sampler (ranks '
                         'whose iterator has none: %s)'
                         % [r for r, m in enumerate(missing) if m])
    same_on_every_rank(communicator, 'the length of the dataset of '
                       'create_synchronized_iterator', length)
    seed = communicator.bcast_obj(
        numpy.random.randint(0, 2 ** 32 - 1) if communicator.rank == 0
        else None, root=0)
    return _SynchronizedIterator(actual_iterator, communicator, seed)
