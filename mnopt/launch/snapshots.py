"""Which snapshots in a folder are complete, for ``python -m mnopt.launch
--take-back-after-snapshot DIR``: the launcher ends a running job to take
a host back only once a whole snapshot was written since the host
answered, never on another file (LogReport's ``log``, a temporary file,
one rank's file of a snapshot whose other files are still being written).

Snapshots are known by the names Chainer and mnopt give them (a name
that starts with ``snapshot``, as Chainer's default
``snapshot_iter_{.updater.iteration}``; ``--snapshot-pattern`` another
glob), the suffixes matched from the right (a name may hold dots), in
three forms:

- ``NAME``: one file (Chainer's snapshot, written by one rank): complete
  once it is there (Chainer writes into a temporary folder, then moves
  the file into place);
- ``NAME.K``: multi_node_snapshot (mnopt/extensions/multi_node_snapshot.py),
  one file per replica set, ``K`` its writing rank: complete once there
  are as many (of ranks of the running job) as ``NAME.0`` records sets
  wrote it (one where it records none);
- ``NAME.npz`` and ``NAME.rankK.npz``: the ImageNet example, a shared file
  and each rank's part: complete once the shared file and the part of
  every rank of the running job are there (in a folder without any
  ``.rankK.npz`` file, ``NAME.npz`` is a snapshot of one file).

A background write in flight (``.mnopt-partial.FILE``,
mnopt/extensions/background_writer.py) makes its snapshot incomplete,
unless ``FILE`` is there and newer (a partial file a crash left).  Other
names (``*.tmpPID``, ``log``, plots, folders) are no snapshot.

Leaf of the entry points: the standard library, and numpy to read the
replica sets a file records.
"""

import fnmatch
import functools
import os
import re

#: A file still being written (background_writer.PARTIAL_PREFIX).
PARTIAL_PREFIX = '.mnopt-partial.'
#: Where a multi_node_snapshot file records how many replica sets wrote
#: the snapshot (snapshot_records.N_SETS_KEY).
N_SETS_KEY = 'multi_node_snapshot/n_replica_sets'
#: The names of snapshots (--snapshot-pattern), without their suffixes.
PATTERN = 'snapshot*'
#: A snapshot's file: its snapshot's name, and which file of it, the
#: suffixes matched from the right (a name may hold dots: epoch 1.5).
FILE = re.compile(r'^(?P<name>.+?)(?:\.rank(?P<rank>\d+)\.npz|'
                  r'\.(?P<set>\d+)|(?P<npz>\.npz))?$')
#: A snapshot's whole name (no group but ``name`` matches).
WHOLE = re.compile(r'^(?P<name>.+)(?P<rank>(?!))?(?P<set>(?!))?'
                   r'(?P<npz>(?!))?$')
#: Temporary files (``*.tmpPID``) are no snapshot's.
TEMPORARY = re.compile(r'\.tmp\w*$')


def match(name, pattern=PATTERN, found=(), size=None):
    """The match of ``name``, a snapshot's file (its ``name``, ``rank``,
    ``set``, ``npz`` groups), or None.  ``NAME.K`` is replica set K's
    file only where ``NAME.0`` is there too (``found``), or K is 0, and
    K is one of the job's ``size`` ranks: else ``NAME.K`` is a snapshot's
    whole name (Chainer's ``snapshot_epoch_1.5``)."""
    m = FILE.match(name)
    if m is None or TEMPORARY.search(name):
        return None
    base, k = m.group('name'), m.group('set')
    if k is not None and (int(k) and base + '.0' not in found and
                          PARTIAL_PREFIX + base + '.0' not in found or
                          size is not None and int(k) >= size):
        m, base = WHOLE.match(name), name
    return m if fnmatch.fnmatchcase(base, pattern) else None


def listing(folder):
    """{name: modification time in ns} of the files in ``folder`` ({} where
    it cannot be read)."""
    try:
        with os.scandir(folder) as entries:
            return {e.name: e.stat().st_mtime_ns for e in entries
                    if e.is_file()}
    except OSError:
        return {}


@functools.lru_cache(maxsize=256)
def _recorded_sets(path, mtime):
    try:
        import numpy
        with numpy.load(path) as f:
            return int(f[N_SETS_KEY]) if N_SETS_KEY in f.files else 1
    except Exception:   # not an npz, cut short, removed: says nothing
        return 1


def _files_of(folder, name, files, size, parted):
    """The files of snapshot ``name`` (``files``: {file: its match}) if it
    is complete, for a job of ``size`` ranks; else None."""
    ranks = {int(m.group('rank')) for m in files.values()
             if m.group('rank') is not None}
    if parted and (ranks or name + '.npz' in files):
        need = [name + '.npz'] + ['%s.rank%d.npz' % (name, r)
                                  for r in range(size)]
        return need if all(n in files for n in need) else None
    sets = sorted(f for f, m in files.items() if m.group('set') is not None
                  and int(m.group('set')) < size)
    if sets:
        first = name + '.0'
        if first not in sets:
            return None
        path = os.path.join(folder, first)
        try:
            mtime = os.stat(path).st_mtime_ns
        except OSError:
            return None
        return sets if len(sets) >= _recorded_sets(path, mtime) else None
    whole = [f for f in (name, name + '.npz') if f in files]
    return whole or None


def complete(folder, size, found=None, pattern=PATTERN):
    """{snapshot name: [its files]} of the complete snapshots in
    ``folder`` (``found``: its ``listing``, taken now where not given),
    for a job of ``size`` ranks, snapshots named as ``pattern``."""
    found = listing(folder) if found is None else found
    snapshots = {}
    for name in found:
        m = match(name, pattern, found, size)
        if m:
            snapshots.setdefault(m.group('name'), {})[name] = m
    parted = any(m.group('rank') is not None
                 for files in snapshots.values() for m in files.values())
    writing = set()
    for name, mtime in found.items():
        m = match(name[len(PARTIAL_PREFIX):], pattern, found, size) \
            if name.startswith(PARTIAL_PREFIX) else None
        if m and found.get(name[len(PARTIAL_PREFIX):], -1) < mtime:
            writing.add(m.group('name'))
            parted = parted or m.group('rank') is not None
    done = {}
    for name, files in snapshots.items():
        if name not in writing:
            whole = _files_of(folder, name, files, size, parted)
            if whole:
                done[name] = whole
    return done


def new_since(folder, before, size, pattern=PATTERN):
    """The names of the snapshots complete in ``folder`` now whose every
    file is new or written again since ``before`` (a ``listing``), for a
    job of ``size`` ranks: an earlier run's file of the same name never
    completes one."""
    now = listing(folder)
    return sorted(name for name, files in complete(
        folder, size, now, pattern).items()
        if all(before.get(f) != now[f] for f in files))


def unknown_since(folder, before, pattern=PATTERN):
    """(``folder``'s ``listing`` now, the files new or written again since
    ``before`` (a ``listing``) where no file there is a snapshot's named
    as ``pattern``, else [])."""
    now = listing(folder)
    if any(match(f[len(PARTIAL_PREFIX):] if f.startswith(PARTIAL_PREFIX)
                 else f, pattern, now) for f in now):
        return now, []
    return now, sorted(f for f, t in now.items() if before.get(f) != t)
