"""MeanHandle: an averaging (or reduce-scatter) in progress, as its caller
holds it."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from mnopt import timeline as timelines


class MeanHandle(object):
    """An averaging in progress; ``wait()`` returns when it is done and
    raises any exception it ended with.  ``timeline``: where a ``wait()``
    that blocks is recorded ('wait': exposed communication)."""

    def __init__(self, future: Future[Any] | None = None,
                 timeline: Any = timelines.NULL) -> None:
        self._future = future
        self._timeline = timeline

    def done(self) -> bool:
        future = self._future
        return future is None or future.done()

    def wait(self) -> None:
        # An exception is raised once, to the first caller that waits.
        future, self._future = self._future, None
        if future is None:
            return
        tl = self._timeline
        if tl and not future.done():
            with tl.span('wait', 'comm'):
                future.result()
        else:
            future.result()
