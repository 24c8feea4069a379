"""A recorder of where each step's time goes: Chrome trace-event JSON.

One file per rank in the "JSON Array Format" that Perfetto and
chrome://tracing load and ``python -m mnopt.report`` reads::

    tl = timeline.open_from_environment(rank)    # NULL unless MNOPT_TIMELINE
    with tl.span('forward', 'compute', step=i):
        ...
    tl.record('wire', 'comm', t0, t1, bytes=n, bucket=b, step=i, seq=k)

Events: complete spans (``"ph": "X"``), ``ts`` and ``dur`` in us from one
origin per process (``clock()``, time.perf_counter, at import: shared by
every thread), ``pid`` = the rank, ``tid`` = 0 for the main thread, then
1, 2, ... as threads first record; instants (``"i"``), counters (``"C"``);
metadata (``"M"``) naming the process ("rank N") and each thread, and
``mnopt_clock``, the origin on the wall clock (``args.unix_us``).

Phases (``name``; the report relies on them).  On the main thread, cat
'compute': 'step' (one iteration, holding the others), 'forward',
'backward', 'update'; cat 'comm': 'wait' (the main thread blocked on
averaging: exposed communication).  On the averaging thread ('averaging'),
or the main thread where averaging runs there (sync mode), cat 'comm':
'pack' (gradients into a bucket), 'cast' (packing that changes the dtype
to the wire's), 'wire' (the collective: one per bucket where the
transport sums bucket by bucket, else one holding ``buckets`` of them),
'unpack'.  On a reduction server's thread ('server': a colocated one on
its worker's timeline, a server process in its own file, process 'server
N'), per chunk a 'wire' (op 'recv': every worker's share in), a 'sum'
(the reduction) and at the end a 'wire' (op 'send').  Args where known:
``step``, ``bucket`` (its index in its collective), ``buckets``,
``bytes``, ``seq`` (the n-th averaging of the communicator, the same n on
every rank), ``gather`` (ZeRO's n-th parameter all-gather, which has no
seq: the averaging counter is kept in snapshots), ``comm`` (which
communicator, where a rank has several), ``op`` (of a 'wire':
'allreduce', 'reduce_scatter', 'allgather', 'vote', 'recv', 'send'),
``arrived`` (of a collective's 'wire': when this rank arrived at it, us
on the trace's axis, before the check of the layout where a late rank is
waited for; the wire starts after it).

Recording appends a tuple to a list (thread-safe, no lock); a background
thread writes them in batches, at least every ``flush_every`` s (0.5),
sooner once ``batch`` (1024) wait, and ``close()`` (also at exit) writes
the rest and the closing ``]``.  A job killed outright leaves every event
up to the last flush, without the ``]`` (the format allows it; ``load``
reads it).  Should writing fail (a full disk), the timeline says so once
(logger 'mnopt.timeline') and stops; the job goes on.

``NULL`` records nothing: its ``span()`` returns one shared do-nothing
context manager, so instrumented code costs a call when the timeline is
off, and ``bool(NULL)`` is False (``if tl: tl.record(...)`` skips costly
arguments).

One idea, the trace file: writing it and reading it back (over 400
lines with both).  Leaf module: imports only the standard library and
mnopt.common.log.
"""

import atexit
import json
import logging
import os
import socket
import threading
import time

from mnopt.common import log
from mnopt.timeline import window as timeline_window

logger = log.get('mnopt.timeline')   # docs/observability.md

#: The clock every timestamp is read on (seconds), and its origin.
clock = time.perf_counter
ORIGIN = clock()
#: The environment variable naming the file (see ``trace_path``).
ENV = 'MNOPT_TIMELINE'


def _nothing(*args, **kwargs):
    pass


#: The attempt number ``python -m mnopt.launch`` gives each run (0 first).
RESTART_ENV = 'MNOPT_RESTART'


def attempt_path(path, attempt):
    """trace.rank0.json -> trace.rank0.attempt1.json."""
    head, ext = os.path.splitext(path)
    return '%s.attempt%d%s' % (head, attempt, ext or '.json')


def keep_earlier_attempt(path):
    """Under ``python -m mnopt.launch``, attempt N (N >= 1) keeps the
    file an earlier attempt wrote at ``path`` as ``attempt_path(path,
    N - 1)`` (the timeline of the failure) instead of overwriting it.
    The report reads the files it is given: the latest by the name
    MNOPT_TIMELINE says, an earlier attempt's by its own."""
    attempt = os.environ.get(RESTART_ENV, '')
    if not attempt.isdigit() or int(attempt) < 1 or \
            not os.path.exists(path):
        return
    try:
        os.replace(path, attempt_path(path, int(attempt) - 1))
    except OSError:
        pass


class _NullSpan(object):
    __slots__ = ()
    set = staticmethod(_nothing)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL_SPAN = _NullSpan()


class NullTimeline(object):
    """A timeline that records nothing (the module's ``NULL``): every
    method of Timeline, doing nothing; ``span()`` returns one shared
    do-nothing context manager."""

    path = None
    record = instant = counter = mark_job = name_thread = flush = close = \
        begin_step = start = stop = staticmethod(_nothing)

    def __bool__(self):
        return False

    def span(self, name, cat='', **args):
        return _NULL_SPAN


NULL = NullTimeline()


class _Span(object):
    __slots__ = ('_tl', '_name', '_cat', 'args', '_start')

    def __init__(self, tl, name, cat, args):
        self._tl, self._name, self._cat, self.args = tl, name, cat, args

    def __enter__(self):
        self._start = clock()
        return self

    def __exit__(self, *exc):
        self._tl.record(self._name, self._cat, self._start, clock(),
                        **self.args)
        return False

    def set(self, **args):
        """Add args known only inside the span (the bytes received)."""
        self.args.update(args)


class Timeline(object):
    """Records this process's events as rank ``rank`` into ``path``.

    ``origin`` (default: the module's ORIGIN) is the ``clock()`` reading
    that is time zero in the file; a test gives 0.0 to record spans at
    timestamps of its own choosing.  ``role`` names the process ('rank N';
    a reduction server process: 'server N').
    """

    def __init__(self, path, rank, origin=None, flush_every=0.5,
                 batch=1024, role='rank', append=False, steps=None,
                 max_bytes=timeline_window.DEFAULT_MAX_BYTES):
        self.path, self.rank = path, int(rank)
        #: Which steps it records (MNOPT_TIMELINE_STEPS, or the calls
        #: start() and stop()); ``max_bytes``: the file's cap (0: none).
        self.window = timeline_window.Window(steps)
        self.max_bytes, self._written, self._full = max_bytes, 0, False
        self._by_call = False       # start() or stop() was called
        self.origin = ORIGIN if origin is None else origin
        self._batch, self._first = batch, True
        self._events = []           # appended without a lock (one C call)
        self._tids = {}             # thread ident -> tid
        self._lock = threading.Lock()     # tids, the file, _first
        self._closed, self._pid = False, os.getpid()
        self._job = None            # mark_job's, once
        if append and os.path.exists(path):
            # Go on with a file this process closed: its events stay.
            self._first = not _reopen(path)
            self._file = open(path, 'a', encoding='utf-8')
        else:
            keep_earlier_attempt(path)
            self._file = open(path, 'w', encoding='utf-8')
            self._file.write('[\n')
            self._written = 2
        unix_us = (time.time() - (clock() - self.origin)) * 1e6
        for name, args in (('process_name', {'name': '%s %d' % (role,
                                                                 self.rank)}),
                           ('process_sort_index', {'sort_index': self.rank}),
                           # The host: the report tells a late rank on a
                           # machine of its own from one sharing it.
                           ('mnopt_clock', {'unix_us': round(unix_us, 3),
                                            'rank': self.rank,
                                            'host': socket.gethostname()})):
            self._events.append(('M', name, None, 0.0, None, 0, args))
        if steps is not None:
            # The report says that the file holds a window of the job.
            self._events.append(('M', 'mnopt_window', None, 0.0, None, 0, {
                'steps': timeline_window.describe(steps)}))
        self.flush()
        self._stop, self._wake = threading.Event(), threading.Event()
        self._flusher = threading.Thread(
            target=self._flush_loop, args=(flush_every,), daemon=True,
            name='mnopt-timeline-flush')
        self._flusher.start()
        atexit.register(self.close)

    def __bool__(self):
        return not self._closed

    def __repr__(self):
        return 'Timeline(%r, rank=%d%s)' % (
            self.path, self.rank, ', closed' if self._closed else '')

    # -- recording ---------------------------------------------------------

    def _tid(self):
        ident = threading.get_ident()
        tid = self._tids.get(ident)
        return self._new_thread(ident) if tid is None else tid

    def _new_thread(self, ident, role=None):
        with self._lock:
            thread = threading.current_thread()
            if thread is threading.main_thread():
                tid = 0
            else:
                tid = self._tids.get(ident) or max(
                    [0] + list(self._tids.values())) + 1
            role = role or ('main' if tid == 0 else thread.name)
            self._tids[ident] = tid
            self._events.append(('M', 'thread_name', None, 0.0, None, tid,
                                 {'name': role}))
            self._events.append(('M', 'thread_sort_index', None, 0.0, None,
                                 tid, {'sort_index': tid}))
        return tid

    def name_thread(self, role):
        """Name the calling thread in the trace ('averaging', 'server');
        call it before the thread records (else its Python thread name
        is used, 'main' for the main thread)."""
        if not self._closed:
            self._new_thread(threading.get_ident(), role)

    def span(self, name, cat='', **args):
        """A context manager recording a complete event around its block;
        ``as s`` gives ``s.set(**args)`` for args known inside it."""
        if not self.window.recording:     # outside the window: the no-op
            return _NULL_SPAN
        return _Span(self, name, cat, args)

    def record(self, name, cat, start, end, **args):
        """A complete event from ``start`` to ``end``, two ``clock()``
        readings (seconds) taken elsewhere on this thread."""
        if self._closed or not self.window.recording:
            return
        self._events.append(('X', name, cat, start, end - start,
                             self._tid(), args))
        if len(self._events) >= self._batch:
            self._wake.set()        # the flusher writes them, not this thread

    def instant(self, name, cat='', **args):
        """A moment on this thread (a stall noticed, a rebuild)."""
        if not self._closed and self.window.recording:
            self._events.append(('i', name, cat, clock(), None, self._tid(),
                                 args))

    def mark_job(self, job):
        """Name the job this file belongs to (the same id in every rank's
        file; the first one given counts), so that the report refuses to
        read files of different jobs as one."""
        if not self._closed and not self._job:
            self._job = job
            self._events.append(('M', 'mnopt_job', None, 0.0, None, 0,
                                 {'job': job}))

    def counter(self, name, **values):
        """A counter track of this process (``bytes_in_flight=n``)."""
        if not self._closed and self.window.recording:
            self._events.append(('C', name, None, clock(), None, 0, values))

    # -- the window (mnopt/timeline/window.py) -------------------------------

    def begin_step(self, owner, kind='averaging', number=None):
        """A step of ``owner`` begins ('optimizer': an update, 'averaging':
        a mean_grads call): its number where ``owner`` counts this
        timeline's steps, else None.  ``number``: the job's step, where
        ``owner`` knows it (an optimizer, over a resume).  Recording
        starts or stops there as MNOPT_TIMELINE_STEPS says."""
        if self._closed:
            return None
        was = self.window.recording
        number = self.window.begin_step(owner, kind, number)
        if self.window.recording != was:
            self._window_changed('steps')
        return number

    def start(self):
        """Record from now on (``comm.start_timeline()``)."""
        self._set_by_call(True)

    def stop(self):
        """Record nothing until ``start()``; what was recorded is written
        at once (``comm.stop_timeline()``)."""
        self._set_by_call(False)

    def _set_by_call(self, on):
        was = self.window.recording
        self.window.set_by_call(on)    # refused under MNOPT_TIMELINE_STEPS
        if self._closed:
            return
        if not self._by_call:
            self._by_call = True
            self._events.append(('M', 'mnopt_window', None, 0.0, None, 0,
                                 {'by': 'calls'}))
        if on != was:
            self._window_changed('call')

    def _window_changed(self, by):
        """An instant where recording started or stopped; a stop has what
        came before it written now."""
        on = self.window.recording
        self._events.append(('i', 'timeline_start' if on else 'timeline_stop',
                             'window', clock(), None, self._tid(),
                             {'step': self.window.step, 'by': by}))
        if not on:
            self._wake.set()

    # -- writing -----------------------------------------------------------

    def _encode(self, ev):
        """One event as a line of JSON, formatted by hand (about three
        times as fast as json.dumps of a dict: names repeat, args are
        mostly ints)."""
        ph, name, cat, start, dur, tid, args = ev
        text = '{"ph":"%s","name":%s,"pid":%d,"tid":%d,"ts":%s' % (
            ph, _quoted(name), self.rank, tid,
            '0' if ph == 'M' else '%.3f' % ((start - self.origin) * 1e6))
        if cat is not None:
            text += ',"cat":' + _quoted(cat)
        if dur is not None:
            text += ',"dur":%.3f' % (max(dur, 0.0) * 1e6)
        if ph == 'i':
            text += ',"s":"t"'
        if args:
            text += ',"args":{%s}' % ','.join([
                _quoted(k) + ':' + (str(v) if type(v) is int else _DUMPS(v))
                for k, v in args.items()])
        return text + '}'

    def flush(self):
        """Write the events recorded so far (one write, then a flush)."""
        with self._lock:
            n = len(self._events)
            if not n or self._file is None:
                return
            batch = self._events[:n]
            del self._events[:n]      # appends since only add after them
            lines = [] if self._full else [self._encode(ev) for ev in batch]
            if self.max_bytes and lines:
                lines = self._within_cap(lines)
            if not lines:
                return
            text = ',\n'.join(lines)
            try:
                self._file.write(text if self._first else ',\n' + text)
                self._file.flush()
                self._written += len(text) + (0 if self._first else 2)
            except (OSError, ValueError) as e:     # a full disk: give up
                self._closed = True
                self._file = None
                log.say(logger, logging.WARNING, 'mnopt: the timeline %s '
                        'stopped recording: %s', self.path, e)
            self._first = False

    def _within_cap(self, lines):
        """The ``lines`` that fit under ``max_bytes``; where the cap is
        reached, a note saying so instead of the rest (then nothing more
        is written: said once in the log too)."""
        room = self.max_bytes - self._written
        for i, line in enumerate(lines):
            room -= len(line) + 2
            if room < 0:
                self._full = True
                log.say(logger, logging.WARNING, 'mnopt: the timeline %s '
                        'reached %s=%d bytes: it records nothing more (raise '
                        'it, or record fewer steps with %s=START:STOP)',
                        self.path, timeline_window.MAX_BYTES_ENV,
                        self.max_bytes, timeline_window.STEPS_ENV)
                return lines[:i] + [self._encode((
                    'M', 'mnopt_truncated', None, 0.0, None, 0, {
                        'max_bytes': self.max_bytes, 'step': self.window.step,
                        'at_us': round((clock() - self.origin) * 1e6, 3)}))]
        return lines

    def _flush_loop(self, every):
        while not self._stop.is_set():
            self._wake.wait(every)
            self._wake.clear()
            self.flush()

    def close(self):
        """Write what is left and the closing bracket; later records are
        dropped.  Idempotent; also run at exit."""
        if self._closed or os.getpid() != self._pid:
            self._closed = True     # a forked child: the file is the parent's
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._flusher is not threading.current_thread():
            self._flusher.join()
        self.flush()
        with self._lock:
            if self._file is not None:
                try:
                    self._file.write('\n]\n')
                    self._file.close()
                except (OSError, ValueError):
                    pass
                self._file = None
        atexit.unregister(self.close)


def _reopen(path):
    """Take the closing bracket off the trace file ``path`` so that
    events can follow; whether it holds an event already."""
    with open(path, 'rb+') as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 64))
        tail = f.read()
        body = tail.rstrip()
        if body.endswith(b']'):
            body = body[:-1].rstrip()
        kept = size - len(tail) + len(body)
        f.truncate(kept)
        return kept > 0 and not body.endswith(b'[')


def _quoted(text, _cache={}):
    """``text`` as a JSON string (names and categories repeat: cached)."""
    quoted = _cache.get(text)
    if quoted is None:
        quoted = _cache[text] = json.dumps(str(text))
    return quoted


def _plain(value):
    """An arg JSON cannot write as is: a NumPy scalar as its number, any
    other object as its str()."""
    item = getattr(value, 'item', None)
    return item() if callable(item) else str(value)


_DUMPS = json.JSONEncoder(separators=(',', ':'), default=_plain).encode


# -- opening from the environment ---------------------------------------------

_open = {}
_open_lock = threading.Lock()
#: This process's job id (name_job), for the timelines opened after it.
_job = None


def name_job(job):
    """This process's job is ``job`` (the id the first communicator over
    COMM_WORLD agreed on; a later one keeps the first), returned: every
    timeline ``open_from_environment`` opens from now on names it, one
    ``comm.start_timeline(path)`` opens too."""
    global _job
    with _open_lock:
        _job = _job or job
        return _job


def trace_path(template, rank):
    """The file of ``rank``: ``{rank}`` in ``template`` replaced, else
    ``.rank<N>`` put before the extension (trace.json -> trace.rank0.json,
    trace -> trace.rank0)."""
    if '{rank}' in template:
        return template.replace('{rank}', str(rank))
    base, ext = os.path.splitext(template)
    return '%s.rank%d%s' % (base, rank, ext)


def open_from_environment(rank, explicit=None, role='rank'):
    """The timeline of ``rank``: the file ``explicit`` names (a path
    template as for ``trace_path``), else the one $MNOPT_TIMELINE names,
    else NULL.  One Timeline per file and process: communicators of one
    rank share it.  A Timeline given as ``explicit`` is returned as is.
    ``role``: see Timeline."""
    if isinstance(explicit, (Timeline, NullTimeline)):
        return explicit
    template = explicit or os.environ.get(ENV, '').strip()
    if not template:
        return NULL
    path = os.path.abspath(trace_path(template, rank))
    with _open_lock:
        tl = _open.get(path)
        if tl is None or not tl:
            parent = os.path.dirname(path)
            os.makedirs(parent, exist_ok=True)
            # A file this process wrote and closed (every communicator
            # recording there was finalized) goes on: a later one appends.
            tl = _open[path] = Timeline(
                path, rank, role=role, append=tl is not None,
                steps=timeline_window.steps_setting(),
                max_bytes=timeline_window.max_bytes_setting())
            if _job:
                tl.mark_job(_job)
        return tl


# -- reading ------------------------------------------------------------------

def loads(text):
    """The events of a trace's text: the JSON Array Format with or without
    its closing ``]``, a trailing comma, or a last event cut short by a
    killed writer (dropped); an empty text (a writer killed before its
    first write): none; also the JSON Object Format
    (``{"traceEvents": [...]}``)."""
    stripped = text.lstrip()
    if not stripped:
        return []
    if stripped.startswith('{'):
        return json.loads(stripped)['traceEvents']
    if not stripped.startswith('['):
        raise ValueError('not a trace-event JSON array')
    decoder = json.JSONDecoder()
    events, i, n = [], text.index('[') + 1, len(text)
    while True:
        while i < n and text[i] in ' \t\r\n,':
            i += 1
        if i >= n or text[i] == ']':
            return events
        try:
            event, i = decoder.raw_decode(text, i)
        except ValueError:
            if '\n' in text[i:].rstrip():
                raise               # damage before the end: not a kill
            return events           # the last event, cut short
        events.append(event)


def load(path):
    """The events of the trace file ``path`` (see ``loads``)."""
    with open(path, encoding='utf-8') as f:
        return loads(f.read())
