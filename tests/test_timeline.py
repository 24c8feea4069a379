"""mnopt.timeline.recorder: the trace file is valid trace-event JSON, written
as it goes (a killed job leaves a readable file), and NULL records nothing.

Nothing here depends on the ranks (each process writes its own files in
its own tmp_path), so the module runs alike serially and under mpiexec.

The cost per call (CPU time, best of 7 rounds of 50000 spans with four
args, on the CPU test machine: two cores shared with other jobs)::

    with timeline.NULL.span('wire', 'comm', bytes=n, step=s, bucket=b,
                            seq=q):
        pass

an empty function call 0.04 us; a NULL span 0.63 us; a real span 3 us on
the recording thread, 9 us in all once the flusher thread has encoded and
written it (about 1 ms per step at 130 events a step).  Measured with a
loop over ``time.process_time()``; ``python -m timeit`` gives the same
order (wall time, inflated on a loaded machine).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import mnopt_records, python_path, slack
from mnopt.timeline import recorder as timeline

# The same at any number of ranks: the serial pass only (see the Makefile).
pytestmark = pytest.mark.one_rank


def _validate(events):
    """Assert the trace-event format's rules that Perfetto relies on."""
    named_pids, named_tids, seen = set(), set(), set()
    for ev in events:
        for key in ('ph', 'ts', 'pid', 'tid', 'name'):
            assert key in ev, (key, ev)
        assert isinstance(ev['pid'], int) and isinstance(ev['tid'], int)
        assert isinstance(ev['ts'], (int, float)) and ev['ts'] >= 0, ev
        if ev['ph'] == 'X':
            assert ev['dur'] >= 0, ev
        if ev['ph'] == 'M':
            if ev['name'] == 'process_name':
                named_pids.add(ev['pid'])
            if ev['name'] == 'thread_name':
                named_tids.add((ev['pid'], ev['tid']))
            assert 'name' in ev['args'] or 'sort_index' in ev['args'] or (
                'unix_us' in ev['args']), ev
        elif ev['ph'] != 'C':
            seen.add((ev['pid'], ev['tid']))
    assert {pid for pid, _ in seen} <= named_pids
    assert seen <= named_tids, seen - named_tids


def _spans(events, name=None):
    return [e for e in events if e['ph'] == 'X'
            and (name is None or e['name'] == name)]


def _thread_names(events):
    return {e['tid']: e['args']['name'] for e in events
            if e['ph'] == 'M' and e['name'] == 'thread_name'}


def test_the_file_is_valid_trace_event_json(tmp_path):
    path = str(tmp_path / 'trace.json')
    tl = timeline.Timeline(path, 3)
    with tl.span('step', 'compute', step=0):
        with tl.span('forward', 'compute', step=0):
            pass
        with tl.span('wire', 'comm', step=0, seq=0) as s:
            s.set(bytes=4096)
        tl.instant('stall', 'comm')
        tl.counter('in_flight', bytes=4096)
    start = timeline.clock()
    tl.record('unpack', 'comm', start, start + 0.002, bucket=1, step=0)
    tl.close()
    with open(path) as f:
        events = json.load(f)             # strict JSON once closed
    assert events == timeline.load(path)
    _validate(events)
    assert {e['pid'] for e in events} == {3}
    names = {e['name'] for e in events if e['ph'] == 'M'}
    assert {'process_name', 'thread_name', 'mnopt_clock'} <= names
    wire, = _spans(events, 'wire')
    assert wire['args'] == {'step': 0, 'seq': 0, 'bytes': 4096}
    assert wire['cat'] == 'comm'
    unpack, = _spans(events, 'unpack')
    assert abs(unpack['dur'] - 2000.0) < 0.01
    clock, = [e for e in events if e['name'] == 'mnopt_clock']
    # The origin on the wall clock: this process's import of the module,
    # which in a long-lived test worker can be many minutes ago.
    at_origin = time.time() - (timeline.clock() - tl.origin)
    assert abs(clock['args']['unix_us'] / 1e6 - at_origin) < slack(5)


def test_threads_get_their_own_tid_name_and_nested_spans(tmp_path):
    path = str(tmp_path / 'trace.json')
    tl = timeline.Timeline(path, 0)

    def averaging():
        tl.name_thread('averaging')
        for bucket in range(3):
            with tl.span('pack', 'comm', bucket=bucket):
                with tl.span('wire', 'comm', bucket=bucket):
                    time.sleep(0.001)

    with tl.span('step', 'compute', step=0):
        with tl.span('backward', 'compute', step=0):
            t = threading.Thread(target=averaging)
            t.start()
            t.join()
    tl.close()
    events = timeline.load(path)
    _validate(events)
    names = _thread_names(events)
    assert sorted(names.values()) == ['averaging', 'main']
    main = [tid for tid, n in names.items() if n == 'main'][0]
    assert main == 0
    packs, wires = _spans(events, 'pack'), _spans(events, 'wire')
    assert len(packs) == len(wires) == 3
    assert {e['tid'] for e in packs + wires} == {
        [tid for tid, n in names.items() if n == 'averaging'][0]}
    for outer, inner in list(zip(packs, wires)) + [
            (_spans(events, 'step')[0], _spans(events, 'backward')[0])]:
        assert outer['tid'] == inner['tid']
        assert outer['ts'] <= inner['ts']
        assert inner['ts'] + inner['dur'] <= outer['ts'] + outer['dur'] + 1e-3
    assert _spans(events, 'step')[0]['tid'] == main


def test_unnamed_threads_take_their_python_name(tmp_path):
    tl = timeline.Timeline(str(tmp_path / 't.json'), 0)
    t = threading.Thread(target=lambda: tl.instant('x'), name='loader-7')
    t.start()
    t.join()
    tl.close()
    assert 'loader-7' in _thread_names(timeline.load(tl.path)).values()


def test_null_is_inert_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(timeline.ENV, raising=False)
    tl = timeline.open_from_environment(0)
    assert tl is timeline.NULL and not tl
    first = tl.span('wire', 'comm', bytes=1)
    assert first is tl.span('pack') is timeline.NULL.span('x', 'y', step=2)
    with first as s:
        s.set(bytes=2)
    tl.record('wire', 'comm', 0.0, 1.0, bytes=1)
    tl.instant('x')
    tl.counter('c', v=1)
    tl.name_thread('averaging')
    tl.flush()
    tl.close()
    assert os.listdir(str(tmp_path)) == []
    monkeypatch.setenv(timeline.ENV, '  ')
    assert timeline.open_from_environment(0) is timeline.NULL


def test_path_rules(tmp_path, monkeypatch):
    assert timeline.trace_path('trace.json', 0) == 'trace.rank0.json'
    assert timeline.trace_path('/a/b.c/t.json', 12) == '/a/b.c/t.rank12.json'
    assert timeline.trace_path('trace', 2) == 'trace.rank2'
    assert timeline.trace_path('out/{rank}/t.json', 5) == 'out/5/t.json'
    assert timeline.trace_path('r{rank}-{rank}.json', 1) == 'r1-1.json'
    monkeypatch.setenv(timeline.ENV, str(tmp_path / 'sub' / 'trace.json'))
    tl = timeline.open_from_environment(4)
    try:
        assert tl.path == str(tmp_path / 'sub' / 'trace.rank4.json')
        assert timeline.open_from_environment(4) is tl     # one per file
        assert os.path.exists(tl.path)                     # parent made
        other = timeline.open_from_environment(
            4, explicit=str(tmp_path / 'x_{rank}.json'))
        assert other.path == str(tmp_path / 'x_4.json')
        other.close()
        assert timeline.open_from_environment(4, explicit=tl) is tl
    finally:
        tl.close()
    again = timeline.open_from_environment(4)              # closed: a new one
    assert again is not tl and again
    again.close()


def test_records_after_close_are_dropped(tmp_path):
    tl = timeline.Timeline(str(tmp_path / 't.json'), 0)
    tl.instant('before')
    tl.close()
    tl.close()
    tl.instant('after')
    tl.record('after', 'comm', 0.0, 1.0)
    with tl.span('after'):
        pass
    assert not tl
    assert [e['name'] for e in timeline.load(tl.path)
            if e['ph'] != 'M'] == ['before']


def test_a_failing_disk_stops_the_timeline_not_the_job(tmp_path):
    tl = timeline.Timeline(str(tmp_path / 't.json'), 0, flush_every=1e3)

    class Full(object):
        def write(self, text):
            raise OSError(28, 'No space left on device')

        def flush(self):
            pass

        close = flush

    tl._file = Full()
    with mnopt_records() as records:
        tl.instant('x')
        tl.flush()
    assert not tl
    said = [r.getMessage() for r in records]
    assert len(said) == 1 and 'stopped recording' in said[0], said
    assert records[0].name == 'mnopt.timeline'
    tl.instant('y')
    tl.close()


def test_a_forked_child_leaves_the_file_to_its_parent(tmp_path):
    tl = timeline.Timeline(str(tmp_path / 't.json'), 0)
    tl.instant('x')
    parent = tl._pid
    tl._pid = parent + 1        # what a child of os.fork() sees
    tl.close()                  # its atexit: must not end the parent's file
    tl._pid, tl._closed = parent, False
    tl.instant('after the child')
    tl.close()
    assert [e['name'] for e in timeline.load(tl.path) if e['ph'] == 'i'] == [
        'x', 'after the child']


def test_numpy_args_are_written_as_numbers(tmp_path):
    numpy = pytest.importorskip('numpy')
    tl = timeline.Timeline(str(tmp_path / 't.json'), 0)
    tl.instant('x', bytes=numpy.int64(7), share=numpy.float32(0.5))
    tl.close()
    ev, = [e for e in timeline.load(tl.path) if e['ph'] == 'i']
    assert ev['args'] == {'bytes': 7, 'share': 0.5}


def test_the_flusher_writes_without_close(tmp_path):
    tl = timeline.Timeline(str(tmp_path / 't.json'), 0, flush_every=0.1)
    try:
        tl.instant('early')
        deadline = time.monotonic() + slack(10)
        while time.monotonic() < deadline:
            if any(e['name'] == 'early' for e in timeline.load(tl.path)):
                break
            time.sleep(0.05)
        else:
            pytest.fail('the event was not written within %.0f s'
                        % slack(10))
        with open(tl.path) as f:
            assert not f.read().rstrip().endswith(']')
    finally:
        tl.close()


def test_loader_tolerates_a_missing_bracket_and_a_cut_last_event():
    lines = ['{"ph":"i","name":"e%d","pid":0,"tid":0,"ts":%d}' % (i, i)
             for i in range(3)]
    whole = '[\n' + ',\n'.join(lines) + '\n]\n'
    assert [e['name'] for e in timeline.loads(whole)] == ['e0', 'e1', 'e2']
    assert len(timeline.loads(whole[:whole.rindex(']')])) == 3
    assert len(timeline.loads('[\n' + ',\n'.join(lines) + ',\n')) == 3
    cut = '[\n' + ',\n'.join(lines)
    assert len(timeline.loads(cut[:-7])) == 2
    assert timeline.loads('[') == []
    # The file a writer killed before its first write leaves (a reader
    # polling a live trace can find it so too).
    assert timeline.loads('') == [] and timeline.loads('\n') == []
    assert len(timeline.loads(json.dumps({'traceEvents': [{'a': 1}]}))) == 1
    with pytest.raises(ValueError):
        timeline.loads('[\n{"ph": broken},\n' + lines[0] + '\n]')
    with pytest.raises(ValueError):
        timeline.loads('not a trace')


_RECORDER = r'''
import sys
from mnopt.timeline import recorder as timeline
tl = timeline.Timeline(sys.argv[1], 0, flush_every=0.05)
step = 0
while True:
    with tl.span('step', 'compute', step=step):
        tl.record('wire', 'comm', timeline.clock(), timeline.clock(),
                  step=step, bytes=step * 8)
    step += 1
    if sys.argv[2] == 'exit' and step == 100:
        break        # no close(): atexit writes the rest and the bracket
'''


def _spawn(path, how):
    return subprocess.Popen(
        [sys.executable, '-c', _RECORDER, path, how],
        env=dict(os.environ, PYTHONPATH=python_path()),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_killed_job_leaves_a_loadable_file(tmp_path):
    path = str(tmp_path / 'killed.json')
    proc = _spawn(path, 'loop')
    try:
        deadline = time.monotonic() + slack(60)
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.exists(path) and len(
                    _spans(timeline.load(path), 'step')) >= 200:
                break
            time.sleep(0.05)
        else:
            pytest.fail('no 200 steps written: %s' % (proc.poll() is None
                                                      or proc.stderr.read()))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    with open(path) as f:
        text = f.read()
    assert not text.rstrip().endswith(']')
    events = timeline.load(path)
    _validate(events)
    steps = [e['args']['step'] for e in _spans(events, 'step')]
    assert len(steps) >= 200
    assert steps == list(range(len(steps)))       # no gap, no duplicate


def test_exit_without_close_writes_the_bracket(tmp_path):
    path = str(tmp_path / 'exited.json')
    done = subprocess.run(
        [sys.executable, '-c', _RECORDER, path, 'exit'],
        env=dict(os.environ, PYTHONPATH=python_path()),
        capture_output=True, text=True, timeout=slack(60))
    assert done.returncode == 0, done.stderr
    with open(path) as f:
        events = json.load(f)
    _validate(events)
    assert len(_spans(events, 'step')) == len(_spans(events, 'wire')) == 100


def test_a_file_closed_and_opened_again_keeps_its_events(tmp_path):
    """Every communicator recording into a file finalized, then a new one
    made with the same path: the process goes on in that file (its
    earlier events stay; the file is valid JSON after each close).  A
    path first opened in this process starts afresh."""
    template = str(tmp_path / 'trace.json')
    path = timeline.trace_path(template, 0)
    with open(path, 'w') as f:
        f.write('[{"ph": "X", "name": "an earlier run"}]\n')
    first = timeline.open_from_environment(0, template)
    first.record('wire', 'comm', 1.0, 1.5, seq=1)
    first.close()
    assert [e['name'] for e in json.load(open(path))
            if e.get('ph') == 'X'] == ['wire']
    again = timeline.open_from_environment(0, template)
    assert again is not first and again
    again.record('wire', 'comm', 2.0, 2.5, seq=2)
    again.close()
    events = json.load(open(path))       # a valid JSON array
    assert [e['args']['seq'] for e in events
            if e.get('ph') == 'X'] == [1, 2]
    # Closed before any event: the next one follows the '[' alone.
    empty = str(tmp_path / 'empty.json')
    timeline.open_from_environment(0, empty).close()
    later = timeline.open_from_environment(0, empty)
    later.record('step', 'compute', 0.0, 1.0)
    later.close()
    assert [e['name'] for e in json.load(open(timeline.trace_path(
        empty, 0))) if e.get('ph') == 'X'] == ['step']
