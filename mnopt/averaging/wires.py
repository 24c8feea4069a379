"""The timeline's 'wire' spans of one collective (``Wires``): one per
bucket where the transport sums bucket by bucket, else one for it all."""

import contextlib
import threading

from mnopt.timeline import recorder as timelines

#: The timeline's Wires of the collective each thread is in.
_current = threading.local()


def current_wires():
    """The ``Wires`` of the collective the calling thread is in, or None."""
    return getattr(_current, 'wires', None)




class Wires(object):
    """The timeline's 'wire' spans of one collective, the span a
    ``StepStats.wire_timer`` enters (made only when the timeline is on).
    Inside it a transport that sums bucket by bucket records each bucket
    as a 'wire' (``bucket(i, nbytes)``: args ``bucket`` = its index in the
    collective, and its ``bytes``); where none did, the whole collective
    is one 'wire'.  Every span carries ``args`` (``seq`` or ``gather``,
    ``op``, ``comm``) and ``arrived``: when this thread arrived at the
    collective (``StepStats.arrive``, before the layout check where a
    late rank is waited for), in us on the trace's axis."""

    __slots__ = ('_tl', 'args', '_start', '_split', '_outer')

    def __init__(self, tl, stats, **args):
        self._tl, self.args, self._split = tl, args, False
        arrived = stats.arrived.get(threading.get_ident())
        if arrived is not None:
            args['arrived'] = round((arrived - tl.origin) * 1e6, 3)

    def __enter__(self):
        self._outer = getattr(_current, 'wires', None)
        _current.wires = self
        self._start = timelines.clock()
        return self

    def set(self, **args):
        self.args.update(args)

    @contextlib.contextmanager
    def bucket(self, index, nbytes):
        """One bucket's 'wire', inside this collective."""
        self._split = True
        start = timelines.clock()
        try:
            yield
        finally:
            args = dict(self.args, bucket=index, bytes=nbytes)
            args.pop('buckets', None)
            self._tl.record('wire', 'comm', start, timelines.clock(), **args)

    def __exit__(self, *exc):
        _current.wires = self._outer
        if not self._split:
            self._tl.record('wire', 'comm', self._start, timelines.clock(),
                            **self.args)
        return False
