"""create_multi_node_checkpointer: every rank checkpoints its own trainer;
``maybe_load`` resumes every rank from the newest checkpoint all of them
hold whole (ChainerMN's API, as its ImageNet example uses it).

A save is one step of every rank: a rank whose write fails raises its
error and the others one naming it, and the clean-up keeps the newest
checkpoints *every* rank holds (as ChainerMN's), so a rank behind never
loses the last checkpoint the others can resume with.

Each checkpoint records the epoch's position across ranks, as
multi_node_snapshot's files do (mnopt/iterators/epoch_position.py): a
resume on another number of ranks reads the rest of the interrupted
epoch, no example twice and none skipped."""

import numbers
import os
import re

import chainer
from chainer.serializers import DictionarySerializer
from chainer.training import extension

from mnopt.extensions.loadable import newest_loadable, npz_problem
from mnopt.extensions.retention import agreed_retention
from mnopt.extensions.snapshot_mode import load_checked
from mnopt.iterators.epoch_position import epoch_record


def _positive(name, value, meaning):
    """``value``, unless it is not a positive integer: ChainerMN's
    checkpointer asserts both of its intervals are (0 checkpoints kept, or
    a clean-up every 0 saves, means nothing)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or value < 1:
        raise ValueError('%s (%s) must be a positive integer, not %r'
                         % (name, meaning, value))
    return int(value)


class _MultiNodeCheckpointer(extension.Extension):

    trigger = 1, 'epoch'
    priority = -100   # after everything else of the iteration, as snapshots

    def __init__(self, name, comm, cp_interval=5, gc_interval=5, path=None):
        self.name, self.comm, self.path = name, comm, path
        self.cp_interval = _positive('cp_interval', cp_interval,
                                     'the number of checkpoints kept')
        self.gc_interval = _positive('gc_interval', gc_interval,
                                     'saves between clean-ups')
        self._saves = 0
        self.stats = {'saved': 0, 'loaded': None}

    def _dir(self, trainer):
        return self.path or trainer.out

    def _file(self, outdir, iteration):
        return os.path.join(outdir, 'cp-%s.%d.rank%d.npz'
                            % (self.name, iteration, self.comm.rank))

    def _mine(self, outdir):
        """Iterations of this rank's checkpoints in ``outdir``, by name."""
        pattern = re.compile(r'cp-%s\.(\d+)\.rank%d\.npz$'
                             % (re.escape(self.name), self.comm.rank))
        found = []
        for f in os.listdir(outdir) if os.path.isdir(outdir) else ():
            m = pattern.match(f)
            if m:
                found.append(int(m.group(1)))
        return sorted(found)

    def __call__(self, trainer):
        self.save(trainer, trainer.updater.iteration)

    def save(self, target, iteration):
        """Checkpoint ``target`` (a trainer, or any serializable object
        when ``path`` was given) as of ``iteration``, on every rank at the
        same iteration (ChainerMN's use without a trainer)."""
        outdir = self.path or getattr(target, 'out', None)
        if outdir is None:
            raise ValueError('create_multi_node_checkpointer needs path= '
                             'to save an object that is not a trainer')
        os.makedirs(outdir, exist_ok=True)
        path = self._file(outdir, iteration)
        tmp = path + '.tmp%d' % os.getpid()
        # Collective, so before any rank can fail alone.
        record = epoch_record(target, self.comm)
        problem = None
        try:
            state = DictionarySerializer()
            state.save(target)
            state.target.update(record)
            chainer.serializers.save_npz(tmp, state.target)
            os.replace(tmp, path)   # never a half file under the final name
        except Exception as e:
            problem = e
            if os.path.exists(tmp):
                os.remove(tmp)
        self.comm.raise_together(problem, 'checkpoint %d' % iteration)
        self.stats['saved'] += 1
        self._saves += 1
        if self._saves % self.gc_interval == 0:
            self._clean_up(outdir, iteration)

    def _clean_up(self, outdir, iteration):
        """Keep the ``cp_interval`` newest checkpoints every rank holds;
        remove this rank's others, and its checkpoints newer than the one
        just saved (an earlier run's, which this run resumed before: never
        loadable beside this run's)."""
        mine = self._mine(outdir)
        for newer in (i for i in mine if i > iteration):
            os.remove(self._file(outdir, newer))
        mine = [i for i in mine if i <= iteration]
        _, stale = agreed_retention(
            self.comm, mine, self.cp_interval, key=int,
            what='checkpoint clean-up', keep_newer=False)
        for old in set(stale) & set(mine):
            os.remove(self._file(outdir, old))

    def maybe_load(self, trainer, optimizer=None, path=None):
        """Load, on every rank, the newest checkpoint every rank holds
        whole (nothing if there is none; a newer one skipped is named in a
        warning).  ``optimizer`` is accepted for ChainerMN compatibility:
        the trainer's snapshot holds it."""
        del optimizer
        outdir = path or self._dir(trainer)
        problems = {i: npz_problem(self._file(outdir, i))
                    for i in self._mine(outdir)}
        iteration = newest_loadable(self.comm, problems, key=int,
                                    what='checkpoint')
        if iteration is None:
            return
        load_checked(self._file(outdir, iteration), trainer, self.comm,
                     'checkpoint %d' % iteration)
        self.stats['loaded'] = iteration

    def get_stats(self):
        return dict(self.stats)


def create_multi_node_checkpointer(name, comm, cp_interval=5, gc_interval=5,
                                   path=None):
    """A trainer extension that checkpoints each rank's trainer (files
    ``cp-NAME.ITERATION.rankR.npz`` in ``path`` or the trainer's out,
    written atomically), keeping the ``cp_interval`` newest and cleaning up
    every ``gc_interval`` saves (both positive integers, as ChainerMN
    requires); ``maybe_load(trainer)`` resumes."""
    return _MultiNodeCheckpointer(name, comm, cp_interval, gc_interval, path)
