"""``comm.start_timeline(path=None)`` and ``comm.stop_timeline()``:
Horovod's calls of those names, mixed into every communicator.

They are this rank's, as Horovod's are: no communication, so calling them
on one rank only records that rank only.  For the same window on every
rank, call them at the same step on every rank (or set
MNOPT_TIMELINE_STEPS, which every rank agrees on at start-up;
mnopt/timeline/window.py says what a step is).
"""

from __future__ import annotations

import os

from mpi4py import MPI

from mnopt.timeline import recorder as timelines
from mnopt.communicators.resources import hold_timeline, let_go_of_timeline


class TimelineCalls(object):
    """Starting and stopping this rank's timeline (mnopt/timeline/recorder.py).
    Needs the host's ``timeline``, ``_resources`` and ``averaging``."""

    def start_timeline(self, path: str | None = None) -> None:
        """Record this rank's timeline from now on.

        ``path``: the file, as for $MNOPT_TIMELINE (``trace.json`` writes
        ``trace.rank<N>.json``); needed where no timeline is open yet
        (neither $MNOPT_TIMELINE nor ``timeline=``), else left out or the
        same.  Refused where MNOPT_TIMELINE_STEPS chooses the steps."""
        tl = self.timeline
        rank = MPI.COMM_WORLD.rank
        wanted = path and os.path.abspath(timelines.trace_path(path, rank))
        if tl and wanted and wanted != tl.path:
            raise ValueError(
                'start_timeline(%r): this rank already records its timeline '
                'in %s ($%s or timeline=): call start_timeline() without a '
                'path' % (path, tl.path, timelines.ENV))
        if not tl:
            if not path:
                raise ValueError(
                    'start_timeline() needs a file to write: pass one '
                    "(comm.start_timeline('trace.json') writes "
                    'trace.rank%d.json here), or set $%s'
                    % (rank, timelines.ENV))
            self._attach_timeline(timelines.open_from_environment(rank, path))
        self.timeline.start()

    def stop_timeline(self) -> None:
        """Record nothing more until ``start_timeline()``; what was
        recorded is in the file at once (it is closed, with its ``]``,
        when the communicator is finalized or the process exits).  Does
        nothing where no timeline is open."""
        self.timeline.stop()

    def _attach_timeline(self, tl):
        """Record in ``tl`` from now on (the averaging thread, if any, is
        named by its Python name there)."""
        old = self.timeline
        self.timeline = self._resources.timeline = \
            self.averaging.timeline = hold_timeline(tl)
        let_go_of_timeline(old)
