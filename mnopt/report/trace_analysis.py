"""Reading mnopt timelines (mnopt/timeline/recorder.py): where each step's
time goes.

What ``python -m mnopt.report`` prints, computed from the phases the
timeline's docstring names (one idea, the report's numbers: over 400
lines with the reading of the files).  All times here are microseconds on one axis
shared by every rank (see ``align``).

Per step, on each rank's main thread (the one that records 'step'):

- exposed communication: time covered by 'wait' or by a communication
  phase (pack, cast, wire, sum, unpack) run on the main thread itself;
- compute: time covered by forward, backward or update, less the exposed
  time within them;
- hidden communication: time the other threads spend in communication
  phases while the main thread computes;
- idle: the rest of the step (data loading, Python between the phases).

Collectives: the 'wire' spans with a ``seq`` (ZeRO's all-gather: a
``gather``; local steps' running statistics: ``persistents``; and
``comm``) are one collective on every rank (its buckets'
wires together).  Its straggler arrived last (``arrived``: entering the
averaging, before the layout check where a late rank is waited for; else
the wire's start), late by that less the others' median arrival; bus
bandwidth as nccl-tests, from the last wire start to the end.  A server
process (no step, no collective) is no worker.

Imports only the standard library, the timeline's recorder and step_stats
(the bus factors and who arrived last, shared with the communicator's
per-step figures) and the report's rules.
"""

import bisect
import collections
import itertools
import statistics

from mnopt.report import rules as report_rules
from mnopt.timeline import step_stats, recorder as timeline

COMPUTE = ('forward', 'backward', 'update')
COMM = ('pack', 'cast', 'wire', 'sum', 'unpack')
#: Bytes on the busiest link per byte of payload, by the 'op' of a 'wire'
#: (nccl-tests' bus bandwidth factors): shared with the communicator's own
#: per-step figures (mnopt/timeline/step_stats.py).
BUS_FACTOR = step_stats.BUS_FACTOR


class TraceError(ValueError):
    """A trace that cannot be read or does not fit with the others."""


class RankTrace(object):
    """One rank's events: ``spans`` as (name, cat, tid, start, end, args)
    in microseconds from the rank's origin, ``threads`` {tid: name},
    ``unix_us`` the origin on the wall clock (None if not recorded)."""

    def __init__(self, rank, path):
        self.rank, self.path = rank, path
        self.spans, self.threads, self.unix_us = [], {}, None
        self.job = None          # the job's id (mnopt_job), where recorded
        self.host = None         # its host's name (mnopt_clock), where too
        self.window = None       # mnopt_window's args: a window of the job
        self.truncated = None    # mnopt_truncated's: the file's cap reached
        self.offset = 0.0        # added to this rank's times: the shared axis

    def named(self, names, tid=None, other_than=None):
        return [s for s in self.spans if s[0] in names
                and (tid is None or s[2] == tid)
                and (other_than is None or s[2] != other_than)]

    @property
    def main_tid(self):
        """The thread that records 'step' (else the one named 'main')."""
        steps = collections.Counter(s[2] for s in self.spans
                                    if s[0] == 'step')
        if steps:
            return steps.most_common(1)[0][0]
        names = [t for t, n in self.threads.items() if n == 'main']
        return names[0] if names else 0


def load_traces(paths):
    """{rank: RankTrace} from trace files (one per rank, or merged)."""
    ranks, origin_of = {}, {}
    for path in paths:
        if paths.count(path) > 1:
            raise TraceError('%s is given twice' % path)
        try:
            events = timeline.load(path)
        except (OSError, ValueError) as e:
            raise TraceError('%s: %s' % (path, e))
        here = {}
        for ev in events:
            pid = ev.get('pid')
            if not isinstance(pid, int) or 'ph' not in ev:
                continue
            if pid in origin_of and origin_of[pid] != path:
                raise TraceError('rank %d is in both %s and %s'
                                 % (pid, origin_of[pid], path))
            origin_of[pid] = path
            r = here.get(pid) or here.setdefault(pid, RankTrace(pid, path))
            args = ev.get('args') or {}
            if ev['ph'] == 'M' and ev.get('name') == 'thread_name':
                r.threads[ev.get('tid', 0)] = args.get('name')
            elif ev['ph'] == 'M' and ev.get('name') == 'mnopt_clock':
                r.unix_us = args.get('unix_us')
                r.host = args.get('host')
            elif ev['ph'] == 'M' and ev.get('name') == 'mnopt_job':
                r.job = r.job or args.get('job')
            elif ev['ph'] == 'M' and ev.get('name') == 'mnopt_window':
                r.window = args
            elif ev['ph'] == 'M' and ev.get('name') == 'mnopt_truncated':
                r.truncated = args
            elif ev['ph'] == 'X':
                ts = float(ev.get('ts', 0))
                r.spans.append((ev.get('name'), ev.get('cat'), ev.get('tid'),
                                ts, ts + float(ev.get('dur', 0)), args))
        ranks.update(here)
    if not ranks:
        raise TraceError('no events in %s' % ', '.join(paths))
    jobs = sorted({r.job for r in ranks.values() if r.job})
    if len(jobs) > 1:
        raise TraceError('these traces come from %d different jobs (%s): '
                         'give the files of one job'
                         % (len(jobs), ', '.join(jobs)))
    for r in ranks.values():
        r.spans.sort(key=lambda s: s[3])
    return ranks


# -- intervals: sorted lists of disjoint (start, end) ----------------------

def union(spans):
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        elif e > s:
            out.append((s, e))
    return out


def clip(ivs, lo, hi):
    """The parts of ``ivs`` (a union) inside [lo, hi)."""
    a, b = 0, len(ivs)
    while a < b:                    # the first interval ending after lo
        m = (a + b) // 2
        if ivs[m][1] <= lo:
            a = m + 1
        else:
            b = m
    out = []
    while a < len(ivs) and ivs[a][0] < hi:
        s, e = max(ivs[a][0], lo), min(ivs[a][1], hi)
        if e > s:
            out.append((s, e))
        a += 1
    return out


def intersect(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b):
    out = []
    for s, e in a:
        for bs, be in clip(b, s, e):
            if bs > s:
                out.append((s, bs))
            s = be
        if e > s:
            out.append((s, e))
    return out


def total(ivs):
    return sum(e - s for s, e in ivs)


# -- alignment -------------------------------------------------------------

def collective_key(args):
    """The collective of a 'wire' (its args), alike on every rank: (comm,
    seq), (comm, 'allgather', gather), (comm, 'persistents', local step);
    None (a server's receive, send)."""
    if 'seq' in args:
        return (args.get('comm'), args['seq'])
    if 'gather' in args:
        return (args.get('comm'), 'allgather', args['gather'])
    if 'persistents' in args:   # local steps' running statistics
        return (args.get('comm'), 'persistents', args['persistents'])
    return None


def _wire_ends(r):
    ends = {}
    for s in r.named(('wire',)):
        key = collective_key(s[5])
        if key is not None:
            ends[key] = max(ends.get(key, s[4]), s[4])
    return ends


def align(ranks, how='auto'):
    """Put every rank on the lowest rank's time axis (sets each
    ``offset``); returns how: 'ends' (each rank's wall-clock origin, then
    the median difference of the ends of their common collectives, which
    end together on every rank), 'wall' (the origins only: as good as the
    hosts' clocks agree) or 'none' (as recorded: one host, one origin)."""
    ref = ranks[min(ranks)]
    wall = how != 'none' and all(r.unix_us is not None
                                 for r in ranks.values())
    for r in ranks.values():
        r.offset = r.unix_us - ref.unix_us if wall else 0.0
    if how not in ('auto', 'ends') or len(ranks) < 2:
        return 'wall' if wall else 'none'
    ref_ends, refined = _wire_ends(ref), False
    for r in ranks.values():
        ends = _wire_ends(r)
        diffs = [ref_ends[k] - ends[k] - r.offset + ref.offset
                 for k in ends if k in ref_ends]
        if diffs and r is not ref:
            r.offset += statistics.median(diffs)
            refined = True
    return 'ends' if refined else 'wall' if wall else 'none'


# -- the step breakdown ----------------------------------------------------

def _shifted(spans, offset):
    return [(s[3] + offset, s[4] + offset) for s in spans]


def breakdown(r, skip=0):
    """Per step of rank ``r`` (after ``skip`` steps): a dict of its start,
    and its step, compute, exposed, hidden and idle times (us)."""
    main, off = r.main_tid, r.offset
    compute = union(_shifted(r.named(COMPUTE, tid=main), off))
    exposed = union(_shifted(r.named(COMM + ('wait',), tid=main), off))
    others = union(_shifted(r.named(COMM, other_than=main), off))
    out = []
    for span in r.named(('step',), tid=main)[skip:]:   # sorted by start
        lo, hi = span[3] + off, span[4] + off
        exp = clip(exposed, lo, hi)
        comp = subtract(clip(compute, lo, hi), exp)
        hidden = total(intersect(clip(others, lo, hi), comp))
        c, x = total(comp), total(exp)
        out.append({'step': span[5].get('step'), 'start': lo,
                    'step_us': hi - lo, 'compute_us': c, 'exposed_us': x,
                    'hidden_us': hidden, 'idle_us': max(hi - lo - c - x, 0)})
    return out


def summarize(steps):
    """Means of per-step dicts, in ms, with shares of the step."""
    if not steps:
        return None
    out = {'steps': len(steps)}
    for key in ('step', 'compute', 'exposed', 'hidden', 'idle'):
        out[key + '_ms'] = statistics.fmean(s[key + '_us']
                                            for s in steps) / 1e3
    for key in ('compute', 'exposed', 'hidden', 'idle'):
        out[key + '_share'] = (out[key + '_ms'] / out['step_ms']
                               if out['step_ms'] > 0 else 0.0)
    return out


# -- collectives -----------------------------------------------------------

def collectives(ranks):
    """[{rank: (start, end, bytes, op, arrival)}] per collective (its
    buckets' wires together, ``arrived`` else start), by first start."""
    found = collections.defaultdict(dict)
    for r in ranks.values():
        for s in r.named(('wire',)):
            key = collective_key(s[5])
            if key is None:
                continue
            start, end = s[3] + r.offset, s[4] + r.offset
            arrived = s[5].get('arrived')
            arrival = start if arrived is None else min(
                float(arrived) + r.offset, start)
            old = found[key].get(r.rank)
            nbytes = s[5].get('bytes') or 0
            if old:
                start, end = min(start, old[0]), max(end, old[1])
                nbytes += old[2]
                arrival = min(arrival, old[4])
            found[key][r.rank] = (start, end, nbytes,
                                  s[5].get('op', 'allreduce'), arrival)
    return sorted(found.values(), key=lambda c: min(v[0] for v in c.values()))


def stragglers(colls, min_late_us=100.0):
    """Which rank arrives last, how often and by how much: {'matched': the
    collectives seen on 2 or more ranks, 'last': [{rank, share,
    late_ms}] for every rank last at least once (by ``min_late_us`` or
    more), 'stragglers': those last in more than half}."""
    matched = [c for c in colls if len(c) >= 2]
    late = collections.defaultdict(list)
    for c in matched:
        rank, by = step_stats.last_arrival({r: v[4] for r, v in c.items()})
        if by >= min_late_us:
            late[rank].append(by)
    last = [{'rank': rank, 'share': len(v) / len(matched),
             'collectives': len(v), 'late_ms': statistics.fmean(v) / 1e3}
            for rank, v in sorted(late.items())]
    return {'matched': len(matched), 'last': last,
            'stragglers': [x for x in last if x['share'] > 0.5]}


def bandwidth(colls, n_ranks):
    """Payload and bus bandwidth (bits/s) of the collectives, over the
    time from the last arrival to the (median) end."""
    payload = bus = seconds = 0.0
    counted = 0
    for c in colls:
        v = list(c.values())
        end = statistics.median(x[1] for x in v)
        t = (end - max(x[0] for x in v)) / 1e6
        nbytes = statistics.median(x[2] for x in v)
        n = max(len(v), n_ranks)
        if t <= 0 or not nbytes or n < 2:
            continue
        factor = BUS_FACTOR.get(v[0][3], BUS_FACTOR['allreduce'])(n)
        payload, bus, seconds = payload + nbytes, bus + nbytes * factor, \
            seconds + t
        counted += 1
    if not counted:
        return None
    return {'collectives': counted, 'seconds': seconds,
            'algbw_bits': payload * 8 / seconds,
            'busbw_bits': bus * 8 / seconds}


def bucket_gaps(ranks):
    """How busy the wire is during backward, once the first bucket of the
    step is on it: {'backward_ms', 'idle_share' (the link idle between
    the first bucket's start and the end of backward, over all of
    backward), 'buckets' (buckets per backward), 'bucket_bytes' (their
    median)} over every rank; None without wire spans in backward.

    Only collectives' wires (no server's receive or send); a span with
    ``buckets`` (a ring's, pipelining them) counts as that many."""
    idle = backward = 0.0
    n_backward = n_wires = 0
    sizes = []
    for r in ranks.values():
        wire_spans = [w for w in r.named(('wire',))   # sorted by start
                      if collective_key(w[5]) is not None]
        wires = union([(w[3], w[4]) for w in wire_spans])
        starts = [s[3] for s in wire_spans]
        counts = [0] + list(itertools.accumulate(
            max(1, int(w[5].get('buckets') or 1)) for w in wire_spans))
        for s in r.named(('backward',), tid=r.main_tid):
            lo, hi = s[3], s[4]
            inside = clip(wires, lo, hi)
            backward += hi - lo
            if not inside:
                continue
            n_backward += 1
            n_wires += counts[bisect.bisect_left(starts, hi)] - \
                counts[bisect.bisect_left(starts, lo)]
            idle += hi - inside[0][0] - total(inside)
        for w in wire_spans:
            n = max(1, int(w[5].get('buckets') or 1))
            if w[5].get('bytes'):
                sizes += [w[5]['bytes'] / n] * n
    if not n_backward:
        return None
    return {'backward_ms': backward / 1e3, 'idle_share': idle / backward,
            'buckets': n_wires / n_backward,
            'bucket_bytes': statistics.median(sizes) if sizes else None}


def workers(ranks):
    """The ranks that train (not reduction server processes)."""
    return [k for k, r in ranks.items() if r.named(('step',)) or any(
        collective_key(s[5]) is not None for s in r.named(('wire',)))]


def analyze(paths, align_how='auto', skip=0, min_late_us=100.0,
            link_bits=None):
    """Everything the report prints, as plain data (what --json writes):
    the means per rank and overall, and each step of each rank."""
    ranks = load_traces(paths)
    how = align(ranks, align_how)
    per_rank, every, each = [], [], []
    for rank in sorted(ranks):
        steps = breakdown(ranks[rank], skip)
        every += steps
        each += [dict({k[:-3] + '_ms': v / 1e3 for k, v in s.items()
                       if k.endswith('_us')}, rank=rank, step=s['step'])
                 for s in steps]
        summary = summarize(steps)
        if summary:
            per_rank.append(dict(rank=rank, **summary))
    colls = collectives(ranks)
    overall = summarize(every)
    last = stragglers(colls, min_late_us)
    # Last in most collectives, and by enough of the step to matter.
    last['stragglers'] = [x for x in last['stragglers']
                          if report_rules.late_enough(
                              x['late_ms'], overall and overall['step_ms'])]
    out = {
        'files': list(paths), 'ranks': sorted(ranks), 'alignment': how,
        'per_rank': per_rank, 'overall': overall,
        'each_step': each,
        'collectives': dict(count=len(colls), **last),
        'bandwidth': bandwidth(colls, len(workers(ranks))),
        'buckets': bucket_gaps(ranks),
        'link_bits': link_bits,
        # How many machines the ranks ran on (None: traces that do not
        # say), and which: a late rank is its host's fault only on a host
        # of its own.
        'hosts': (len({r.host for r in ranks.values()})
                  if all(r.host for r in ranks.values()) else None),
        'host_of': {rank: r.host for rank, r in sorted(ranks.items())},
        'cast': any(r.named(('cast',)) for r in ranks.values()),
        # The job tuned its pipeline ('auto' settings: its exchanges).
        # A window of the job (MNOPT_TIMELINE_STEPS, or start_timeline()
        # and stop_timeline()), and the files cut at their cap.
        'window': next((r.window for r in ranks.values() if r.window), None),
        'truncated': {rank: r.truncated for rank, r in sorted(ranks.items())
                      if r.truncated},
        'tuned': any(args.get('op') == 'tuning'
                     for r in ranks.values()
                     for name, _, _, _, _, args in r.spans if name == 'wait'),
    }
    out['advice'] = report_rules.advise(out)
    return out
