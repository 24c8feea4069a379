"""Rank 0's plots of the ImageNet example: the means per epoch of the loss,
the accuracy and the communication, drawn into ``loss.png``,
``accuracy.png`` and ``communication.png`` in ``--out``.

Chainer's PlotReport keeps only the points it has drawn in a snapshot: a
resumed run drew its first step as a point of its own, and averaged the
rest of that epoch without the steps before the snapshot.  ``EpochPlots``
keeps the epoch's partial sums in the snapshot too, and keeps its points
even when it does not draw (``--noplot``), so any run resumes any other's
plots, with the uninterrupted run's values.
"""

import json
import os

import chainer
from chainer import training

#: (file name, the observed keys drawn in it).
FIGURES = (('accuracy.png', ('main/accuracy', 'validation/main/accuracy')),
           ('loss.png', ('main/loss', 'validation/main/loss')),
           ('communication.png', ('comm/exposed', 'comm/hidden')))
#: The extension's name in the trainer, so in the snapshot.
NAME = 'epoch_plots'
#: Where the snapshot keeps its state.
SNAPSHOT_KEY = 'extensions/%s/' % NAME


def every_iteration(trainer):
    """A trigger with no state to save (an IntervalTrigger's would be missing
    from a snapshot written without these plots, and warn)."""
    return True


def _number(value):
    if isinstance(value, chainer.Variable):
        value = value.array
    return float(chainer.backend.CpuDevice().send(value))


class EpochPlots(training.Extension):
    """Each epoch's mean of every key of FIGURES observed in it, a point per
    epoch and key; drawn at the end of each epoch if ``draw``."""

    def __init__(self, draw=True):
        self.draw = draw
        self.sums = {}     #: key -> [sum, count] of the current epoch
        self.points = {}   #: key -> [[epoch, mean], ...]

    def __call__(self, trainer):
        for _, keys in FIGURES:
            for key in keys:
                if key in trainer.observation:
                    acc = self.sums.setdefault(key, [0.0, 0])
                    acc[0] += _number(trainer.observation[key])
                    acc[1] += 1
        updater = trainer.updater
        if not updater.is_new_epoch:
            return
        for key, (total, count) in sorted(self.sums.items()):
            self.points.setdefault(key, []).append(
                [updater.epoch, total / count])
        self.sums = {}
        if self.draw:
            draw(self.points, trainer.out)

    def serialize(self, serializer):
        # Plain JSON: where a snapshot has none of it (written before these
        # plots were kept), the trainer's loader leaves it out and each
        # call returns what it was given.
        self.sums = json.loads(serializer('sums', json.dumps(self.sums)))
        self.points = json.loads(serializer('points',
                                            json.dumps(self.points)))


def available():
    """Whether matplotlib can be imported here."""
    import importlib.util
    return importlib.util.find_spec('matplotlib') is not None


def draw(points, out):
    """One figure per FIGURES entry with points, as Chainer's PlotReport
    draws them: x the epoch, a line with markers per key."""
    if not available():
        return
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    for file_name, keys in FIGURES:
        drawn = [k for k in keys if points.get(k)]
        if not drawn:
            continue
        figure = plt.figure()
        axes = figure.add_subplot(111)
        axes.set_xlabel('epoch')
        axes.grid()
        for key in drawn:
            epochs, means = zip(*points[key])
            axes.plot(epochs, means, marker='x', label=key)
        legend = axes.legend(bbox_to_anchor=(1.05, 1), loc=2,
                             borderaxespad=0.)
        figure.savefig(os.path.join(out, file_name),
                       bbox_extra_artists=(legend,), bbox_inches='tight')
        plt.close(figure)
