"""CommunicationReport: each step's communication as trainer observations
(``comm/exposed``, ``comm/hidden``, ``comm/busbw``, ``comm/straggler``,
...), for the LogReport, PrintReport and PlotReport.

Every iteration it takes the communicator's figures of that step
(``comm.communication_stats()``: kept by the communicator as it averages,
with no communication; mnopt/timeline/step_stats.py).  Every ``trigger`` it
reports, per step of the interval, into ``trainer.observation``:

==========================  ============================================
``comm/exposed``            seconds the training loop was blocked on
                            communication (all of a synchronous
                            averaging; with ``double_buffering`` or
                            ``overlap``, its waits; ZeRO: also the
                            parameters' all-gather)
``comm/hidden``             seconds of averaging on the background thread
                            while the loop computed (0 when nothing runs
                            there: the plain optimizer, ZeRO stage 1)
``comm/bytes_sent``         bytes this rank put on the wire for its
                            communicator's algorithm (flat's ring: 2(N-1)
                            /N of the payload; the reduction server: the
                            payload; sign: the vote's bits)
``comm/bytes_received``     bytes it took off the wire
``comm/busbw``              bus bandwidth, bytes/s: the payload times
                            nccl-tests' factor (2(N-1)/N for an allreduce)
                            over the seconds inside collectives; absent
                            when no collective ended in the interval (at
                            one rank; double buffering's first step)
``comm/busbw_fraction``     that, as a fraction of the link rate
                            (``link_rate=`` or $MNOPT_LINK_RATE); only
                            when the rate is known
``comm/straggler``          the rank that arrived last, by 0.1 ms or
                            more, at the most collectives of the interval
                            (-1: none was; only at N > 1)
``comm/straggler_late``     by how much, seconds: its median lateness at
                            the collectives where it arrived last (its
                            arrival less the median arrival of the
                            others)
==========================  ============================================

Who arrived last cannot be known on one rank: every ``trigger`` the ranks
exchange each collective's wait (from this rank's arrival until the
result was in; the rank that waited least arrived last), in one small
agreement over mnopt's private communicator (``comm.everyone``:
stall-watched like every collective), not one per step.  The collectives
are the averagings, ZeRO's, and mnopt's agreements (the optimizer's one
per update: where a rank late to the step is waited for).  When to
report is decided on the trainer's iteration, the same on every rank; a
rank that reports at another iteration (its own trigger passed to
``trainer.extend``) is an error on every rank, never a hang.
"""

from chainer.training import extension

from mnopt.communicators import any_communicator
from mnopt.timeline import step_stats

#: The figures summed over an interval.
_SUMMED = ('exposed', 'hidden', 'wire', 'bytes', 'bytes_sent',
           'bytes_received', 'bus_bytes')


def _interval(trigger):
    """Iterations between reports, from ``n``, ``(n, 'iteration')`` or an
    IntervalTrigger in iterations."""
    if isinstance(trigger, int):
        trigger = trigger, 'iteration'
    period, unit = getattr(trigger, 'get_training_length',
                           lambda: trigger)()
    if unit != 'iteration' or int(period) != period or period < 1:
        raise ValueError(
            'CommunicationReport: trigger must be a whole number of '
            "iterations, as (n, 'iteration'), not %r: every rank must "
            'report at the same iterations' % (trigger,))
    return int(period)


def _last_iteration(trainer):
    """Whether this is the trainer's last iteration, by its stop
    trigger's length (the same on every rank); False where it has none."""
    length = getattr(trainer.stop_trigger, 'get_training_length', None)
    if length is None:
        return False
    period, unit = length()
    updater = trainer.updater
    return (updater.iteration if unit == 'iteration'
            else updater.epoch_detail) >= period


class CommunicationReport(extension.Extension):
    """Report ``comm``'s communication of each step (see the module) every
    ``trigger`` iterations (``(n, 'iteration')`` or ``n``; default every
    iteration): the means per step of the interval, the straggler of its
    collectives.  ``link_rate``: the link's bits/s (a number or '10gbit';
    default $MNOPT_LINK_RATE) for ``comm/busbw_fraction``.  Add it on
    every rank; it runs before the LogReport (priority), so its keys are
    in the same observation.  Give it the LogReport's interval for
    ``comm/straggler`` to be one rank: a LogReport over several of its
    reports shows the mean of theirs.  ``at_end``: also report at the
    trainer's last iteration (its stop trigger's length), the steps since
    the last report, for a LogReport that logs there too.

    ``last``: the figures of the last report, with 'steps', 'matched'
    (the collectives seen on every rank) and 'last_at' ({rank: [seconds
    late]}: who arrived last at each of them, where late by 0.1 ms or
    more).  ``totals``: this run's sums since the trainer started ('steps',
    and the summed figures: 'exposed', 'hidden', 'bytes' of payload,
    'bytes_sent'...), for a summary at the end."""

    trigger = 1, 'iteration'     # it takes the figures every iteration
    priority = extension.PRIORITY_EDITOR
    default_name = 'CommunicationReport'

    def __init__(self, comm, trigger=(1, 'iteration'), link_rate=None,
                 at_end=False):
        self.comm = comm
        self.interval = _interval(trigger)
        self.link_rate = step_stats.link_rate(link_rate)
        self.at_end = at_end
        self.last = None
        self.totals = dict(dict.fromkeys(_SUMMED, 0.0), steps=0)
        self._reset(None)

    def _reset(self, iteration):
        self._since = iteration
        self._sums = dict.fromkeys(_SUMMED, 0.0)
        self._arrivals = []

    def initialize(self, trainer):
        """Claim the communicator's figures (each is taken once: one
        report per communicator) and forget what came before training
        (set-up, a broadcast)."""
        stats = getattr(self.comm, 'step_stats', None)
        if stats is not None:
            other, its_trainer = stats.reader or (None, None)
            if other not in (None, self) and its_trainer is trainer:
                raise ValueError(
                    'CommunicationReport: this trainer already has a '
                    'CommunicationReport of this communicator: each takes '
                    'the figures it reports, so a second would see only '
                    'what the first left; use one, with the interval you '
                    'want')
            stats.reader = self, trainer
        self.comm.communication_stats()
        self._reset(trainer.updater.iteration)
        self.totals = dict(dict.fromkeys(_SUMMED, 0.0), steps=0)

    def finalize(self):
        """Let go of the communicator's figures (another trainer's report
        may take them)."""
        stats = getattr(self.comm, 'step_stats', None)
        if stats is not None and stats.reader and stats.reader[0] is self:
            stats.reader = None

    def __call__(self, trainer):
        figures = self.comm.communication_stats()
        for key in _SUMMED:
            self._sums[key] += figures[key]
            self.totals[key] += figures[key]
        self.totals['steps'] += 1
        self._arrivals += figures['arrivals']
        iteration = trainer.updater.iteration
        if iteration % self.interval and not (
                self.at_end and _last_iteration(trainer)):
            return
        report = self._report(iteration)
        observation = trainer.observation
        for key, value in report.items():
            if key.startswith('comm/'):
                observation[key] = value
        self.last = report

    def _report(self, iteration):
        since = self._since if self._since is not None else iteration - 1
        steps = max(iteration - since, 1)
        sums, arrivals = self._sums, self._arrivals
        self._reset(iteration)
        report = {'steps': steps}
        for key in ('exposed', 'hidden', 'bytes_sent', 'bytes_received'):
            report['comm/' + key] = sums[key] / steps
        if sums['wire'] > 0 and sums['bus_bytes'] > 0:
            busbw = sums['bus_bytes'] / sums['wire']
            report['comm/busbw'] = busbw
            if self.link_rate:
                report['comm/busbw_fraction'] = busbw * 8 / self.link_rate
        if self.comm.size > 1:
            said = any_communicator.everyone(
                self.comm, (iteration, arrivals),
                'the communication report (CommunicationReport)')
            iterations = [i for i, _ in said]
            if any(i != iterations[0] for i in iterations):
                raise ValueError(
                    'CommunicationReport: the ranks report at different '
                    'iterations (%s): give it the same trigger on every '
                    'rank' % ', '.join('rank %d: %d' % (r, i)
                                       for r, i in enumerate(iterations)))
            found = step_stats.stragglers([a for _, a in said])
            report['last_at'] = found['last']
            report['matched'] = found['matched']
            straggler = found['straggler']
            report['comm/straggler'] = -1 if straggler is None else straggler
            report['comm/straggler_late'] = found['late']
        return report

