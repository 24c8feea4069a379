"""``python -m mnopt.report TRACE...``: where each step's time went.

Reads the timelines a job wrote (``MNOPT_TIMELINE``,
mnopt/timeline/recorder.py: one file per rank, or one merged file) and prints,
per rank and over all ranks, the mean step and its compute, exposed
communication (the main thread blocked on it), hidden communication (behind
compute) and idle time; the ranks that arrive last at the collectives; the
bandwidth the collectives reach; and which setting would have helped, with the
evidence (mnopt/report/rules.py)::

    MNOPT_TIMELINE=trace.json mpiexec -n 4 python train.py
    python -m mnopt.report trace.json    # the value of MNOPT_TIMELINE
    python -m mnopt.report .             # the folder of trace.rank*.json
    python -m mnopt.report trace.rank*.json
    python -m mnopt.report --link-rate 1gbit --skip 5 trace.rank*.json
    python -m mnopt.report --json trace.rank*.json > report.json
    python -m mnopt.report --merge all.json trace.rank*.json  # for Perfetto
    python -m mnopt.report --plot steps.png trace.rank*.json  # a picture

How the numbers are computed: mnopt/report/trace_analysis.py.
"""

import argparse
import glob
import json
import os
import re
import sys
import textwrap

from mnopt.report import rules
from mnopt.report import plot as report_plot, trace_analysis
from mnopt.timeline import step_stats, recorder as timeline
from mnopt.timeline import window as timeline_window

#: '1gbit', '250mbit', '10Gbit/s', '1e9'... -> bits per second (shared
#: with the CommunicationReport: mnopt/timeline/step_stats.py).
parse_rate = step_stats.parse_rate


#: The report's width: an 80-column terminal.
WIDTH = 80
#: The table's row: 78 columns.
_ROW = '%-7s %10s %14s %14s %14s %14s'


def _cells(s):
    return ('%7.1f ms' % s['step_ms'],) + tuple(
        '%6.1f ms %4s' % (s[k + '_ms'], rules.pct(s[k + '_share']))
        for k in ('compute', 'exposed', 'hidden', 'idle'))


def _wrapped(line):
    """``line`` within WIDTH columns, continued two columns further in
    than it starts (a path longer than a line stays whole)."""
    indent = line[:len(line) - len(line.lstrip())]
    return textwrap.fill(line, WIDTH, subsequent_indent=indent + '  ',
                         break_long_words=False, break_on_hyphens=False)


def _steps_per_rank(a):
    counts = sorted({s['steps'] for s in a['per_rank']})
    return ('%d' % counts[0] if len(counts) == 1 else
            '%d to %d' % (counts[0], counts[-1]))


def _window_lines(a):
    """What part of the job the traces hold: a window of its steps, a
    file cut at its cap."""
    lines, window = [], a.get('window')
    if window and 'steps' in window:
        start, stop = window['steps'].split(':')
        lines.append('A window of the job: steps %s to %s only (%s=%s).' % (
            start, int(stop) - 1 if stop else 'its end',
            timeline_window.STEPS_ENV, window['steps']))
    elif window:
        lines.append('A window of the job: the steps between '
                     'comm.start_timeline() and comm.stop_timeline() only.')
    for rank, cut in sorted((a.get('truncated') or {}).items()):
        lines.append('Rank %s: its file reached %s=%d bytes (noticed at '
                     'step %s): what came after its last event is missing.'
                     % (
                         rank, timeline_window.MAX_BYTES_ENV,
                         cut.get('max_bytes', 0), cut.get('step')))
    return lines


def format_text(a):
    """The report as text (``analyze``'s result)."""
    files = a['files'] if len(a['files']) <= 3 else [
        a['files'][0], '...', a['files'][-1]]
    lines = ['mnopt report: %d rank%s (%s); clocks aligned: %s' % (
        len(a['ranks']), '' if len(a['ranks']) == 1 else 's',
        ', '.join(files), a['alignment'])] + _window_lines(a) + ['']
    if a['overall']:
        lines.append('Mean step, where its time goes:')
        lines.append(_ROW % ('', 'step', 'compute', 'exposed comm',
                             'hidden comm', 'idle'))
        for s in a['per_rank']:
            lines.append(_ROW % (('rank %d' % s['rank'],) + _cells(s)))
        lines.append(_ROW % (('all',) + _cells(a['overall'])))
        lines.append('  (%s steps per rank; hidden communication runs '
                     'beside compute, so it is not part of the sum)'
                     % _steps_per_rank(a))
    else:
        lines.append("No 'step' spans: no breakdown per step.")
    c = a['collectives']
    lines += ['', 'Collectives: %d, %d of them seen on 2 or more ranks.'
              % (c['count'], c['matched'])]
    stragglers = {s['rank'] for s in c['stragglers']}
    for s in c['last']:
        lines.append('  rank %d arrives last in %s of collectives, by '
                     '%.1f ms on average%s' % (
                         s['rank'], rules.pct(s['share']), s['late_ms'],
                         ': a straggler' if s['rank'] in stragglers
                         else ''))
    if c['matched'] and not c['stragglers']:
        lines.append('  no straggler (a rank last in more than half of '
                     'them, late by %s of the step and %g ms or more)'
                     % (rules.pct(rules.LATE_SHARE), rules.LATE_MS))
    bw = a['bandwidth']
    if bw:
        lines.append('  bandwidth: %s of payload, %s on the bus%s' % (
            rules.rate(bw['algbw_bits']), rules.rate(bw['busbw_bits']),
            ' (%s of the %s link)' % (
                rules.pct(bw['busbw_bits'] / a['link_bits']),
                rules.rate(a['link_bits'])) if a['link_bits'] else ''))
    b = a['buckets']
    if b:
        lines.append('  during backward: %.1f buckets%s each, the link '
                     'idle %s of backward between them' % (
                         b['buckets'], ' of %s' % rules.size(
                             b['bucket_bytes']) if b['bucket_bytes'] else '',
                         rules.pct(b['idle_share'])))
    lines += ['', 'Advice:' if a['advice'] else 'Advice: none (no rule '
              'applies; see mnopt/report/rules.py).']
    for x in a['advice']:
        lines += ['  - ' + x['advice'], '    because ' + x['evidence']]
    return '\n'.join(_wrapped(line) if len(line) > WIDTH else line
                     for line in lines)


def merge(paths, out, how='auto'):
    """Write the ranks of ``paths`` as one trace, on one time axis (for
    Perfetto, which opens one file at a time)."""
    ranks = trace_analysis.load_traces(paths)
    trace_analysis.align(ranks, how)
    low = min(r.offset for r in ranks.values())
    ref = ranks[min(ranks)].unix_us
    events = []
    for path in paths:
        for ev in timeline.load(path):
            r = ranks.get(ev.get('pid'))
            if r is None:
                continue
            if ev.get('ph') != 'M':
                ev['ts'] = round(ev.get('ts', 0) + r.offset - low, 3)
            elif ev.get('name') == 'mnopt_clock' and ref is not None:
                ev['args'] = dict(ev['args'], unix_us=ref + low)
            events.append(ev)
    with open(out, 'w') as f:
        json.dump(events, f, separators=(',', ':'))
        f.write('\n')


def rank_files(given):
    """The trace files ``given`` names: the file itself, else the value given
    to MNOPT_TIMELINE (``trace.json``, ``t{rank}.json``), whose ranks wrote
    ``trace.rank0.json``, ``trace.rank1.json``... (mnopt/timeline/recorder.py:
    ``trace_path``): those, rank 0 on until the first missing.  [] where there
    are none.  A folder: the per-rank files in it (``NAME.rankN.json``), where
    they are of one name; ValueError where they are of several or none, saying
    what to pass."""
    if os.path.isdir(given):
        return rank_files_in(given)
    if os.path.isfile(given):
        return [given]
    found = []
    while os.path.isfile(timeline.trace_path(given, len(found))):
        found.append(timeline.trace_path(given, len(found)))
    return found


def rank_files_in(folder):
    """The per-rank trace files in ``folder`` (``trace.rank0.json``...,
    as MNOPT_TIMELINE=FOLDER/trace.json writes them), by rank; ValueError
    saying what to pass where there are none, or those of several
    jobs."""
    by_name = {}
    for path in glob.glob(os.path.join(glob.escape(folder), '*.rank*.json')):
        m = re.match(r'(.*)\.rank(\d+)\.json$', os.path.basename(path))
        if m:
            by_name.setdefault(m.group(1), []).append(path)
    if not by_name:
        raise ValueError(
            '%s is a folder without per-rank trace files (NAME.rank0.json '
            '...): pass the files, or the path MNOPT_TIMELINE was set to'
            % folder)
    if len(by_name) > 1:
        raise ValueError(
            '%s holds the trace files of several jobs (%s): pass one of '
            'them, as %s' % (folder, ', '.join(
                '%s.rank*.json' % n for n in sorted(by_name)),
                os.path.join(folder, sorted(by_name)[0] + '.json')))
    name, = by_name
    return rank_files(os.path.join(folder, name + '.json'))


def _parser():
    p = argparse.ArgumentParser(
        prog='python -m mnopt.report',
        description='Where each step of an mnopt job spent its time, from '
                    'the timelines it wrote (MNOPT_TIMELINE=trace.json): '
                    'compute, exposed and hidden communication, idle; the '
                    'straggler ranks; advice with its evidence.')
    p.add_argument('traces', nargs='+', metavar='TRACE',
                   help='trace files: one per rank (trace.rank0.json ...), '
                        'one merged file, the path MNOPT_TIMELINE was '
                        'set to (trace.json: every trace.rankN.json), or '
                        'the folder that holds them')
    p.add_argument('--json', action='store_true',
                   help='print the report as JSON')
    p.add_argument('--link-rate',
                   default=os.environ.get(step_stats.LINK_RATE_ENV),
                   metavar='RATE',
                   help='the link rate, to compare the bus bandwidth with '
                        '(1gbit, 250mbit, 10gbit; default $MNOPT_LINK_RATE)')
    p.add_argument('--skip', type=int, default=0, metavar='N',
                   help='leave out the first N steps of each rank (warm-up)')
    p.add_argument('--min-late', type=float, default=0.1, metavar='MS',
                   help='a rank counts as last at a collective only if it '
                        'starts this much after the others (default 0.1 ms)')
    p.add_argument('--align', choices=('auto', 'ends', 'wall', 'none'),
                   default='auto',
                   help="how the ranks' clocks are put on one axis: on the "
                        "ends of their common collectives (auto, ends), "
                        "their wall clocks (wall), or as recorded (none)")
    p.add_argument('--merge', metavar='OUT',
                   help='also write the ranks as one trace file OUT, on that '
                        'one axis (to open in Perfetto)')
    p.add_argument('--plot', metavar='PNG',
                   help='also draw a few steps, every rank and thread, into '
                        'this image (needs matplotlib)')
    p.add_argument('--plot-steps', type=int, default=3, metavar='N',
                   help='how many steps --plot draws, from the first one '
                        '--skip keeps (default 3)')
    return p


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    traces = []
    for given in args.traces:
        try:
            found = rank_files(given)
        except ValueError as e:
            parser.error(str(e))
        if not found:
            parser.error('no such trace file: %s, nor per-rank files %s ... '
                         '(give the files, or the path MNOPT_TIMELINE was '
                         'set to)' % (given, timeline.trace_path(given, 0)))
        traces += found
    args.traces = traces
    try:
        link = parse_rate(args.link_rate) if args.link_rate else None
    except ValueError as e:
        parser.error(str(e))
    if args.skip < 0:
        parser.error('--skip takes a count of steps, not %d' % args.skip)
    if args.plot_steps < 1:
        parser.error('--plot-steps takes a count of steps >= 1, not %d'
                     % args.plot_steps)
    if args.plot:
        try:
            import matplotlib  # NOQA
        except ImportError:
            parser.error('--plot needs matplotlib (pip install matplotlib)')
    try:
        analysis = trace_analysis.analyze(
            args.traces, args.align, args.skip, args.min_late * 1e3, link)
        if args.merge:
            merge(args.traces, args.merge, args.align)
        if args.plot:
            report_plot.plot(args.traces, args.plot, args.skip,
                             args.plot_steps, args.align)
    except trace_analysis.TraceError as e:
        parser.error(str(e))
    if args.json:
        json.dump(analysis, sys.stdout, indent=1)
        sys.stdout.write('\n')
    else:
        print(format_text(analysis))
    return 0


if __name__ == '__main__':
    sys.exit(main())
