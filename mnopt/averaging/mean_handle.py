"""MeanHandle: an averaging (or reduce-scatter) in progress, as its caller
holds it."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from mnopt.timeline import recorder as timelines


class MeanHandle(object):
    """An averaging in progress; ``wait()`` returns when it is done and
    raises any exception it ended with.  ``timeline``: where a ``wait()``
    that blocks is recorded ('wait': exposed communication); ``stats``
    (a StepStats, mnopt/timeline/step_stats.py): where the time ``wait()`` took
    is counted as exposed ('waited')."""

    def __init__(self, future: Future[Any] | None = None,
                 timeline: Any = timelines.NULL, stats: Any = None) -> None:
        self._future = future
        self._timeline = timeline
        self._stats = stats

    def done(self) -> bool:
        future = self._future
        return future is None or future.done()

    def wait(self) -> None:
        # An exception is raised once, to the first caller that waits.
        future, self._future = self._future, None
        if future is None:
            return
        tl, stats = self._timeline, self._stats
        start = timelines.clock()
        try:
            if tl and not future.done():
                with tl.span('wait', 'comm'):
                    future.result()
            else:
                future.result()
        finally:
            if stats is not None:
                stats.add_time('waited', timelines.clock() - start)
