"""multi_node_snapshot: Chainer's snapshot extension, once per replica set,
with an autoload that every rank agrees on.

Ranks in one *replica set* hold the same state (data parallelism: all of
them, for the model and optimizer); only the first rank of each set
writes, to ``FILENAME.setK`` (K the set's index; no suffix with a single
set).  Writes go through Chainer's writers: into a temporary directory,
then renamed, so a crash mid-write never leaves a loadable half file under
a snapshot's name.

With ``autoload`` (given to ``extensions.snapshot``), every rank lists the
snapshots whose file it would load is whole (zip CRCs checked), the ranks
keep those they all have, and load the newest (by the numbers in its name:
``snapshot_iter_{.updater.iteration}`` sorts by iteration).  A rank loads
its own set's file, or set 0's when the snapshot was written by fewer sets
(resuming on another number of ranks: with one replica set, on any).
"""

import os
import re
import string
import zipfile

import chainer
from chainer.training import extension


def _normalize_sets(replica_sets, size):
    if not replica_sets:
        return [[r] for r in range(size)]
    sets = [[s] if isinstance(s, int) else sorted(s) for s in replica_sets]
    ranks = sorted(r for s in sets for r in s)
    if ranks != list(range(size)):
        raise ValueError('replica_sets must hold every rank 0..%d exactly '
                         'once, not %r' % (size - 1, replica_sets))
    return sets


def _pattern(fmt):
    """A regex for the names ``fmt`` formats into ('{...}' fields match
    anything)."""
    parts = []
    for literal, field, _, _ in string.Formatter().parse(fmt):
        parts.append(re.escape(literal))
        if field is not None:
            parts.append('.+?')
    return ''.join(parts)


def _natural_key(name):
    return tuple(int(n) for n in re.findall(r'\d+', name)), name


def npz_is_whole(path):
    """Whether ``path`` is a complete .npz (zip) file: every member's CRC
    checks (a file cut short, or never finished, is not)."""
    try:
        with zipfile.ZipFile(path) as z:
            return z.testzip() is None
    except (OSError, zipfile.BadZipFile):
        return False


class _MultiNodeSnapshot(extension.Extension):

    def __init__(self, comm, snapshot, replica_sets):
        if not isinstance(snapshot.filename, str):
            raise TypeError('multi_node_snapshot needs a filename format '
                            'string, not a callable')
        self.comm = comm
        self.snapshot = snapshot
        self.sets = _normalize_sets(replica_sets, comm.size)
        everyone = comm.allgather_obj(self.sets)
        if any(s != self.sets for s in everyone):
            raise ValueError('ranks passed different replica_sets: %s'
                             % ', '.join('rank %d: %r' % rs
                                         for rs in enumerate(everyone)))
        self.set_index = next(k for k, s in enumerate(self.sets)
                              if comm.rank in s)
        self.is_writer = comm.rank == self.sets[self.set_index][0]
        self.base = snapshot.filename
        if len(self.sets) > 1:
            snapshot.filename = self.base + '.set%d' % self.set_index
        # This extension does the loading, for every rank alike.
        self.autoload, snapshot.autoload = snapshot.autoload, False
        self.trigger = snapshot.trigger
        self.priority = snapshot.priority
        self.loaded = None  #: the snapshot autoload loaded, if any

    def initialize(self, trainer):
        if self.autoload:
            self._autoload(trainer)
        if self.is_writer:
            self.snapshot.initialize(trainer)

    def __call__(self, trainer):
        if self.is_writer:
            self.snapshot(trainer)

    def on_error(self, trainer, exc, tb):
        if self.is_writer:
            self.snapshot.on_error(trainer, exc, tb)

    def finalize(self):
        if self.is_writer:
            self.snapshot.finalize()

    def _my_file(self, outdir, name, names):
        """The file this rank loads for snapshot ``name``."""
        if name in names:   # written by a single replica set
            return os.path.join(outdir, name)
        mine = '%s.set%d' % (name, self.set_index)
        return os.path.join(outdir, mine if mine in names
                            else name + '.set0')

    def _autoload(self, trainer):
        outdir = trainer.out
        names = set(os.listdir(outdir)) if os.path.isdir(outdir) else set()
        regex = re.compile('(%s)(\\.set\\d+)?$' % _pattern(self.base))
        candidates = {m.group(1) for m in map(regex.match, names) if m}
        whole = sorted(c for c in candidates
                       if npz_is_whole(self._my_file(outdir, c, names)))
        everyone = self.comm.allgather_obj(whole)
        common = set(everyone[0]).intersection(*everyone[1:])
        if not common:
            return
        newest = max(common, key=_natural_key)
        # Chainer's snapshot keeps what it saves (None: the trainer) in
        # _target, as every Chainer 7 release does.
        target = getattr(self.snapshot, '_target', None) or trainer
        chainer.serializers.load_npz(self._my_file(outdir, newest, names),
                                     target)
        self.loaded = newest


def multi_node_snapshot(comm, snapshot, replica_sets=None):
    """Wrap ``snapshot`` (``chainer.training.extensions.snapshot(...)``) so
    that one rank per replica set writes it and ``autoload`` resumes every
    rank from the newest snapshot all of them hold completely (see the
    module's doc).  ``replica_sets``: lists of ranks (or single ranks);
    default: every rank alone."""
    return _MultiNodeSnapshot(comm, snapshot, replica_sets)
