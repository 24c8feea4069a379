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
"""

import os
import re
import string
import warnings
import zipfile

import chainer
import numpy
from chainer.training import extension


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


def _error_name(e):
    """``zlib.error``, ``zipfile.BadZipFile``, ``EOFError``: a name that
    says what raised it (zlib's class alone is called ``error``)."""
    kind = type(e)
    return kind.__qualname__ if kind.__module__ == 'builtins' else \
        '%s.%s' % (kind.__module__, kind.__qualname__)


def npz_problem(path):
    """None if ``path`` is a complete .npz (zip) file, every member's CRC
    checked; otherwise why not, naming the file (missing, cut short,
    bytes damaged)."""
    name = os.path.basename(path)
    try:
        with zipfile.ZipFile(path) as z:
            bad_member = z.testzip()
    except FileNotFoundError:
        return '%s is missing' % name
    except Exception as e:
        # Damage raises whatever the part of the zip it hit raises:
        # BadZipFile, zlib.error (a deflate stream), EOFError, ValueError..
        return '%s is damaged (%s: %s)' % (name, _error_name(e), e)
    if bad_member is not None:
        return '%s is damaged (member %s fails its CRC check)' % (
            name, bad_member)
    return None


def npz_is_whole(path):
    """Whether ``path`` is a complete .npz (zip) file: every member's CRC
    checks (a file cut short, never finished or damaged is not)."""
    return npz_problem(path) is None


def newest_loadable(comm, problems, key, what='snapshot'):
    """The newest candidate (by ``key``) that every rank can load, the
    same on every rank, or None.

    ``problems`` maps each candidate this rank found to None (it can load
    it) or why it cannot.  A candidate another rank did not find is not
    loadable there.  Rank 0 warns about each newer candidate skipped,
    naming every rank's reason, so a damaged newest snapshot costs the
    work since the one before it, never the run."""
    everyone = comm.allgather_obj(problems)

    def reasons(candidate):
        return ['rank %d: %s' % (r, p.get(candidate, 'no file found'))
                for r, p in enumerate(everyone)
                if p.get(candidate, 'no file found') is not None]

    found = set().union(*everyone)
    usable = [c for c in found if not reasons(c)]
    newest = max(usable, key=key) if usable else None
    if comm.rank == 0:
        for c in sorted(found, key=key):
            if newest is None or key(c) > key(newest):
                warnings.warn('skipping %s %s, which not every rank can '
                              'load: %s' % (what, c, '; '.join(reasons(c))),
                              RuntimeWarning)
    return newest


#: Where each set's file records how many replica sets wrote the snapshot.
N_SETS_KEY = 'multi_node_snapshot/n_replica_sets'


def sets_that_wrote(path):
    """How many replica sets wrote the snapshot file ``path`` (a whole
    file), or None where it does not say (written before mnopt recorded
    it)."""
    with numpy.load(path) as f:
        return int(f[N_SETS_KEY]) if N_SETS_KEY in f.files else None


class _RecordingSets(object):
    """A snapshot writer that adds the number of replica sets to what it
    writes (so that autoload tells a resize from a set's missing file),
    then hands it to the snapshot's own writer."""

    def __init__(self, writer, n_sets):
        self.writer, self.n_sets = writer, n_sets

    def __call__(self, filename, outdir, target):
        # Chainer 7's snapshot hands its writer npz.serialize's dict.
        target = dict(target)
        target[N_SETS_KEY] = numpy.asarray(self.n_sets)
        self.writer(filename, outdir, target)

    def __getattr__(self, name):
        # finalize, _add_cleanup_hook, ...: the wrapped writer's own.
        if name == 'writer':
            raise AttributeError(name)
        return getattr(self.writer, name)


class _MultiNodeSnapshot(extension.Extension):

    def __init__(self, comm, snapshot, replica_sets):
        self.comm = comm
        self.snapshot = snapshot
        sets = parse_replica_sets(
            [] if replica_sets is None else replica_sets, comm.size)
        self.sets = [sorted(s) for s in sets]
        everyone = comm.allgather_obj(self.sets)
        if any(s != self.sets for s in everyone):
            raise ValueError('ranks passed different replica_sets: %s'
                             % ', '.join('rank %d: %r' % rs
                                         for rs in enumerate(everyone)))
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
        snapshot.writer = _RecordingSets(snapshot.writer, len(self.sets))
        # This extension does the loading, for every rank alike.
        self.autoload, snapshot.autoload = snapshot.autoload, False
        if self.autoload and callable(self.base):
            raise ValueError('multi_node_snapshot: autoload needs a filename '
                             'format string to find the snapshots by, not '
                             'a callable')
        self.trigger = snapshot.trigger
        self.priority = snapshot.priority
        self.loaded = None  #: the snapshot autoload loaded, if any

    @property
    def is_master(self):
        """Whether this rank writes its replica set's snapshots."""
        return self.comm.rank == self.master

    @property
    def is_writer(self):
        return self.is_master

    def initialize(self, trainer):
        if self.autoload:
            self._autoload(trainer)
        if self.is_master:
            self.snapshot.initialize(trainer)

    def __call__(self, trainer):
        if self.is_master:
            self.snapshot(trainer)

    def on_error(self, trainer, exc, tb):
        if self.is_master:
            self.snapshot.on_error(trainer, exc, tb)

    def finalize(self):
        if self.is_master:
            self.snapshot.finalize()

    def _my_file(self, outdir, name, names):
        """The file this rank loads for snapshot ``name`` and None, or None
        and why it has none."""
        mine = '%s.%d' % (name, self.master)
        if mine in names:
            return os.path.join(outdir, mine), None
        # The first set's file, only for a snapshot that fewer sets wrote:
        # where that file does not say so, this set's file is missing.
        first = os.path.join(outdir, '%s.%d' % (name, self.sets[0][0]))
        if self.set_index > 0 and npz_is_whole(first):
            written_by = sets_that_wrote(first)
            if written_by is not None and self.set_index >= written_by:
                return first, None
        return None, '%s is missing' % mine

    def _problem(self, outdir, name, names):
        """None if this rank can load snapshot ``name``, else why not."""
        path, problem = self._my_file(outdir, name, names)
        return problem if path is None else npz_problem(path)

    def _autoload(self, trainer):
        outdir = trainer.out
        names = set(os.listdir(outdir)) if os.path.isdir(outdir) else set()
        regex = re.compile('(%s)\\.\\d+$' % _pattern(self.base))
        candidates = {m.group(1) for m in map(regex.match, names) if m}
        newest = newest_loadable(
            self.comm, {c: self._problem(outdir, c, names)
                        for c in candidates}, key=_natural_key)
        if newest is None:
            return
        # Chainer's snapshot keeps what it saves (None: the trainer) in
        # _target, as every Chainer 7 release does.
        target = getattr(self.snapshot, '_target', None) or trainer
        path, _ = self._my_file(outdir, newest, names)
        chainer.serializers.load_npz(path, target)
        self.loaded = newest


def multi_node_snapshot(comm, snapshot, replica_sets=None):
    """Wrap ``snapshot`` (``chainer.training.extensions.snapshot(...)``) so
    that the first rank of each replica set writes it, to
    ``FILENAME.RANK`` as ChainerMN's, and ``autoload`` resumes every rank
    from the newest snapshot all of them hold completely (see the module's
    doc).  ``replica_sets``: ranks or iterables of ranks, the ranks left
    out forming one more set; ``[]`` (or None): one set of every rank."""
    return _MultiNodeSnapshot(comm, snapshot, replica_sets)
