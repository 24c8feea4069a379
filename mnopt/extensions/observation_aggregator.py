"""ObservationAggregator: a reported value averaged over ranks."""

import chainer
import numpy
from chainer.training import extension
from chainer.training import trigger as trigger_module


def _mean_of_everything(histories):
    """ChainerMN's default: the sum of every rank's values since the last
    time, divided by their number (Variables stay Variables, NumPy
    scalars NumPy scalars)."""
    values = [v for h in histories for v in h]
    return sum(values) / len(values)


def _on_host(value):
    """``value`` with its array in host memory (a CuPy or ChainerX array
    would not unpickle on another rank's device); the observation itself
    is left as it is."""
    array = value.array if isinstance(value, chainer.Variable) else value
    if chainer.backend.get_array_module(array) is numpy:
        return value
    array = chainer.backend.CpuDevice().send(array)
    return chainer.Variable(array) if isinstance(value, chainer.Variable) \
        else array


class ObservationAggregator(extension.Extension):
    """Every ``comm_trigger``, set ``trainer.observation[aggregated_key]``
    to ``aggregator`` of every rank's values of ``original_key`` reported
    since the last time (default: their sum divided by their number, of
    the reported type: a Variable, a NumPy scalar...), computed on rank 0
    and broadcast, as ChainerMN's.  Values move in host memory.

    Every rank must report the key at the same iterations: where some do
    and some do not, every rank raises ValueError naming them."""

    trigger = 1, 'iteration'
    priority = extension.PRIORITY_EDITOR
    name = None

    def __init__(self, comm, original_key, aggregated_key=None, *,
                 comm_trigger=(1, 'iteration'), aggregator=None):
        self.comm = comm
        self.original_key = original_key
        self.aggregated_key = aggregated_key or original_key
        self.comm_trigger = trigger_module.get_trigger(comm_trigger)
        self.aggregator = aggregator or _mean_of_everything
        self.observation_history = []

    def _summary(self, histories):
        """On rank 0: ('ok', the summary or None) or ('error', why)."""
        presence = [[v is not None for v in h] for h in histories]
        if any(p != presence[0] for p in presence):
            return ('error', 'ObservationAggregator: ranks reported %r at '
                    'different iterations: %s' % (self.original_key, '; '.join(
                        'rank %d: %s' % (r, ''.join('x' if x else '.'
                                                    for x in p))
                        for r, p in enumerate(presence))))
        values = [[v for v in h if v is not None] for h in histories]
        if not values[0]:
            return ('ok', None)
        try:
            return ('ok', self.aggregator(values))
        except Exception as e:
            return ('error', 'ObservationAggregator: the aggregator failed '
                    'on rank 0: %s: %s' % (type(e).__name__, e))

    def __call__(self, trainer):
        observation = trainer.observation
        value = observation.get(self.original_key)
        self.observation_history.append(
            None if value is None else _on_host(value))
        if not self.comm_trigger(trainer):
            return
        histories = self.comm.gather_obj(self.observation_history, root=0)
        self.observation_history = []
        outcome = self.comm.bcast_obj(
            self._summary(histories) if self.comm.rank == 0 else None,
            root=0)
        if outcome[0] == 'error':
            raise ValueError(outcome[1])
        if outcome[1] is not None:
            observation[self.aggregated_key] = outcome[1]
