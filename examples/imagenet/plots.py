"""Rank 0's plots of the ImageNet example: the means per epoch of the loss,
the accuracy and the communication, drawn into ``loss.png``,
``accuracy.png`` and ``communication.png`` in ``--out``.

Chainer's PlotReport keeps only the points it has drawn in a snapshot: a
resumed run drew its first step as a point of its own, and averaged the
rest of that epoch without the steps before the snapshot.  ``EpochPlots``
keeps the epoch's partial sums in the snapshot too, and keeps its points
even when it does not draw (``--noplot``), so any run resumes any other's
plots: on as many ranks, with the uninterrupted run's training loss and
accuracy.
"""

import functools
import json
import os

import chainer
from chainer import training
import numpy

#: (file name, the observed keys drawn in it).
FIGURES = (('accuracy.png', ('main/accuracy', 'validation/main/accuracy')),
           ('loss.png', ('main/loss', 'validation/main/loss')),
           ('communication.png', ('comm/exposed', 'comm/hidden')))
#: Each figure's y axis: (its label, with the unit, and the factor from
#: the observed values to it): the communication in milliseconds per
#: step, as the table shows it (observed in seconds).
Y_AXES = {'accuracy.png': ('accuracy (fraction of images right)', 1),
          'loss.png': ('loss (softmax cross entropy)', 1),
          'communication.png': ('milliseconds per step', 1e3)}
#: The extension's name in the trainer, so in the snapshot.
NAME = 'epoch_plots'
#: Where the snapshot keeps its state.
SNAPSHOT_KEY = 'extensions/%s/' % NAME


def every_iteration(trainer):
    """A trigger with no state to save (an IntervalTrigger's would be missing
    from a snapshot written without these plots, and warn)."""
    return True


def _float64(x):
    """``x`` (a number, or a 0-d array on any device) as float64, where it
    is: summed on a GPU, an observation costs no copy to the host."""
    if isinstance(x, chainer.Variable):
        x = x.array
    return x.astype(numpy.float64) if hasattr(x, 'astype') \
        else numpy.float64(x)


def _weighted(value):
    """(value, weight) of an observation as Chainer's summaries read it (a
    tuple is a value and its weight), or None where it is not a scalar."""
    value, weight = value if isinstance(value, tuple) else (value, 1)
    if isinstance(value, chainer.Variable):
        value = value.array
    if not (numpy.isscalar(value) or getattr(value, 'ndim', -1) == 0):
        return None
    return _float64(value), _float64(weight)


class EpochPlots(training.Extension):
    """Each epoch's mean of every key of FIGURES observed in it, a point per
    epoch and key; drawn at the end of each epoch if ``draw``.  The
    validation counts at the end of an epoch only (a run of --iteration
    validates where it stops, mid-epoch: the run it is resumed as would
    not)."""

    def __init__(self, draw=True):
        self.draw = draw
        #: key -> [weighted sum, sum of the weights] of the current epoch,
        #: float64, on the observations' device until the epoch ends
        self.sums = {}
        self.points = {}   #: key -> [[epoch, mean], ...]

    def __call__(self, trainer):
        updater = trainer.updater
        for _, keys in FIGURES:
            for key in keys:
                if key not in trainer.observation or (
                        key.startswith('validation/') and
                        not updater.is_new_epoch):
                    continue
                observed = _weighted(trainer.observation[key])
                if observed is not None:
                    value, weight = observed
                    total, count = self.sums.get(key, (0.0, 0.0))
                    self.sums[key] = [total + value * weight, count + weight]
        if not updater.is_new_epoch:
            return
        for key, (total, count) in sorted(self.sums.items()):
            self.points.setdefault(key, []).append(
                [updater.epoch, float(total) / float(count)])
        self.sums = {}
        if self.draw:
            draw(self.points, trainer.out)

    def serialize(self, serializer):
        # Plain JSON: where a snapshot has none of it, the trainer's loader
        # can leave it out (keys_to_skip) and each call returns what it was
        # given.
        sums = {k: [float(t), float(c)] for k, (t, c) in self.sums.items()}
        self.sums = json.loads(serializer('sums', json.dumps(sums)))
        self.points = json.loads(serializer('points',
                                            json.dumps(self.points)))


def keys_to_skip(saved_keys, same_layout):
    """Which keys of EpochPlots' state a resume from a snapshot holding
    ``saved_keys`` leaves out: all of them where it has none (written
    before these plots: ``points_of_plot_reports`` reads what it has), and
    the epoch's sums on another number of ranks (the epoch restarts from
    its beginning)."""
    kept = any(k.startswith(SNAPSHOT_KEY) for k in saved_keys)

    def skip(key):
        return key.startswith(SNAPSHOT_KEY) and (
            not kept or (not same_layout and key == SNAPSHOT_KEY + 'sums'))
    return skip


def points_of_plot_reports(snapshot):
    """The points per epoch Chainer's PlotReports (which drew the example's
    plots before EpochPlots) kept in ``snapshot`` (an open .npz): {key:
    [[epoch, mean], ...]}, {} where there are none."""
    points = {}
    for key in snapshot.files:
        if key.startswith('extensions/PlotReport') and '/_plot_' in key:
            points.update(json.loads(str(snapshot[key])))
    return points


@functools.lru_cache(maxsize=None)
def available():
    """Whether matplotlib imports here (as Chainer's PlotReport asks: one
    built for another NumPy raises a TypeError, or an ImportError)."""
    try:
        import matplotlib  # NOQA
        return True
    except (ImportError, TypeError):
        return False


def draw(points, out):
    """One figure per FIGURES entry with points, as Chainer's PlotReport
    draws them: x the epoch, a line with markers per key."""
    if not available():
        return
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    for file_name, keys in FIGURES:
        figure = figure_of(plt, file_name, keys, points)
        if figure is None:
            continue
        figure.savefig(os.path.join(out, file_name), bbox_extra_artists=(
            figure.axes[0].get_legend(),), bbox_inches='tight')
        plt.close(figure)


def figure_of(plt, file_name, keys, points):
    """The figure ``file_name`` of ``keys``' points (None where none has
    any), its y axis labelled in its unit (Y_AXES)."""
    drawn = [k for k in keys if points.get(k)]
    if not drawn:
        return None
    label, scale = Y_AXES[file_name]
    figure = plt.figure()
    axes = figure.add_subplot(111)
    axes.set_xlabel('epoch')
    axes.set_ylabel(label)
    axes.grid()
    for key in drawn:
        epochs, means = zip(*points[key])
        axes.plot(epochs, [m * scale for m in means], marker='x', label=key)
    axes.legend(bbox_to_anchor=(1.05, 1), loc=2, borderaxespad=0.)
    return figure
