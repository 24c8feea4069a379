"""Whether a snapshot file fits the optimizers it would be loaded into,
read before anything is loaded.

A snapshot written with ``local_steps`` (its optimizer's group
``mnopt_local_steps`` holds the settings: mnopt/optimizers/
local_steps_mark.py) is refused by a multi-node optimizer without local
steps.  Loaded through ``load_npz``, that refusal comes from the
optimizer, after Chainer's updater has loaded the iterators;
``multi_node_snapshot``'s autoload and the checkpointer's ``maybe_load``
load through ``load_checked``, which asks ``mode_refusal`` first on every
rank, so a refused snapshot leaves the trainer as it was."""

import chainer
import numpy

from mnopt.communicators import any_communicator
from mnopt.iterators.resize import load_resizing_iterators
from mnopt.optimizers.local_steps import LocalStepsOptimizer
from mnopt.optimizers.local_steps_mark import SNAPSHOT_KEY, not_local_steps
from mnopt.optimizers.protocol import MultiNodeOptimizer


def optimizers_of(target):
    """``(key prefix in a snapshot of target, optimizer)`` for each
    optimizer of ``target``: a trainer, an updater, or an optimizer."""
    if isinstance(target, (MultiNodeOptimizer, chainer.Optimizer)):
        return [('', target)]
    updater = getattr(target, 'updater', None)
    prefix = 'updater/' if updater is not None else ''
    everyone = getattr(updater or target, 'get_all_optimizers', None)
    if everyone is None:
        return []
    return [('%soptimizer:%s/' % (prefix, name), optimizer)
            for name, optimizer in sorted(everyone().items())]


def mode_refusal(path, target):
    """The ValueError that loading the snapshot file ``path`` into
    ``target`` would raise part-way (a local-steps snapshot, a multi-node
    optimizer without local steps), or None."""
    with numpy.load(path) as saved:
        for prefix, optimizer in optimizers_of(target):
            if not isinstance(optimizer, MultiNodeOptimizer) or \
                    isinstance(optimizer, LocalStepsOptimizer) or \
                    prefix + SNAPSHOT_KEY + '/settings' not in saved.files:
                continue
            try:
                not_local_steps(chainer.serializers.NpzDeserializer(
                    saved, path=prefix))
            except ValueError as e:
                return e
    return None


def load_checked(path, target, comm, what):
    """``load_resizing_iterators(path, target, comm, what)`` where no
    rank's ``mode_refusal`` refuses its file; else the refusal, raised on
    every rank before anything is loaded."""
    any_communicator.raise_together(comm, mode_refusal(path, target), what)
    load_resizing_iterators(path, target, comm, what)
