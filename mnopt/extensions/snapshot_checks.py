"""Whether a multi_node_snapshot snapshot is complete, judged alike by its
autoload (which snapshot to load) and its retention (which snapshots
count towards ``n_retains``): the file a rank would load whole (every zip
member's CRC), and for a sharded optimizer's snapshot of another number
of ranks every rank's file whole and of the same write.  Each file is
read once (remembered by its inode, time and size); a file this job wrote
and confirmed complete is not read again."""

import os

from mnopt.extensions.loadable import npz_problem
from mnopt.extensions.snapshot_records import (
    recorded_sets, shard_size, write_id)


class SnapshotChecks(object):
    """The checks of one multi_node_snapshot extension, remembered."""

    def __init__(self, ext):
        self.ext = ext   # its sets, set_index, master, sharded, comm
        self._seen = {}

    @staticmethod
    def _key(path):
        try:
            st = os.stat(path)
        except OSError:
            return None
        return path, st.st_ino, st.st_mtime_ns, st.st_size

    def problem_of_file(self, path):
        """npz_problem(path), remembered."""
        key = self._key(path)
        if key is None:
            return '%s is missing' % os.path.basename(path)
        if key not in self._seen:
            self._seen[key] = npz_problem(path)
        return self._seen[key]

    def trust(self, path):
        """``path`` was written by this job and confirmed complete (a
        temporary name renamed, or read back in the background): whole."""
        key = self._key(path)
        if key is not None:
            self._seen[key] = None

    def file_to_load(self, outdir, name, names):
        """The file this rank loads for snapshot ``name`` and None, or None
        and why it has none."""
        ext = self.ext
        mine = '%s.%d' % (name, ext.master)
        # The first set's file, for a set beyond those that wrote the
        # snapshot (a resize, which that file records): this set's own
        # file, if any, is an earlier run's.  Where the first file does
        # not say so, this set's file is needed.
        first = '%s.%d' % (name, ext.sets[0][0])
        if ext.set_index > 0 and first in names:
            written_by = recorded_sets(os.path.join(outdir, first))
            if written_by is not None and ext.set_index >= written_by:
                return os.path.join(outdir, first), None
        if mine in names:
            return os.path.join(outdir, mine), None
        return None, '%s is missing' % mine

    def problem(self, outdir, name, names):
        """``(None, write id)`` if this rank can load snapshot ``name``,
        else ``(why not, None)``: a sharded optimizer's snapshot of another
        number of ranks also needs every rank's file whole and of the same
        write (their shares are re-sharded)."""
        path, problem = self.file_to_load(outdir, name, names)
        if path is None:
            return problem, None
        problem = self.problem_of_file(path)
        if problem is not None:
            return problem, None
        mine = write_id(path)
        if not self.ext.sharded:
            return None, mine
        size = shard_size(path)
        if size is None or size == self.ext.comm.size:
            return None, mine
        for r in range(size):
            share = os.path.join(outdir, '%s.%d' % (name, r))
            problem = self.problem_of_file(share)
            if problem is not None:
                return problem, None
            if write_id(share) != mine:
                return ('its files are of different writes (%s: write %s, '
                        '%s: write %s)' % (
                            os.path.basename(path), mine,
                            os.path.basename(share), write_id(share))), None
        return None, mine
