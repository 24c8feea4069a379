"""The timing harness: cases timed round-robin, statistics, bytes on the links.

A case is ``(label, kind, fn)``.  The cases, the sweeps and the command
line call ``harness.run_cases`` through this module, so that a wrapper
(benchmarks/idle_bench.py) can replace it.
"""

import collections
import os
import socket
import statistics
import sys
import time

import numpy
from mpi4py import MPI


def spread(values):
    """{'min', 'median', 'max'} of a figure measured several times."""
    return {'min': min(values), 'median': statistics.median(values),
            'max': max(values)}


#: Untimed rounds of every case before its ``reps`` timed repetitions
#: (the first averagings allocate buffers and warm caches).
WARMUP = 2
#: The widest line a table of the benchmark prints (a terminal's).
COLUMNS = 80


def run_cases(cases, world, reps, warmup=WARMUP, progress=''):
    """Time each case ``reps`` times, round-robin, after ``warmup``
    untimed rounds; returns the slowest rank's times, shape (cases,
    reps)."""
    times = numpy.zeros((len(cases), reps))
    for rep in range(warmup + reps):
        for i, (_, _, fn) in enumerate(cases):
            world.Barrier()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if rep >= warmup:
                times[i, rep - warmup] = dt
        if world.rank == 0 and shows_progress():
            sys.stderr.write('\r%s%s ' % (progress,
                                          round_name(rep, warmup, reps)))
            sys.stderr.flush()
    if world.rank == 0 and shows_progress():
        sys.stderr.write('\r' + ' ' * 60 + '\r')
    world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)  # the slowest rank
    return times


def shows_progress():
    """Whether the progress line is drawn: on a terminal only (rewritten
    in place with carriage returns, which a file or a pipe would keep)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):   # replaced, or closed
        return False


def round_name(rep, warmup, reps):
    """The progress line's name of round ``rep`` (from 0): the warm-up
    rounds, then the repetitions, counted as the table counts them."""
    if rep < warmup:
        return 'warm-up %d/%d' % (rep + 1, warmup)
    return 'repetition %d/%d' % (rep - warmup + 1, reps)


def print_row(label, cells, label_width, cell_width):
    """One row of a table: ``label`` left-aligned in ``label_width``
    columns, then each cell right-aligned in ``cell_width`` (the widths a
    table picks to fit COLUMNS); a longer label takes a line of its own,
    the cells go on the next."""
    if len(label) > label_width:
        print(label)
        label = ''
    print(('%-*s' % (label_width, label) + ''.join(
        ' %*s' % (cell_width, c) for c in cells)).rstrip())


def print_heading(text):
    """A table's heading: ``# `` lines within COLUMNS."""
    import textwrap
    print(textwrap.fill(text, COLUMNS - 1, initial_indent='# ',
                        subsequent_indent='# ', break_on_hyphens=False))


def bus_bandwidth(algbw, n):
    """nccl-tests' allreduce bus bandwidth: what each link carries."""
    return algbw * 2.0 * (n - 1) / n if n > 1 else algbw


def link_tx_bytes():
    """{interface: bytes sent so far} of this node's network interfaces
    but loopback (Linux's /sys counters; frames a bridge forwards count on
    the interface they leave by)."""
    out = {}
    root = '/sys/class/net'
    for dev in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        try:
            with open(os.path.join(root, dev, 'statistics', 'tx_bytes')) as f:
                out[dev] = int(f.read())
        except (OSError, ValueError):
            continue
    out.pop('lo', None)
    return out


def counting_link_bytes(cases):
    """``cases`` with each function wrapped to add up the bytes this node's
    interfaces sent while it ran; returns (wrapped cases, per_call) where
    ``per_call()`` is, per case, {interface: mean bytes per call}."""
    totals = [collections.Counter() for _ in cases]
    calls = [0] * len(cases)

    def wrap(i, fn):
        def run():
            before = link_tx_bytes()
            fn()
            for dev, n in link_tx_bytes().items():
                totals[i][dev] += n - before.get(dev, n)
            calls[i] += 1
        return run

    def per_call():
        return [{dev: n / max(1, c) for dev, n in t.items()}
                for t, c in zip(totals, calls)]
    return ([(label, kind, wrap(i, fn))
             for i, (label, kind, fn) in enumerate(cases)], per_call)


def gather_link_bytes(world, per_case):
    """Rank 0: per case {'host:interface': bytes per call}, one entry per
    node (the first rank of each host speaks for it)."""
    gathered = world.gather((socket.gethostname(), per_case))
    if gathered is None:
        return None
    merged = [{} for _ in per_case]
    seen = set()
    for host, cases in gathered:
        if host in seen:
            continue
        seen.add(host)
        for out, counts in zip(merged, cases):
            out.update(('%s:%s' % (host, dev), n) for dev, n in counts.items())
    return merged
