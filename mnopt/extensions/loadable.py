"""Which snapshot every rank can load: whether a .npz file is whole (every
member's CRC checked), and the newest candidate that every rank can load,
of one write, the same on every rank (shared by multi_node_snapshot's
autoload and the multi-node checkpointer)."""

import os
import re
import zipfile

from mnopt.common import log

# The warnings' logger is multi_node_snapshot's, where they were first said.
logger = log.get('mnopt.extensions.multi_node_snapshot')


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


#: One rank's file of a snapshot written by every rank beside a shared
#: file (``snapshot_iter_80.rank0.npz`` beside ``snapshot_iter_80.npz``).
_RANK_FILE = re.compile(r'^(?P<shared>.+)\.rank(?P<rank>\d+)\.npz$')


def rank_file_problem(path):
    """Why ``path``, given as the snapshot to load, is not one: it is one
    rank's file beside the snapshot's shared file, which is the one to
    pass (each rank then finds its own); None otherwise.  Checked before
    a loader derives the rank files from ``path``, which would name
    ``...rank0.rank0.npz`` missing."""
    found = _RANK_FILE.match(os.path.basename(path))
    if found is None:
        return None
    shared = os.path.join(os.path.dirname(path), found.group('shared')
                          + '.npz')
    if not os.path.isfile(shared):
        return None
    return ("%s is rank %s's file of a snapshot, not the snapshot: pass %s "
            '(every rank then reads its own file beside it)' % (
                os.path.basename(path), found.group('rank'), shared))


def npz_is_whole(path):
    """Whether ``path`` is a complete .npz (zip) file: every member's CRC
    checks (a file cut short, never finished or damaged is not)."""
    return npz_problem(path) is None


def newest_loadable(comm, problems, key, what='snapshot', writes=None):
    """The newest candidate (by ``key``) that every rank can load, the
    same on every rank, or None.

    ``problems`` maps each candidate this rank found to None (it can load
    it) or why it cannot.  A candidate another rank did not find is not
    loadable there.  ``writes`` maps candidates to the write id of the
    files this rank would read (None: not recorded); where ranks' ids
    differ the candidate mixes two writes and is not loadable.  Rank 0
    warns about each newer candidate skipped, naming every rank's reason,
    so a damaged newest snapshot costs the work since the one before it,
    never the run."""
    writes = writes or {}
    said = comm.everyone({c: (p, writes.get(c)) for c, p in problems.items()},
                         'which %s to load' % what)
    everyone = [{c: p for c, (p, _) in d.items()} for d in said]

    def reasons(candidate):
        found = ['rank %d: %s' % (r, p.get(candidate, 'no file found'))
                 for r, p in enumerate(everyone)
                 if p.get(candidate, 'no file found') is not None]
        if found:
            return found
        ids = [d[candidate][1] for d in said]
        if any(i != ids[0] for i in ids):
            found = ['its files are of different writes (%s)' % ', '.join(
                'rank %d: write %s' % (r, i) for r, i in enumerate(ids))]
        return found

    found = set().union(*everyone)
    usable = [c for c in found if not reasons(c)]
    newest = max(usable, key=key) if usable else None
    if comm.rank == 0:
        for c in sorted(found, key=key):
            if newest is None or key(c) > key(newest):
                # A report, not a fault in the user's code: logger
                # mnopt.extensions.multi_node_snapshot (mnopt/common/log.py).
                logger.warning('mnopt: warning: skipping %s %s, which not '
                               'every rank can load: %s', what, c,
                               '; '.join(reasons(c)))
    return newest
