"""multi_node_snapshot: Chainer's snapshot extension, once per replica set,
with an autoload that every rank agrees on.

Ranks in one *replica set* hold the same state; only the set's first
(lowest) rank writes, to ChainerMN's file name ``FILENAME.R`` (R that
rank; a callable filename's result gets the same suffix), and records in
it how many sets wrote the snapshot.  ``replica_sets`` as ChainerMN parses
it: ranks or iterables of ranks; ranks left out form one more set (``[]``:
one set of every rank).  Writes go through Chainer's writers: into a
temporary directory, then renamed, so a crash mid-write never leaves a
loadable half file under a snapshot's name.

With ``autoload`` (given to ``extensions.snapshot``), every rank lists the
snapshots whose file it would load is whole (zip CRCs checked: a file cut
short or with damaged bytes is not), the ranks keep those they all have,
and load the newest (by the numbers in its name:
``snapshot_iter_{.updater.iteration}`` sorts by iteration); a newer one
skipped is named in a warning.  A set loads its writer's file.  The first
set's file stands in for it only where that file says fewer sets wrote the
snapshot (resuming on more ranks: with one replica set, on any); a set's
missing file is otherwise an incomplete snapshot, never loaded.

A sharded optimizer (``shard_state=True``) makes no two ranks replicas:
with the default replica sets every rank writes its own file (its share of
the optimizer state; explicit sets that group ranks are an error), and a
snapshot of another number of ranks is loadable only where every rank's
file is whole: after the load each rank re-shards, reading the state of
the parameters it now owns from their previous owners' files
(``mnopt.zero.load_shards``; docs/zero.md).

A snapshot is one write: every file of it records the same write id (the
job's, agreed at ``initialize``, and the iteration), and a snapshot whose
files a resume would read together carry different ids (one rank's write
was lost, and an older run's file of the same name is still there) is
not loadable: skipped with a warning, as a damaged one.  Files written
before mnopt recorded ids have none, and load as before.  A set's file
beyond the sets that wrote a snapshot (as set 0's file records) is an
earlier run's: set 0's file stands in for it.

Every file records where each iterator over a ``scatter_dataset`` share
is in its epoch across all ranks (which of the dataset's examples the
epoch has read); a resume, on any number of ranks, splits the examples
the epoch has not read among the ranks (mnopt/iterators/epoch_position.py).
Other iterators whose shard changed length are rebuilt
(``mnopt.iterators.resize``: the same epoch and fraction of it, a new
order of the new shard, a warning).

``n_retains`` (of ``extensions.snapshot``) is applied by every rank alike:
after each write completes the ranks keep the ``n_retains`` newest (by the
numbers in their names) that autoload would load (every writer's file
whole, all of one write: mnopt/extensions/snapshot_checks.py), and remove
older ones; the snapshot autoload loaded stays until one this job wrote is
kept; a partial file (an asynchronous write in flight) is no snapshot,
for any filename.  A rank whose write fails raises its error, every other
rank one naming it.  ``snapshot_on_error`` records no epoch position (the
ranks cannot agree on one then): its resume on another rank count says so.

With ``asynchronous=True`` the state is copied to host memory at the step
and written by a thread (mnopt/extensions/background_writer.py: a
temporary name, fsync, read back, renamed); the next snapshot, and the
trainer's end, first confirm on every rank that the write is complete.

Beside this extension: which snapshot every rank can load
(mnopt/extensions/loadable.py) and what each file records besides the
trainer (mnopt/extensions/snapshot_records.py).
"""

import os
import re
import secrets

import chainer
import numpy
from chainer.training import extension

from mnopt.common import log
from mnopt.extensions.background_writer import (
    background_writer_for, complete_names, remove_partial_files)
from mnopt.extensions.loadable import newest_loadable
# npz_is_whole: imported from here by code written before it moved.
from mnopt.extensions.loadable import npz_is_whole  # NOQA
from mnopt.extensions.retention import (
    agreed_retention, filename_pattern, natural_key)
from mnopt.extensions.snapshot_checks import SnapshotChecks
from mnopt.extensions.snapshot_mode import load_checked
from mnopt.extensions.snapshot_records import RecordingSets
from mnopt.iterators.epoch_position import epoch_record
from mnopt.optimizers.zero.trainer import load_shards_of, sharded_optimizers

#: Each snapshot write, at INFO ($MNOPT_LOG_LEVEL=INFO shows them).
_logger = log.get(__name__)


def parse_replica_sets(replica_sets, size):
    """ChainerMN's replica sets for ``size`` ranks, as a list of sets:
    each item a rank or an iterable of ranks; the ranks no item names form
    one more set (``[]``: one set of every rank).  A rank out of range or
    in two sets is a ValueError."""
    sets = []
    for item in replica_sets:
        ranks = [item] if isinstance(item, (int, numpy.integer)) \
            else list(item)
        for r in ranks:
            if isinstance(r, bool) or \
                    not isinstance(r, (int, numpy.integer)) \
                    or not 0 <= r < size:
                raise ValueError('replica_sets %r: %r is not a rank of %d'
                                 % (replica_sets, r, size))
        sets.append({int(r) for r in ranks})
    named = [r for s in sets for r in s]
    if len(named) != len(set(named)):
        raise ValueError('replica_sets %r names a rank in two sets (every '
                         'rank belongs to one)' % (replica_sets,))
    rest = set(range(size)) - set(named)
    if rest:
        sets.append(rest)
    return [s for s in sets if s]


class _MultiNodeSnapshot(extension.Extension):

    def __init__(self, comm, snapshot, replica_sets, asynchronous=False):
        self.comm = comm
        self.snapshot = snapshot
        self.asynchronous = bool(asynchronous)
        # Given explicitly (not None or []): kept, a sharded optimizer's
        # ranks grouped in one set are an error (see initialize).
        self._sets_given = bool(replica_sets)
        sets = parse_replica_sets(
            [] if replica_sets is None else replica_sets, comm.size)
        self.sets = [sorted(s) for s in sets]
        said = comm.everyone((self.sets, self.asynchronous),
                             'multi_node_snapshot replica_sets')
        everyone = [s for s, _ in said]
        if any(s != self.sets for s in everyone):
            raise ValueError('ranks passed different replica_sets: %s'
                             % ', '.join('rank %d: %r' % rs
                                         for rs in enumerate(everyone)))
        if any(a != self.asynchronous for _, a in said):
            raise ValueError(
                'multi_node_snapshot: asynchronous=True on ranks %s only: '
                'pass the same on every rank' % [
                    r for r, (_, a) in enumerate(said) if a])
        if self.asynchronous:
            snapshot.writer = background_writer_for(snapshot.writer)
        self.set_index = next(k for k, s in enumerate(self.sets)
                              if comm.rank in s)
        self.replica_set = set(self.sets[self.set_index])
        self.master = self.sets[self.set_index][0]
        self.base = snapshot.filename
        # ChainerMN's names: each writer appends its rank.
        if callable(snapshot.filename):
            def with_rank(trainer, filename=snapshot.filename):
                return '{}.{}'.format(filename(trainer), comm.rank)
            snapshot.filename = with_rank
        else:
            snapshot.filename = '{}.{}'.format(snapshot.filename, comm.rank)
        snapshot.writer = RecordingSets(snapshot.writer, len(self.sets))
        # Kept here: every rank prunes alike (Chainer's clean-up runs per
        # rank, after each write).
        self.n_retains, snapshot.n_retains = snapshot.n_retains, -1
        self.job = None   # the job's part of write ids, agreed at initialize
        # This extension does the loading, for every rank alike.
        self.autoload, snapshot.autoload = snapshot.autoload, False
        if self.autoload and callable(self.base):
            raise ValueError('multi_node_snapshot: autoload needs a filename '
                             'format string to find the snapshots by, not '
                             'a callable')
        self.trigger = snapshot.trigger
        self.priority = snapshot.priority
        self.loaded = None  #: the snapshot autoload loaded, if any
        self.sharded = False  #: set at initialize: a sharded optimizer
        self.failed = False   #: training ended with an error
        self.checks = SnapshotChecks(self)   # autoload's and retention's
        self._in_flight = None   # this writer's background write's file

    @property
    def is_master(self):
        """Whether this rank writes its replica set's snapshots."""
        return self.comm.rank == self.master

    @property
    def is_writer(self):
        return self.is_master

    def _target(self, trainer):
        # Chainer's snapshot keeps what it saves (None: the trainer) in
        # _target, as every Chainer 7 release does.
        return getattr(self.snapshot, '_target', None) or trainer

    def _sharded(self, trainer):
        """Whether the snapshot holds a sharded optimizer (each rank a
        share of the state: no two ranks are replicas), agreed by every
        rank; with the default replica sets every rank then writes its
        own file."""
        sharded = bool(sharded_optimizers(self._target(trainer)))
        said = self.comm.everyone(
            (sharded, secrets.token_hex(6)), 'multi_node_snapshot start')
        everyone = [s for s, _ in said]
        self.job = said[0][1]   # rank 0's: one job id for every rank
        if any(s != sharded for s in everyone):
            raise ValueError('multi_node_snapshot: the optimizer is sharded '
                             '(shard_state=True) on ranks %s only'
                             % [r for r, s in enumerate(everyone) if s])
        if not sharded or all(len(s) == 1 for s in self.sets):
            return sharded
        if self._sets_given:
            raise ValueError(
                'multi_node_snapshot: replica_sets %r group ranks, but the '
                'optimizer is sharded (shard_state=True): each rank holds '
                'its own share of the state, so every rank must write its '
                'own file (leave replica_sets out, or give every rank a set '
                'of its own)' % (self.sets,))
        self.sets = [[r] for r in range(self.comm.size)]
        self.set_index = self.master = self.comm.rank
        self.replica_set = {self.comm.rank}
        self.snapshot.writer.n_sets = self.comm.size
        return sharded

    def initialize(self, trainer):
        self.out = trainer.out
        self.sharded = self._sharded(trainer)
        if self.autoload:
            self._autoload(trainer)
        if self.is_master:
            if self.asynchronous:
                remove_partial_files(trainer.out, '.%d' % self.comm.rank)
            self.snapshot.initialize(trainer)

    def __call__(self, trainer):
        iteration = trainer.updater.iteration
        problem = None
        if self.asynchronous:
            # The previous write is complete on every writer (or its
            # error raised on every rank) before the next one starts.
            self.comm.raise_together(
                self._wait_for_write(), 'multi_node_snapshot: the '
                'background write before iteration %d' % iteration)
            self._confirmed()
            self._prune(trainer.out)   # the write just confirmed
        self.snapshot.writer.extra = epoch_record(self._target(trainer),
                                                  self.comm)
        if self.is_master:
            self.snapshot.writer.write_id = '%s.%d' % (self.job, iteration)
            try:
                self.snapshot(trainer)
                written = self._written_file(trainer)
                if self.asynchronous:
                    self._in_flight = written
                else:   # renamed into place: complete
                    self.checks.trust(written)
            except Exception as e:
                problem = e
        self.comm.raise_together(problem, 'multi_node_snapshot at '
                                 'iteration %d' % iteration)
        if self.is_master:
            _logger.info('mnopt: rank %d wrote the snapshot of iteration '
                         '%d: %s', self.comm.rank, iteration, written)
        if not self.asynchronous:
            self._prune(trainer.out)

    def _written_file(self, trainer):
        """The path of the file this rank just wrote (for the log)."""
        name = self.snapshot.filename
        try:
            name = name(trainer) if callable(name) else name.format(trainer)
        except Exception:   # a filename of the user's own making
            pass
        return os.path.join(trainer.out, str(name))

    def on_error(self, trainer, exc, tb):
        self.failed = True
        if self.is_master:
            # Written by this rank alone: its own write id, so it is never
            # taken for one write with the other sets' files; no epoch
            # record (the last snapshot's would be stale).
            self.snapshot.writer.extra = {}
            self.snapshot.writer.write_id = '%s.%d.error-rank%d' % (
                self.job, trainer.updater.iteration, self.comm.rank)
            self.snapshot.on_error(trainer, exc, tb)

    def _prune(self, outdir):
        """Keep the ``n_retains`` newest complete snapshots (autoload's
        check on every writer: each would load it, all of one write);
        every writer removes its file of each older one, and rank 0 the
        files of ranks that write none now (an earlier run's).  The
        snapshot autoload loaded stays until one this job wrote is kept."""
        if self.n_retains <= 0 or callable(self.base):
            return
        names = complete_names(outdir)
        regex = re.compile('(%s)\\.(\\d+)$' % filename_pattern(self.base))
        found = [(m.group(1), int(m.group(2)))
                 for m in map(regex.match, names) if m]
        held = None
        if self.is_master:
            held = {}
            for n in {n for n, r in found if r == self.comm.rank}:
                problem, write = self.checks.problem(outdir, n, names)
                held[n] = (problem is None, write)
        kept, stale = agreed_retention(
            self.comm, held, self.n_retains, key=natural_key,
            what='multi_node_snapshot clean-up', keep_newer=True)
        stale = set(stale)
        if held is not None and not any(
                str(held[k][1]).startswith('%s.' % self.job) for k in kept):
            stale.discard(self.loaded)
        writers = {s[0] for s in self.sets}
        for name, r in found:
            if name in stale and (r == self.comm.rank and self.is_master or
                                  self.comm.rank == 0 and r not in writers):
                os.remove(os.path.join(outdir, '%s.%d' % (name, r)))

    def _wait_for_write(self):
        """The error of this rank's write in flight, if any, once it is
        done (None on a rank that writes nothing)."""
        if not self.is_master:
            return None
        try:
            self.snapshot.writer.wait()
        except Exception as e:
            return e
        return None

    def finalize(self):
        # After a failure a collective could wait forever: the last
        # write's error is then raised on its writer alone.
        if self.failed or not self.asynchronous:
            if self.is_master:
                self.snapshot.finalize()
            return
        self.comm.raise_together(self._wait_for_write(), 'multi_node_'
                                 'snapshot: the last background write')
        self._confirmed()
        self._prune(self.out)

    def _confirmed(self):
        """The background write in flight is complete on every rank."""
        if self._in_flight is not None:
            self.checks.trust(self._in_flight)
            self._in_flight = None

    def _autoload(self, trainer):
        outdir = trainer.out
        names = complete_names(outdir)
        regex = re.compile('(%s)\\.\\d+$' % filename_pattern(self.base))
        candidates = {m.group(1) for m in map(regex.match, names) if m}
        found = {c: self.checks.problem(outdir, c, names) for c in candidates}
        newest = newest_loadable(
            self.comm, {c: p for c, (p, _) in found.items()},
            key=natural_key, writes={c: w for c, (_, w) in found.items()})
        if newest is None:
            return
        target = self._target(trainer)
        path, _ = self.checks.file_to_load(outdir, newest, names)
        load_checked(path, target, self.comm, 'snapshot %s' % newest)
        if self.sharded:
            # Another number of ranks wrote it: every rank's share is
            # re-sharded (problems are raised on every rank at the next
            # update).
            load_shards_of(target, lambda r: os.path.join(
                outdir, '%s.%d' % (newest, r)))
        self.loaded = newest


def multi_node_snapshot(comm, snapshot, replica_sets=None, *,
                        asynchronous=False):
    """Wrap ``snapshot`` (``chainer.training.extensions.snapshot(...)``) so
    that the first rank of each replica set writes it, to
    ``FILENAME.RANK`` as ChainerMN's, and ``autoload`` resumes every rank
    from the newest snapshot all of them hold completely (see the module's
    doc).  ``replica_sets``: ranks or iterables of ranks, the ranks left
    out forming one more set; ``[]`` (or None): one set of every rank.
    ``asynchronous``: copy the state to host memory at the step and write
    it in the background (mnopt/extensions/background_writer.py), the
    same on every rank."""
    return _MultiNodeSnapshot(comm, snapshot, replica_sets, asynchronous)
