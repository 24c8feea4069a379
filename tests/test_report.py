"""python -m mnopt.report on synthetic traces written with mnopt.timeline.

The traces are built with ``Timeline.record`` at explicit timestamps
(origin 0, times in seconds), as if ranks 0, 1, 2 had run, so every
expected number is known in advance and nothing depends on how fast this
machine runs.  One step, 100 ms, on every rank (ms from the step's start)::

    main:       idle 0-5, forward 5-35, backward 35-75, wait 75-85,
                update 85-95, idle 95-100
    averaging:  4 buckets of 4 MiB: pack b-1..b, wire b..b+6 for b = 40,
                50, 60, 70 (the last wire ends inside the wait)

Rank 2 is the straggler: its pack and wire start 3 ms later (the wire
still ends with the others'), and rank 1's clock is 250 ms ahead (its
wall-clock origin says nothing of it: the report must align on the ends
of the collectives).  So per step: compute 80 ms, exposed 10 ms, idle
10 ms; hidden 27 ms on ranks 0 and 1 (pack 4 + wire 6+6+6+5 inside
backward), 15 on rank 2; the link idle 12/40 of backward on ranks 0 and
1 and 21/40 on rank 2.

Nothing here depends on the ranks: each process writes its own files.
"""

import json
import os
import subprocess
import sys
import threading

import pytest

from conftest import python_path, slack
from mnopt.report import (__main__ as report, rules as report_rules,
                          trace_analysis)
from mnopt.timeline import recorder as timeline

# The same at any number of ranks: the serial pass only (see the Makefile).
pytestmark = pytest.mark.one_rank

MS = 1e-3
STEPS = 10
BUCKET = 4 << 20


def _write(path, rank, main, averaging, shift=0.0, server=()):
    """A trace of ``rank``: ``main``, ``averaging`` and ``server`` are
    lists of (name, cat, start_s, end_s, args), recorded on the main
    thread and on threads named 'averaging' and 'server'; ``shift`` moves
    every time (a host clock off by that much)."""
    tl = timeline.Timeline(path, rank, origin=0.0)
    for name, cat, start, end, args in main:
        tl.record(name, cat, start + shift, end + shift, **args)

    def other(role, spans):
        tl.name_thread(role)
        for name, cat, start, end, args in spans:
            tl.record(name, cat, start + shift, end + shift, **args)

    for role, spans in (('averaging', averaging), ('server', server)):
        if spans or role == 'averaging':
            t = threading.Thread(target=other, args=(role, spans))
            t.start()
            t.join()
    tl.close()
    return path


def _steps(late=0.0, wait=(75, 85), update=(85, 95), on_main=False,
           step_ms=100):
    """The main and averaging spans of STEPS steps (see the docstring);
    ``late`` delays this rank's arrival at each collective; ``on_main``
    puts the averaging on the main thread (the sync mode)."""
    main, avg = [], []
    for k in range(STEPS):
        t = 10.0 + k * step_ms * MS

        def at(ms):
            return t + ms * MS

        main += [('step', 'compute', at(0), at(step_ms), dict(step=k)),
                 ('forward', 'compute', at(5), at(35), dict(step=k)),
                 ('backward', 'compute', at(35), at(75), dict(step=k)),
                 ('update', 'compute', at(update[0]), at(update[1]),
                  dict(step=k))]
        if wait:
            main.append(('wait', 'comm', at(wait[0]), at(wait[1]),
                         dict(step=k)))
        for b, start in enumerate((40, 50, 60, 70)):
            args = dict(step=k, bucket=b, bytes=BUCKET, seq=k * 4 + b)
            avg += [('pack', 'comm', at(start - 1) + late, at(start) + late,
                     dict(args)),
                    ('wire', 'comm', at(start) + late, at(start + 6), args)]
    return (main + avg, []) if on_main else (main, avg)


@pytest.fixture
def traces(tmp_path):
    paths = []
    for rank, late, shift in ((0, 0, 0), (1, 0, 0.25), (2, 3 * MS, 0)):
        main, avg = _steps(late)
        paths.append(_write(str(tmp_path / ('t.rank%d.json' % rank)), rank,
                            main, avg, shift))
    return paths


def _by_rank(a):
    return {s['rank']: s for s in a['per_rank']}


def test_the_breakdown_per_rank_and_overall(traces):
    a = trace_analysis.analyze(traces)
    assert a['ranks'] == [0, 1, 2] and a['alignment'] == 'ends'
    ranks = _by_rank(a)
    for rank, hidden in ((0, 27), (1, 27), (2, 15)):
        s = ranks[rank]
        assert s['steps'] == STEPS
        assert s['step_ms'] == pytest.approx(100, abs=0.01)
        assert s['compute_ms'] == pytest.approx(80, abs=0.01)
        assert s['exposed_ms'] == pytest.approx(10, abs=0.01)
        assert s['idle_ms'] == pytest.approx(10, abs=0.01)
        assert s['hidden_ms'] == pytest.approx(hidden, abs=0.01), rank
        assert s['exposed_share'] == pytest.approx(0.1, abs=1e-4)
    o = a['overall']
    assert o['steps'] == 3 * STEPS
    assert o['hidden_ms'] == pytest.approx((27 + 27 + 15) / 3, abs=0.01)
    assert o['compute_share'] == pytest.approx(0.8, abs=1e-4)
    each = [s for s in a['each_step'] if s['rank'] == 2]
    assert [s['step'] for s in each] == list(range(STEPS))
    assert all(s['hidden_ms'] == pytest.approx(15, abs=0.01) for s in each)
    skipped = trace_analysis.analyze(traces, skip=4)
    assert skipped['overall']['steps'] == 3 * (STEPS - 4)
    assert skipped['each_step'][0]['step'] == 4


def test_the_straggler_is_named_with_its_share_and_lateness(traces):
    a = trace_analysis.analyze(traces)
    c = a['collectives']
    assert c['count'] == c['matched'] == 4 * STEPS
    straggler, = c['stragglers']
    assert straggler['rank'] == 2 and straggler['share'] == 1.0
    assert straggler['late_ms'] == pytest.approx(3, abs=0.01)
    assert [x['rank'] for x in c['last']] == [2]
    said = [x for x in a['advice'] if x['rule'] == 'straggler']
    assert 'rank 2 arrives last in 100% of collectives, by 3.0 ms' in (
        said[0]['evidence'])
    # On the wall clocks alone, rank 1 (250 ms ahead) looks late instead.
    wall = trace_analysis.analyze(traces, align_how='wall')
    assert wall['alignment'] == 'wall'
    assert [x['rank'] for x in wall['collectives']['stragglers']] == [1]


def test_bucket_advice_when_the_link_idles_between_buckets(traces):
    a = trace_analysis.analyze(traces)
    b = a['buckets']
    assert b['buckets'] == 4 and b['bucket_bytes'] == BUCKET
    assert b['idle_share'] == pytest.approx((12 + 12 + 21) / 120, abs=1e-4)
    said, = [x for x in a['advice'] if x['rule'] == 'bucket_bytes']
    assert 'bucket_bytes=%d) (16 MiB; the ImageNet example: ' \
        '--bucket-bytes %d)' % (16 << 20, 16 << 20) in said['advice']
    assert 'buckets of 4 MiB leave the link idle 38% of backward' in (
        said['evidence'])
    assert {x['rule'] for x in a['advice']} == {'bucket_bytes', 'straggler'}


def test_bandwidth_against_the_link_rate(traces):
    # 4 MiB allreduced on 3 ranks in 3 ms after the last arrival.
    busbw = BUCKET * 8 * (2 * 2 / 3) / 3e-3
    slow = trace_analysis.analyze(traces, link_bits=100e9)
    assert slow['bandwidth']['busbw_bits'] == pytest.approx(busbw, rel=1e-3)
    said, = [x for x in slow['advice'] if x['rule'] == 'bandwidth']
    assert '15% of the 100 Gbit/s link' in said['evidence']
    fast = trace_analysis.analyze(traces, link_bits=10e9)
    assert 'bandwidth' not in {x['rule'] for x in fast['advice']}


def test_a_job_that_tuned_is_not_told_to_tune(tmp_path):
    """A trace with the tuning's exchanges ('wait', op 'tuning': the job
    passed 'auto') gets the link advice without the 'auto' one."""
    def job(tuned):
        paths = []
        for rank in (0, 1):
            main, avg = _steps()
            if tuned and rank == 1:
                avg.append(('wait', 'comm', 10.0 + 76 * MS,
                            10.0 + 77 * MS, dict(op='tuning')))
            paths.append(_write(str(tmp_path / ('%s%d.json' % (
                tuned, rank))), rank, main, avg))
        return trace_analysis.analyze(paths, link_bits=100e9)

    plain = job(False)
    said, = [x for x in plain['advice'] if x['rule'] == 'bandwidth']
    assert not plain['tuned'] and "bucket_bytes='auto'" in said['advice']
    tuned = job(True)
    said, = [x for x in tuned['advice'] if x['rule'] == 'bandwidth']
    assert tuned['tuned'] and "'auto'" not in said['advice']
    assert said['advice'].startswith('check the link')


def test_overlap_advice_when_communication_is_all_exposed(tmp_path):
    paths = []
    for rank in (0, 1):
        main, avg = _steps(wait=(95, 135), update=(135, 145), step_ms=150)
        avg = [(name, cat, s + 55 * MS, e + 55 * MS, args)   # in the wait
               for name, cat, s, e, args in avg]
        paths.append(_write(str(tmp_path / ('o%d.json' % rank)), rank,
                            main, avg))
    a = trace_analysis.analyze(paths)
    o = a['overall']
    assert o['hidden_ms'] == pytest.approx(0, abs=0.01)
    assert o['exposed_ms'] == pytest.approx(40, abs=0.01)
    assert o['idle_ms'] == pytest.approx(150 - 80 - 40, abs=0.01)
    said, = [x for x in a['advice'] if x['rule'] == 'overlap']
    assert 'overlap=True' in said['advice'] and '27%' in said['evidence']
    assert 'wire_dtype' not in {x['rule'] for x in a['advice']}
    assert a['collectives']['stragglers'] == []


def test_communication_on_the_main_thread_is_exposed(tmp_path):
    main, avg = _steps(wait=None, on_main=True)
    path = _write(str(tmp_path / 'sync.json'), 0, main, avg)
    o = trace_analysis.analyze([path])['overall']
    # pack 4 + wire 23 inside backward, 1 after it: all exposed, no
    # longer compute; nothing hidden.
    assert o['exposed_ms'] == pytest.approx(28, abs=0.01)
    assert o['compute_ms'] == pytest.approx(80 - 27, abs=0.01)
    assert o['hidden_ms'] == pytest.approx(0, abs=0.01)


def test_a_trace_without_steps_still_reports_its_collectives(tmp_path,
                                                            capsys):
    paths = []
    for rank in (0, 1):
        _, avg = _steps(late=rank * 2 * MS)
        paths.append(_write(str(tmp_path / ('c%d.json' % rank)), rank, [],
                            avg))
    assert report.main(paths) == 0
    text = capsys.readouterr().out
    assert "No 'step' spans" in text
    assert 'rank 1 arrives last in 100% of collectives, by 2.0 ms' in text
    a = trace_analysis.analyze(paths)
    assert a['overall'] is None and a['buckets'] is None
    assert [x['rule'] for x in a['advice']] == ['straggler']


def test_the_command_line_text_and_json(traces, capsys):
    assert report.main(traces) == 0
    text = capsys.readouterr().out
    assert 'rank 2 arrives last in 100% of collectives, by 3.0 ms' in text
    assert 'bucket_bytes=16777216' in text
    row = [line for line in text.splitlines() if line.startswith('all ')][0]
    assert '100.0 ms' in row and '80.0 ms  80%' in row
    assert report.main(['--json', '--link-rate', '100gbit'] + traces) == 0
    printed = json.loads(capsys.readouterr().out)
    again = trace_analysis.analyze(traces, link_bits=100e9)
    assert printed == json.loads(json.dumps(again))
    assert printed['per_rank'] == again['per_rank']
    assert printed['advice'] == again['advice']


def test_a_merged_file_reads_as_the_ranks_did(traces, tmp_path, capsys):
    merged = str(tmp_path / 'merged.json')
    assert report.main(['--merge', merged] + traces) == 0
    capsys.readouterr()
    with open(merged) as f:
        events = json.load(f)
    assert {e['pid'] for e in events} == {0, 1, 2}
    assert min(e['ts'] for e in events if e['ph'] == 'X') >= 0
    one, three = (trace_analysis.analyze([merged]),
                  trace_analysis.analyze(traces))
    for key in ('per_rank', 'overall', 'buckets', 'advice'):
        assert json.dumps(one[key]) == json.dumps(three[key]), key
    assert one['collectives']['stragglers'][0]['rank'] == 2
    # On the merged file's axis the ranks already agree: rank 1's
    # collectives end with rank 0's.
    ranks = trace_analysis.load_traces([merged])
    trace_analysis.align(ranks, 'none')
    ends = [trace_analysis._wire_ends(ranks[r]) for r in (0, 1)]
    assert all(abs(ends[0][k] - ends[1][k]) < 1 for k in ends[0])


def test_bad_input_is_an_argparse_error(traces, tmp_path, capsys):
    copy = str(tmp_path / 'copy.json')
    with open(traces[0]) as f, open(copy, 'w') as g:
        g.write(f.read())
    for argv, said in (([str(tmp_path / 'missing.json')], 'no such trace'),
                       (['--link-rate', 'fast'] + traces, 'not a link rate'),
                       (traces + [copy], 'rank 0 is in both'),
                       (traces + [traces[0]], 'given twice'),
                       ([], 'required')):
        with pytest.raises(SystemExit) as e:
            report.main(argv)
        assert e.value.code == 2
        assert said in capsys.readouterr().err
    garbage = tmp_path / 'garbage.json'
    garbage.write_text('hello')
    with pytest.raises(SystemExit):
        report.main([str(garbage)])
    assert 'not a trace-event JSON array' in capsys.readouterr().err


def test_link_rates_and_sizes():
    assert report.parse_rate('1gbit') == 1e9
    assert report.parse_rate('250mbit') == 250e6
    assert report.parse_rate('10Gbit/s') == 10e9
    assert report.parse_rate('1.5g') == 1.5e9
    assert report.parse_rate('1e9') == 1e9
    for bad in ('1gbps', 'gbit', '-1gbit'):
        with pytest.raises(ValueError):
            report.parse_rate(bad)
    assert report_rules.size(4 << 20) == '4 MiB'
    assert report_rules.rate(2.5e8) == '250 Mbit/s'


def test_python_m_mnopt_report(traces):
    def run(*argv):
        return subprocess.run(
            [sys.executable, '-m', 'mnopt.report'] + list(argv),
            env=dict(os.environ, PYTHONPATH=python_path(),
                     MNOPT_LINK_RATE='100gbit'),
            capture_output=True, text=True, timeout=slack(60))
    helped = run('--help')
    assert helped.returncode == 0 and '--link-rate' in helped.stdout
    done = run(*traces)
    assert done.returncode == 0, done.stderr
    # $MNOPT_LINK_RATE (the text wrapped within 80 columns)
    assert 'of the 100 Gbit/s link' in ' '.join(done.stdout.split())
    missing = run('/nonexistent/trace.json')
    assert missing.returncode == 2 and 'no such trace' in missing.stderr


def test_the_rows_of_a_plot_are_each_ranks_threads_on_one_axis(traces):
    """report_plot.rows: main thread first, then averaging, for each rank;
    every bar inside the window, times from its start, on the common axis
    (rank 1's clock, 250 ms ahead, moved back)."""
    from mnopt.report import plot as report_plot
    ranks = trace_analysis.load_traces(traces)
    trace_analysis.align(ranks)
    lo, hi, what = report_plot.window(ranks, 2, 2)
    assert hi - lo == pytest.approx(200e3, abs=1.0)   # steps 2 and 3
    assert what.startswith('steps 2 to 3')
    # Past the last step: the last one, and the label says so.
    assert report_plot.window(ranks, 50, 3)[2].startswith(
        'step %d' % (STEPS - 1))
    drawn = report_plot.rows(ranks, lo, hi)
    assert [label for label, _ in drawn] == [
        'rank %d %s' % (r, t) for r in (0, 1, 2)
        for t in ('main', 'averaging')]
    for label, bars in drawn:
        assert all(0 <= start and start + length <= 200.0 + 1e-6
                   for _, start, length in bars), label
    main = dict(drawn)
    # Each rank's forward of step 2 at 5-35 ms of the window.
    for r in (0, 1, 2):
        forwards = sorted(s for n, s, _ in main['rank %d main' % r]
                          if n == 'forward')
        assert forwards[0] == pytest.approx(5.0, abs=0.01), (r, forwards)
    # The straggler's wires start 3 ms after the others'.
    late = sorted(s for n, s, _ in main['rank 2 averaging'] if n == 'wire')
    early = sorted(s for n, s, _ in main['rank 0 averaging'] if n == 'wire')
    assert late[0] - early[0] == pytest.approx(3.0, abs=0.01)


def test_plot_writes_an_image(traces, tmp_path, capsys):
    pytest.importorskip('matplotlib', reason='--plot needs matplotlib')
    out = tmp_path / 'steps.png'
    assert report.main(['--plot', str(out), '--plot-steps', '2', '--skip',
                        '1'] + traces) == 0
    assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        report.main(['--plot', str(out), '--plot-steps', '0'] + traces)
    assert exit_.value.code == 2
    assert '--plot-steps' in capsys.readouterr().err


# -- per-bucket wires, arrivals, reduction servers ---------------------------

def _one_collective_a_step(avg, ring=False):
    """The 4 bucket wires of each step as one collective (seq = the
    step), each with its bucket index; ``ring``: one span of the 4 (40 to
    76 ms) with ``buckets=4``, as the ring records them."""
    out, first = [], {}
    for name, cat, start, end, args in avg:
        args = dict(args, seq=args['step'])
        if name == 'wire' and ring:
            if args['bucket'] == 0:
                first[args['step']] = start
            if args['bucket'] == 3:
                out.append((name, cat, first[args['step']], end, dict(
                    args, bucket=0, buckets=4, bytes=4 * BUCKET)))
            continue
        out.append((name, cat, start, end, args))
    return out


@pytest.mark.parametrize('ring', [False, True])
def test_the_buckets_of_one_collective(tmp_path, ring):
    paths = []
    for rank, late in ((0, 0), (1, 0), (2, 3 * MS)):
        main, avg = _steps(late)
        paths.append(_write(str(tmp_path / ('b%d.json' % rank)), rank,
                            main, _one_collective_a_step(avg, ring)))
    a = trace_analysis.analyze(paths)
    c = a['collectives']
    assert c['count'] == c['matched'] == STEPS, 'its buckets are one'
    straggler, = c['stragglers']
    assert straggler['rank'] == 2
    assert straggler['late_ms'] == pytest.approx(3, abs=0.01)
    b = a['buckets']
    assert b['buckets'] == 4 and b['bucket_bytes'] == BUCKET
    # The link idles between the bucket wires (not within the ring's).
    idle = 0 if ring else (12 + 12 + 21) / 120
    assert b['idle_share'] == pytest.approx(idle, abs=1e-4)
    colls = trace_analysis.collectives(trace_analysis.load_traces(paths))
    assert {v[2] for c in colls for v in c.values()} == {4 * BUCKET}


def test_arrival_is_the_averagings_start_not_the_wires(tmp_path):
    # Rank 2 enters every averaging 5 ms late; the others wait for it in
    # the layout check, so every wire starts when it comes: only the
    # 'arrived' arg shows who was late.
    paths = []
    for rank in (0, 1, 2):
        main, avg = _steps()
        avg = [(n, c, s, e, dict(args, arrived=round(
            (s - (0 if rank == 2 else 5 * MS)) * 1e6, 3)))
            if n == 'wire' else (n, c, s, e, args)
            for n, c, s, e, args in avg]
        paths.append(_write(str(tmp_path / ('a%d.json' % rank)), rank,
                            main, avg))
    a = trace_analysis.analyze(paths)
    straggler, = a['collectives']['stragglers']
    assert straggler['rank'] == 2 and straggler['share'] == 1.0
    assert straggler['late_ms'] == pytest.approx(5, abs=0.01)
    # Without it, no one is late.
    for path in paths:
        events = [e for e in timeline.load(path)]
        for e in events:
            e.get('args', {}).pop('arrived', None)
        with open(path, 'w') as f:
            json.dump(events, f)
    b = trace_analysis.analyze(paths)
    assert b['collectives']['stragglers'] == []


def _server_spans():
    """A server's spans of each step: per 4 MiB chunk a receive, a sum
    and a send (during forward: a background averaging's); no seq."""
    out = []
    for k in range(STEPS):
        for start in (11, 16, 21, 26):        # during forward
            t = 10.0 + k * 0.1 + start * MS
            out += [('wire', 'comm', t, t + 2 * MS,
                     dict(op='recv', bytes=BUCKET)),
                    ('sum', 'comm', t + 2 * MS, t + 3 * MS,
                     dict(bytes=BUCKET)),
                    ('wire', 'comm', t + 3 * MS, t + 4 * MS,
                     dict(op='send', bytes=BUCKET))]
    return out


def test_reduction_servers_are_neither_workers_nor_collectives(traces,
                                                               tmp_path):
    before = trace_analysis.analyze(traces)
    # A colocated server on rank 0's timeline, and a server process
    # (rank 3: no step, only its thread 'server').
    main, avg = _steps()
    with_colocated = [_write(str(tmp_path / 's0.json'), 0, main, avg,
                             server=_server_spans())] + traces[1:]
    server = _write(str(tmp_path / 's3.json'), 3, [], [],
                    server=_server_spans())
    a = trace_analysis.analyze(with_colocated + [server])
    assert a['ranks'] == [0, 1, 2, 3]
    assert [s['rank'] for s in a['per_rank']] == [0, 1, 2]
    assert trace_analysis.workers(trace_analysis.load_traces(
        with_colocated + [server])) == [0, 1, 2]
    for key in ('collectives', 'bandwidth', 'buckets'):
        assert a[key] == before[key], key
    # The colocated server's work runs while rank 0 computes: hidden.
    hidden = _by_rank(a)[0]['hidden_ms'] - _by_rank(before)[0]['hidden_ms']
    assert hidden == pytest.approx(4 * 4, abs=0.01)


def test_files_of_different_jobs_are_refused(tmp_path, capsys):
    """Each job names itself in its files (the first communicator over
    COMM_WORLD agrees on an id): files of two jobs are not read as one;
    files without a name (older ones) still are."""
    main, avg = _steps()
    paths = []
    for rank, job in ((0, 'aaaa'), (1, 'bbbb'), (2, None)):
        tl = timeline.Timeline(str(tmp_path / ('t.rank%d.json' % rank)),
                               rank, origin=0.0)
        if job:
            tl.mark_job(job)
            tl.mark_job('ignored: the first one counts')
        for name, cat, start, end, args in main:
            tl.record(name, cat, start, end, **args)
        tl.close()
        paths.append(tl.path)
    with pytest.raises(trace_analysis.TraceError, match='2 different jobs'):
        trace_analysis.load_traces(paths)
    assert sorted(trace_analysis.load_traces(paths[::2])) == [0, 2]
    with pytest.raises(SystemExit):
        report.main(paths)
    assert 'different jobs' in capsys.readouterr().err


def test_the_value_given_to_mnopt_timeline_finds_the_rank_files(
        traces, tmp_path, capsys):
    # MNOPT_TIMELINE=t.json wrote t.rank0.json ...: the user passes what
    # they set, as the docs show it.
    for given in ('t.json', 't.rank{rank}.json'):
        assert report.main([str(tmp_path / given)]) == 0
        out = capsys.readouterr().out
        assert out.startswith('mnopt report: 3 ranks'), out
    with pytest.raises(SystemExit) as e:
        report.main([str(tmp_path / 'other.json')])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert 'no such trace file: %s' % (tmp_path / 'other.json') in err
    assert 'nor per-rank files %s' % (tmp_path / 'other.rank0.json') in err


def _set_hosts(paths, hosts):
    """Record ``hosts[i]`` as the host of the rank in ``paths[i]``."""
    for path, host in zip(paths, hosts):
        events = timeline.load(path)
        for ev in events:
            if ev.get('name') == 'mnopt_clock':
                ev['args']['host'] = host
        with open(path, 'w') as f:
            json.dump(events, f)


def _late_rank_traces(tmp_path, late_rank):
    paths = []
    for rank in range(3):
        main, avg = _steps(3 * MS if rank == late_rank else 0.0)
        paths.append(_write(str(tmp_path / ('t.rank%d.json' % rank)), rank,
                            main, avg))
    return paths


def test_a_late_rank_0_on_one_machine_is_not_blamed_on_its_host(tmp_path):
    paths = _late_rank_traces(tmp_path, 0)
    _set_hosts(paths, ['box'] * 3)
    a = trace_analysis.analyze(paths)
    assert a['hosts'] == 1
    said, = [x for x in a['advice'] if x['rule'] == 'straggler']
    assert "host" not in said['advice'], said
    # What rank 0 does alone: the log, the printing, the plots.
    assert 'rank 0 alone' in said['advice'], said
    assert 'log' in said['advice'] and 'print' in said['advice'], said
    assert 'rank 0 arrives last in 100% of collectives' in said['evidence']


def test_a_late_rank_on_its_own_host_is_blamed_on_that_host(tmp_path):
    paths = _late_rank_traces(tmp_path, 2)
    _set_hosts(paths, ['a', 'a', 'b'])
    a = trace_analysis.analyze(paths)
    assert a['hosts'] == 2
    said, = [x for x in a['advice'] if x['rule'] == 'straggler']
    assert "look at rank 2's host (b)" in said['advice'], said
    # On one machine the host is the same for all: what differs is the
    # rank's own work.
    _set_hosts(paths, ['a'] * 3)
    said, = [x for x in trace_analysis.analyze(paths)['advice']
             if x['rule'] == 'straggler']
    assert "host" not in said['advice'] and 'rank 2' in said['advice']


def _traces_late_by(tmp_path, late_ms):
    paths = []
    for rank in range(2):
        main, avg = _steps(late_ms * MS if rank == 1 else 0.0)
        paths.append(_write(str(tmp_path / ('t.rank%d.json' % rank)), rank,
                            main, avg))
    return paths


@pytest.mark.parametrize('late_ms,straggler', [
    (0.5, False),   # under 1 ms
    (1.5, False),   # 1.5% of the 100 ms step
    (3.0, True)])
def test_a_straggler_is_late_by_a_share_of_the_step(tmp_path, capsys,
                                                    late_ms, straggler):
    paths = _traces_late_by(tmp_path, late_ms)
    a = trace_analysis.analyze(paths)
    assert [x['rank'] for x in a['collectives']['last']] == [1]
    assert [x['rank'] for x in a['collectives']['stragglers']] == (
        [1] if straggler else [])
    assert any(x['rule'] == 'straggler' for x in a['advice']) == straggler
    assert report.main(paths) == 0
    text = capsys.readouterr().out
    assert (': a straggler' in text) == straggler, text
    assert ('no straggler (a rank last in more than half of them, late by '
            '2% of the step and 1 ms or more)' in ' '.join(text.split())) \
        == (not straggler), text


def test_the_text_counts_steps_per_rank_within_80_columns(traces, capsys):
    assert report.main(traces) == 0
    text = capsys.readouterr().out
    assert '(%d steps per rank;' % STEPS in text, text
    # A path alone on its line may be longer: it is never broken.
    long = [line for line in text.splitlines()
            if len(line) > 80 and len(line.split()) > 1]
    assert long == [], long
    assert report.main(traces[:2] + [traces[2]] + ['--skip', '4']) == 0
    assert '(%d steps per rank;' % (STEPS - 4) in capsys.readouterr().out


def test_a_folder_of_rank_files_is_read(traces, tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith('mnopt report: 3 ranks')
    empty = tmp_path / 'empty'
    empty.mkdir()
    with pytest.raises(SystemExit) as e:
        report.main([str(empty)])
    assert e.value.code == 2
    assert '%s is a folder without per-rank trace files (NAME.rank0.json ' \
        '...): pass the files' % empty in capsys.readouterr().err
    _write(str(tmp_path / 'u.rank0.json'), 0, *_steps())
    with pytest.raises(SystemExit) as e:
        report.main([str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert 'holds the trace files of several jobs (t.rank*.json, ' \
        'u.rank*.json): pass one of them, as %s' % (tmp_path / 't.json') \
        in err, err


def test_the_advice_names_flags_the_example_takes():
    """Each rule's advice says how to follow it in the ImageNet example;
    every flag it names is one the example's parser has."""
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, 'mnopt', 'report', 'rules.py')) as f:
        rules = f.read()
    with open(os.path.join(root, 'examples', 'imagenet',
                           'train_imagenet.py')) as f:
        example = f.read()
    named = set(re.findall(r'(--[a-z][a-z-]+)', rules))
    assert {'--bucket-bytes', '--overlap', '--allreduce-grad-dtype'} <= named
    taken = set(re.findall(r"add_argument\('(--[a-z][a-z-]+)'", example))
    assert named <= taken, named - taken


def test_each_kind_of_wire_is_one_collective_across_ranks():
    # The running statistics local steps average at a sync carry no seq
    # (which numbers gradient averagings) but their local step: the same
    # collective on every rank, kept apart from the averagings.
    key = trace_analysis.collective_key
    assert key({'comm': 'c', 'seq': 3}) == ('c', 3)
    assert key({'comm': 'c', 'gather': 2}) == ('c', 'allgather', 2)
    assert key({'comm': 'c', 'persistents': 4}) == ('c', 'persistents', 4)
    assert key({'comm': 'c', 'persistents': 4}) != key(
        {'comm': 'c', 'seq': 4})
    assert key({'comm': 'c'}) is None
