"""ObservationAggregator: a reported value averaged over ranks."""

import numpy
from chainer.training import extension
from chainer.training import trigger as trigger_module

from mnopt.extensions._values import to_float


def _mean_of_everything(histories):
    """ChainerMN's default: the mean over ranks and reports."""
    return float(numpy.mean([v for h in histories for v in h]))


class ObservationAggregator(extension.Extension):
    """Every ``comm_trigger``, replace ``trainer.observation[aggregated_key]``
    by ``aggregator`` of every rank's values of ``original_key`` reported
    since the last time (default: their mean over ranks and iterations).

    Every rank must report the key at the same iterations: where some do
    and some do not, every rank raises ValueError naming them (ChainerMN
    waits forever there)."""

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

    def __call__(self, trainer):
        observation = trainer.observation
        value = observation.get(self.original_key)
        self.observation_history.append(
            None if value is None else to_float(value))
        if not self.comm_trigger(trainer):
            return
        histories = self.comm.allgather_obj(self.observation_history)
        self.observation_history = []
        presence = [[v is not None for v in h] for h in histories]
        if any(p != presence[0] for p in presence):
            raise ValueError(
                'ObservationAggregator: ranks reported %r at different '
                'iterations: %s' % (self.original_key, '; '.join(
                    'rank %d: %s' % (r, ''.join('x' if x else '.' for x in p))
                    for r, p in enumerate(presence))))
        values = [[v for v in h if v is not None] for h in histories]
        if values[0]:
            observation[self.aggregated_key] = self.aggregator(values)
