"""create_multi_node_iterator: the batches of one rank's iterator on every
rank (model parallelism: one rank reads the input data).

The master rank iterates its ``actual_iterator`` and broadcasts each batch
with the iterator's counters; the other ranks (ChainerMN's slaves) hold no
data and follow.  Both are ``chainer.dataset.Iterator``s, so Chainer's
updaters and evaluators take them.  Whatever the master's iterator raises
(end of a non-repeating epoch, a batch that is not arrays, a dataset
error) every rank raises, so no rank is left waiting for a batch.
"""

import builtins
import numbers

import chainer
from chainer.dataset import iterator as iterator_module

from mnopt.communicators.any_communicator import same_on_every_rank


def _is_array_example(example):
    """ChainerMN's rule for what a batch may hold: arrays (or NumPy
    scalars), or tuples of them (a TupleDataset's examples).  Python
    numbers pass too (ChainerMN turns every batch into arrays; they are
    the scalars its error message names); strings, dicts, None do not."""
    if isinstance(example, tuple):
        return len(example) > 0 and all(map(_is_array_or_number, example))
    return _is_array_or_number(example)


def _is_array_or_number(value):
    return hasattr(value, 'dtype') or (
        isinstance(value, numbers.Number) and not isinstance(value, bool))


def _check_batch(batch):
    for example in batch:
        if not _is_array_example(example):
            raise TypeError(
                'Multi node iterator supports ndarray or tuple of scalars as '
                'the data type of the batch element only, not %s'
                % type(example).__name__)
    return batch


def _counters(actual_iterator):
    """What the other ranks mirror of the master's iterator after each
    step."""
    it = actual_iterator
    return {'epoch': it.epoch,
            'is_new_epoch': it.is_new_epoch,
            'epoch_detail': it.epoch_detail,
            'previous_epoch_detail': getattr(it, 'previous_epoch_detail',
                                             None),
            'current_position': getattr(it, 'current_position', None)}


def _serialized_state(actual_iterator):
    """The values ``actual_iterator.serialize`` writes (``current_position``,
    ``epoch``, ``is_new_epoch``, ``order``, ...), through Chainer's
    public serializer protocol."""
    serializer = chainer.serializers.DictionarySerializer()
    actual_iterator.serialize(serializer)
    return serializer.target


def _raise_like(kind, text, rank_master):
    """On a rank that is not the master: the master's error, as the same
    built-in exception where it is one."""
    if kind == 'StopIteration':
        raise StopIteration
    cls = getattr(builtins, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = RuntimeError
    raise cls('on the master rank %d: %s' % (rank_master, text))


class _MultiNodeIterator(iterator_module.Iterator):
    """What master and slaves share: one broadcast per step, the master's
    result or its error."""

    def _exchange(self, produce=None):
        """On the master: ``produce()``, broadcast to every rank; on the
        others: what the master broadcast.  An exception on the master
        (StopIteration included) is raised on every rank."""
        comm, root = self.communicator, self.rank_master
        if not self.is_master:
            message = comm.bcast_obj(None, root=root)
            if message[0] == 'error':
                self._adopt_counters(message[3])
                _raise_like(message[1], message[2], root)
            return message[1]
        try:
            value = produce()
        except BaseException as e:
            counters = None
            try:
                counters = _counters(self.actual_iterator)
            except Exception:
                pass
            comm.bcast_obj(('error', type(e).__name__, str(e), counters),
                           root=root)
            raise
        comm.bcast_obj(('ok', value), root=root)
        return value


class _MultiNodeIteratorMaster(_MultiNodeIterator):

    is_master = True

    def __init__(self, actual_iterator, communicator, rank_master):
        self.actual_iterator = actual_iterator
        self.communicator = communicator
        self.rank_master = rank_master
        self._exchange(lambda: (_counters(actual_iterator),
                                getattr(actual_iterator, 'batch_size',
                                        None)))

    def __next__(self):
        def next_batch():
            batch = _check_batch(self.actual_iterator.__next__())
            return batch, _counters(self.actual_iterator)
        return self._exchange(next_batch)[0]

    next = __next__

    def _adopt_counters(self, counters):
        pass   # the master's counters are its iterator's

    def reset(self):
        def reset():
            self.actual_iterator.reset()
            return _counters(self.actual_iterator)
        self._exchange(reset)

    def serialize(self, serializer):
        """Serialize the master's iterator; the other ranks, which must call
        ``serialize`` at the same time, write (or load and then take) its
        values."""
        def serialize():
            self.actual_iterator.serialize(serializer)
            return (_serialized_state(self.actual_iterator),
                    _counters(self.actual_iterator))
        self._exchange(serialize)

    def finalize(self):
        actual = self.__dict__.get('actual_iterator')
        if actual is not None and hasattr(actual, 'finalize'):
            actual.finalize()

    @property
    def epoch(self):
        return self.actual_iterator.epoch

    @property
    def is_new_epoch(self):
        return self.actual_iterator.is_new_epoch

    @property
    def epoch_detail(self):
        return self.actual_iterator.epoch_detail

    @property
    def previous_epoch_detail(self):
        return getattr(self.actual_iterator, 'previous_epoch_detail', None)

    @property
    def current_position(self):
        return self.actual_iterator.current_position

    def __getattr__(self, name):
        # Everything else (batch_size, dataset, order_sampler, ...) is the
        # master's iterator's, as in ChainerMN.
        actual = self.__dict__.get('actual_iterator')
        if actual is None or name.startswith('__'):
            raise AttributeError(name)
        return getattr(actual, name)


class _MultiNodeIteratorSlave(_MultiNodeIterator):

    is_master = False

    def __init__(self, communicator, rank_master):
        self.communicator = communicator
        self.rank_master = rank_master
        self.epoch, self.is_new_epoch = 0, False
        self.epoch_detail, self.previous_epoch_detail = 0.0, None
        self.current_position = 0
        self._order = None   # the master's order, as of the last serialize
        self._other_state = {}
        counters, self.batch_size = self._exchange()
        self._adopt_counters(counters)

    def _adopt_counters(self, counters):
        if counters:
            for name, value in counters.items():
                setattr(self, name, value)

    def __next__(self):
        batch, counters = self._exchange()
        self._adopt_counters(counters)
        return batch

    next = __next__

    def reset(self):
        self._adopt_counters(self._exchange())

    def _adopt_state(self, state):
        state = dict(state)
        for name, kind in (('current_position', int), ('epoch', int),
                           ('is_new_epoch', bool)):
            if name in state:
                setattr(self, name, kind(state.pop(name)))
        self._order = state.pop('order', None)
        self._other_state = state

    def _state_value(self, key):
        if key == 'order':
            return self._order
        if key in ('current_position', 'epoch', 'is_new_epoch'):
            return getattr(self, key)
        return self._other_state[key]

    def serialize(self, serializer):
        """Write the master's iterator state (the same keys a Chainer
        iterator writes, so a plain iterator can load this rank's file),
        or read this rank's and then take the master's: the batches are
        the master's, so its state wins."""
        state, counters = self._exchange()
        saving = isinstance(serializer, chainer.serializer.Serializer)
        if saving:
            self._adopt_state(state)
        for key in state:
            try:
                serializer(key, self._state_value(key))
            except KeyError:
                # A file written before this rank recorded every key: the
                # master's values below are what counts.
                if saving:
                    raise
        self._adopt_state(state)
        self._adopt_counters(counters)


def create_multi_node_iterator(actual_iterator, communicator, rank_master=0):
    """An iterator whose batches come from ``actual_iterator`` on
    ``rank_master`` and are broadcast to every rank (model parallelism:
    only one rank holds the input data).  Other ranks may pass any
    iterator (or None): it is not read.

    Every rank gets the master's batch as it is.  As in ChainerMN, a batch
    must hold arrays (or NumPy scalars) or tuples of them, otherwise every
    rank raises TypeError; ``serialize`` (and ``reset``) must be called on
    every rank at the same time."""
    same_on_every_rank(communicator,
                       'rank_master of create_multi_node_iterator',
                       rank_master)
    if not 0 <= rank_master < communicator.size:
        raise ValueError('rank_master %d is not a rank of a communicator of '
                         'size %d' % (rank_master, communicator.size))
    if communicator.rank == rank_master:
        return _MultiNodeIteratorMaster(actual_iterator, communicator,
                                        rank_master)
    return _MultiNodeIteratorSlave(communicator, rank_master)
