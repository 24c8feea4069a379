"""MultiNodeEarlyStoppingTrigger: early stopping that every rank decides
alike, on the monitored value averaged over ranks."""

from chainer.training import triggers

from mnopt.communicators import any_communicator
from mnopt.extensions._values import to_float


class MultiNodeEarlyStoppingTrigger(object):
    """Chainer's EarlyStoppingTrigger, fed each time with the mean over
    ranks of ``monitor``, so every rank stops at the same iteration (a rank
    stopping alone would leave the others waiting).  Every rank must report
    ``monitor`` at the same iterations; otherwise every rank raises
    ValueError."""

    def __init__(self, comm, check_trigger=(1, 'epoch'), monitor='main/loss',
                 patience=None, mode='auto', verbose=False,
                 max_trigger=(100, 'epoch'), **kwargs):
        self.comm = comm
        self.monitor = monitor
        self.actual_trigger = triggers.EarlyStoppingTrigger(
            check_trigger=check_trigger, monitor=monitor, patience=patience,
            mode=mode, verbose=verbose and comm.rank == 0,
            max_trigger=max_trigger, **kwargs)   # patients=: the alias

    def __call__(self, trainer):
        observation = trainer.observation
        value = observation.get(self.monitor)
        values = any_communicator.everyone(
            self.comm, None if value is None else to_float(value),
            'MultiNodeEarlyStoppingTrigger (%s)' % self.monitor)
        present = [v is not None for v in values]
        if any(present) and not all(present):
            raise ValueError(
                'MultiNodeEarlyStoppingTrigger: %r was reported on ranks %s '
                'but not on ranks %s' % (
                    self.monitor, [r for r, p in enumerate(present) if p],
                    [r for r, p in enumerate(present) if not p]))
        if all(present):
            observation[self.monitor] = sum(values) / len(values)
        return self.actual_trigger(trainer)

    def get_training_length(self):
        return self.actual_trigger.get_training_length()
