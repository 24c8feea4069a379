"""MeanHandle: an averaging (or reduce-scatter) in progress, as its caller
holds it."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any


class MeanHandle(object):
    """An averaging in progress; ``wait()`` returns when it is done and
    raises any exception it ended with."""

    def __init__(self, future: Future[Any] | None = None) -> None:
        self._future = future

    def done(self) -> bool:
        future = self._future
        return future is None or future.done()

    def wait(self) -> None:
        # An exception is raised once, to the first caller that waits.
        future, self._future = self._future, None
        if future is not None:
            future.result()
