"""A timeline window (Horovod's start_timeline() / stop_timeline()):
MNOPT_TIMELINE_STEPS=START:STOP records only those steps, the calls
comm.start_timeline() / comm.stop_timeline() record between them, and
MNOPT_TIMELINE_MAX_BYTES caps each file, saying so in it and in the log.
The report says that a trace is a window, or was cut.  Serial (one rank,
the whole averaging path run: MNOPT_SINGLE_RANK_AVERAGING=1); the jobs
at 2 and 3 ranks are in tests/test_timeline_window_jobs.py."""

import logging
import os

import numpy
import pytest

import mnopt
from mnopt.report import __main__ as report, trace_analysis
from mnopt.timeline import recorder as timeline, window as timeline_window

pytestmark = pytest.mark.one_rank


@pytest.fixture(autouse=True)
def averaging_at_one_rank(monkeypatch):
    monkeypatch.setenv('MNOPT_SINGLE_RANK_AVERAGING', '1')
    for name in (timeline.ENV, timeline_window.STEPS_ENV,
                 timeline_window.MAX_BYTES_ENV):
        monkeypatch.delenv(name, raising=False)


def grads(k):
    return [('/a', numpy.full(4, k, numpy.float32))]


def seqs(path):
    return sorted(e['args']['seq'] for e in timeline.load(path)
                  if e['name'] == 'wire')


@pytest.mark.parametrize('text,steps', [
    ('100:120', (100, 120)), ('100:', (100, None)), (':20', (0, 20)),
    (' 3:4 ', (3, 4)), ('', None)])
def test_the_steps_setting_is_a_slice(text, steps):
    assert timeline_window.parse_steps(text) == steps


@pytest.mark.parametrize('text', ['100', '120:100', '5:5', '-1:3', 'a:b',
                                  '1:2:3'])
def test_a_bad_steps_setting_says_what_to_write(text):
    with pytest.raises(ValueError, match=r'MNOPT_TIMELINE_STEPS=.*START:STOP'
                                         r".*'100:120' records steps 100"):
        timeline_window.parse_steps(text)


def test_only_the_window_s_steps_are_recorded(tmp_path):
    path = str(tmp_path / 't.json')
    tl = timeline.Timeline(path, 0, steps=(3, 5))
    owner = object.__new__(type('Owner', (), {}))
    for _ in range(10):
        step = tl.begin_step(owner, 'averaging')
        with tl.span('step', 'compute', step=step):
            tl.instant('inside')
        tl.counter('bytes', n=step)
    tl.close()
    events = timeline.load(path)
    assert [e['args']['step'] for e in events if e['name'] == 'step'] == [3, 4]
    assert sum(e['name'] == 'inside' for e in events) == 2
    assert [e['args']['n'] for e in events if e['ph'] == 'C'] == [3, 4]
    edges = [(e['name'], e['args']['step']) for e in events
             if e.get('cat') == 'window']
    assert edges == [('timeline_start', 3), ('timeline_stop', 5)]
    window, = [e for e in events if e['name'] == 'mnopt_window']
    assert window['args'] == {'steps': '3:5'}


def test_an_optimizer_counts_the_steps_over_the_averagings(tmp_path):
    tl = timeline.Timeline(str(tmp_path / 't.json'), 0, steps=(0, 2))
    Owner = type('Owner', (), {})
    averaging, optimizer = Owner(), Owner()
    assert tl.begin_step(averaging, 'averaging') == 0
    assert tl.begin_step(averaging, 'averaging') == 1
    assert tl.begin_step(optimizer, 'optimizer') == 0
    assert tl.begin_step(averaging, 'averaging') is None   # not its count
    assert tl.begin_step(optimizer, 'optimizer') == 1
    assert tl.window.recording
    assert tl.begin_step(optimizer, 'optimizer') == 2
    assert not tl.window.recording
    tl.close()


def test_the_cap_stops_the_file_and_says_so(tmp_path, caplog):
    path = str(tmp_path / 't.json')
    tl = timeline.Timeline(path, 0, max_bytes=4000, batch=10 ** 9)
    with caplog.at_level(logging.WARNING, logger='mnopt.timeline'):
        for k in range(200):
            tl.record('wire', 'comm', 0.0, 1e-3, seq=k)
            if k % 10 == 0:
                tl.flush()
        tl.close()
    size = os.path.getsize(path)
    assert 3000 < size <= 4000 + 300     # the note past it, and the ']'
    events = timeline.load(path)         # whole: its closing ']' is there
    cut, = [e for e in events if e['name'] == 'mnopt_truncated']
    assert cut['args']['max_bytes'] == 4000
    wires = [e['args']['seq'] for e in events if e['name'] == 'wire']
    assert wires == list(range(len(wires))) and 0 < len(wires) < 200
    warnings = [r for r in caplog.records if 'MNOPT_TIMELINE_MAX_BYTES'
                in r.getMessage()]
    assert len(warnings) == 1


def test_no_cap_is_zero(tmp_path):
    tl = timeline.Timeline(str(tmp_path / 't.json'), 0, max_bytes=0)
    for k in range(300):
        tl.record('wire', 'comm', 0.0, 1e-3, seq=k)
    tl.close()
    assert len(seqs(tl.path)) == 300


def test_the_settings_come_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(timeline_window.STEPS_ENV, '2:4')
    monkeypatch.setenv(timeline_window.MAX_BYTES_ENV, '123456')
    tl = timeline.open_from_environment(0, str(tmp_path / 't.json'))
    try:
        assert tl.window.steps == (2, 4) and tl.max_bytes == 123456
        assert not tl.window.recording       # before step 2
    finally:
        tl.close()
    monkeypatch.setenv(timeline_window.MAX_BYTES_ENV, '1e6')
    with pytest.raises(ValueError, match='MNOPT_TIMELINE_MAX_BYTES'):
        timeline_window.max_bytes_setting()
    monkeypatch.delenv(timeline_window.MAX_BYTES_ENV)
    assert timeline_window.max_bytes_setting() == 1 << 30


def test_mean_grads_steps_in_a_window(tmp_path, monkeypatch):
    monkeypatch.setenv(timeline.ENV, str(tmp_path / 'trace.json'))
    monkeypatch.setenv(timeline_window.STEPS_ENV, '5:8')
    comm = mnopt.create_communicator('flat')
    for k in range(20):
        comm.mean_grads(grads(k))
    for k in range(3):
        comm.mean_grads_async(grads(k)).wait()
    comm.finalize()
    assert seqs(str(tmp_path / 'trace.rank0.json')) == [5, 6, 7]


def test_the_calls_record_between_them(tmp_path):
    comm = mnopt.create_communicator('flat')
    try:
        for k in range(3):
            comm.mean_grads(grads(k))      # no timeline yet
        comm.stop_timeline()               # nothing open: nothing to stop
        comm.start_timeline(str(tmp_path / 'trace.json'))
        for k in range(2):
            comm.mean_grads(grads(k))
        comm.stop_timeline()
        comm.mean_grads(grads(0))
        comm.start_timeline()              # the same file goes on
        comm.start_timeline(str(tmp_path / 'trace.json'))
        comm.mean_grads(grads(0))
        with pytest.raises(ValueError, match='already records its timeline'
                                             '.*without a path'):
            comm.start_timeline(str(tmp_path / 'other.json'))
    finally:
        comm.finalize()
    path = str(tmp_path / 'trace.rank0.json')
    assert seqs(path) == [3, 4, 6]
    events = timeline.load(path)
    assert {e['name'] for e in events if e.get('cat') == 'window'} == {
        'timeline_start', 'timeline_stop'}
    # Words, not lines: the report wraps at 80 columns.
    text = ' '.join(report.format_text(trace_analysis.analyze([path]))
                    .split())
    assert 'between comm.start_timeline() and comm.stop_timeline()' in text


def test_a_started_timeline_names_its_job(tmp_path):
    """As the one $MNOPT_TIMELINE opens: the report refuses to read it
    with another job's file as one job."""
    comm = mnopt.create_communicator('flat')
    try:
        comm.start_timeline(str(tmp_path / 'trace.json'))
        comm.mean_grads(grads(1))
    finally:
        comm.finalize()
    path = str(tmp_path / 'trace.rank0.json')
    jobs = [e['args']['job'] for e in timeline.load(path)
            if e.get('name') == 'mnopt_job']
    assert len(jobs) == 1 and jobs[0], jobs
    other = timeline.Timeline(str(tmp_path / 'trace.rank1.json'), 1)
    other.mark_job('another job')
    other.instant('x')
    other.close()
    with pytest.raises(trace_analysis.TraceError, match='2 different jobs'):
        trace_analysis.analyze([path, str(tmp_path / 'trace.rank1.json')])


def test_start_without_a_file_says_what_to_pass():
    comm = mnopt.create_communicator('flat')
    try:
        with pytest.raises(ValueError, match=r"start_timeline\('trace.json'"
                                             r"\) writes trace.rank0.json"):
            comm.start_timeline()
    finally:
        comm.finalize()


def test_the_calls_are_refused_where_the_steps_are_set(tmp_path,
                                                       monkeypatch):
    monkeypatch.setenv(timeline.ENV, str(tmp_path / 'trace.json'))
    monkeypatch.setenv(timeline_window.STEPS_ENV, '1:2')
    comm = mnopt.create_communicator('flat')
    try:
        for call in (comm.start_timeline, comm.stop_timeline):
            with pytest.raises(RuntimeError, match='MNOPT_TIMELINE_STEPS=1:2'
                                                   '.*unset it'):
                call()
    finally:
        comm.finalize()


def test_the_report_says_it_is_a_window_and_where_it_was_cut(tmp_path):
    path = str(tmp_path / 't.rank0.json')
    tl = timeline.Timeline(path, 0, steps=(100, 120), max_bytes=2500)
    owner = type('Owner', (), {})()
    for _ in range(130):
        step = tl.begin_step(owner, 'optimizer')
        with tl.span('step', 'compute', step=step):
            tl.record('wire', 'comm', timeline.clock(), timeline.clock(),
                      seq=step)
    tl.close()
    a = trace_analysis.analyze([path])
    assert a['window'] == {'steps': '100:120'}
    assert a['truncated'][0]['max_bytes'] == 2500
    assert a['truncated'][0]['step'] == 129   # noticed at close's flush
    text = ' '.join(report.format_text(a).split())   # wrapped at 80
    assert ('A window of the job: steps 100 to 119 only '
            '(MNOPT_TIMELINE_STEPS=100:120).') in text
    assert ('Rank 0: its file reached MNOPT_TIMELINE_MAX_BYTES=2500 bytes '
            '(noticed at step 129): what came after its last event is '
            'missing.') in text
