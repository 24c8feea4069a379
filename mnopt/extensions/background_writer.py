"""Snapshots written in the background (``multi_node_snapshot(...,
asynchronous=True)``): the state is copied to host memory at the step
boundary, where the snapshot is taken, and a thread writes the copy while
training goes on.

A file appears under its snapshot's name only when it is complete: the
thread writes ``.mnopt-partial.NAME`` beside it, flushes it to the disk
(fsync), reads it back (every member's CRC: loadable.npz_problem), then
renames it into place and flushes the directory.  A kill at any moment
leaves at most a partial file under the temporary name, never a snapshot
that cannot be loaded; the previous snapshot stays until the retention
(``n_retains``) removes it, which only ever keeps the newest snapshots
every writer has completed.  One write is in flight at a time: the next
snapshot first waits for it (and raises its error).

``phase_hook``, if set, is called as ``phase_hook(phase, filename)`` at
each named phase of a write (``copied``: on the training thread, the
state in host memory; ``writing``: the first bytes written; ``written``:
flushed to the disk, before the check; ``renamed``: in place), so that
tests can pause or kill a rank there.
"""

import os
import threading

import numpy
from chainer.serializers import save_npz
from chainer.training.extensions import snapshot_writers

from mnopt.extensions.loadable import npz_problem

#: Prefix of a file still being written (never a snapshot's name).
PARTIAL_PREFIX = '.mnopt-partial.'

#: Tests set it: ``phase_hook(phase, filename)`` at each phase of a write.
phase_hook = None


def _phase(phase, filename):
    if phase_hook is not None:
        phase_hook(phase, filename)


def host_copy(target):
    """``target`` (``{key: array}``, Chainer's serialized state) with
    every array copied to host memory: what training changes after this
    is not in the snapshot.  CuPy arrays come to the host (unverified
    without a GPU: Chainer's serializer already brings them over)."""
    copied = {}
    for key, value in target.items():
        if hasattr(value, 'get') and not isinstance(value, numpy.ndarray):
            copied[key] = value.get()   # a CuPy array
        else:
            copied[key] = numpy.array(value, copy=True)
    return copied


class _FirstWriteHook(object):
    """A file object that calls the ``writing`` phase once, at its first
    bytes."""

    def __init__(self, f, filename):
        self.f, self.filename, self.started = f, filename, False

    def write(self, data):
        written = self.f.write(data)
        if not self.started and len(data):
            self.started = True
            self.f.flush()
            _phase('writing', self.filename)
        return written

    def __getattr__(self, name):
        return getattr(self.f, name)


def _fsync_directory(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_verified(filename, outdir, arrays, compression=True):
    """Write ``arrays`` to ``outdir/filename`` as an .npz file: under a
    temporary name, flushed to the disk, checked, then renamed into
    place.  A file that does not read back whole raises OSError."""
    final = os.path.join(outdir, filename)
    partial = os.path.join(outdir, PARTIAL_PREFIX + filename)
    save = numpy.savez_compressed if compression else numpy.savez
    with open(partial, 'wb') as f:
        save(_FirstWriteHook(f, filename), **arrays)
        f.flush()
        os.fsync(f.fileno())
    _phase('written', filename)
    problem = npz_problem(partial)
    if problem is not None:
        raise OSError('the snapshot written to %s does not read back: %s '
                      '(check the disk and its space)' % (partial, problem))
    os.replace(partial, final)
    _fsync_directory(outdir)
    _phase('renamed', filename)


def remove_partial_files(outdir, suffix):
    """Remove files an earlier run left half written in ``outdir`` (their
    names end with ``suffix``: one writer's own)."""
    if not os.path.isdir(outdir):
        return
    for name in os.listdir(outdir):
        if name.startswith(PARTIAL_PREFIX) and name.endswith(suffix):
            try:
                os.remove(os.path.join(outdir, name))
            except FileNotFoundError:
                pass


def complete_names(outdir):
    """The names in ``outdir`` but partial files' (of writes in flight or
    cut short), which are never snapshots whatever the filename."""
    try:
        return {n for n in os.listdir(outdir)
                if not n.startswith(PARTIAL_PREFIX)}
    except OSError:
        return set()


class BackgroundWriter(object):
    """A Chainer snapshot writer (``writer(filename, outdir, target)``)
    that copies ``target`` to host memory and writes it on a thread of
    its own (see the module's doc).  ``wait()`` waits for the write in
    flight and raises its error, if any."""

    def __init__(self, compression=True):
        self.compression = compression
        self._thread = None
        self._error = None

    def __call__(self, filename, outdir, target):
        arrays = host_copy(target)
        _phase('copied', filename)
        self.wait()
        os.makedirs(outdir, exist_ok=True)
        self._thread = threading.Thread(
            target=self._write, args=(filename, outdir, arrays),
            name='mnopt-snapshot-writer', daemon=True)
        self._thread.start()

    def _write(self, filename, outdir, arrays):
        try:
            write_verified(filename, outdir, arrays, self.compression)
        except BaseException as e:   # raised on the training thread
            self._error = e

    def in_flight(self):
        """Whether a write is still going on."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self):
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def finalize(self):
        self.wait()


def background_writer_for(writer):
    """The background writer that stands in for Chainer's default
    ``writer`` under ``asynchronous=True``; ValueError for any other
    writer (it would be ignored)."""
    if type(writer) is not snapshot_writers.SimpleWriter or getattr(
            writer, '_savefun', save_npz) is not save_npz:
        raise ValueError(
            'multi_node_snapshot(asynchronous=True) writes in the '
            'background itself: leave the snapshot\'s writer out (it was '
            '%r)' % (writer,))
    kwds = getattr(writer, '_kwds', {})
    return BackgroundWriter(compression=kwds.get('compression', True))
