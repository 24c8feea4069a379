"""``python -m mnopt.report --plot PNG``: a picture of a few steps.

One row per rank and thread (``rank 0 main``, ``rank 0 averaging``, ...),
on the ranks' common time axis (trace_analysis.align), each span a bar
coloured by its phase: compute (forward, backward, update) in greens and
blues, the main thread blocked on averaging ('wait') in red, the
averaging's own phases (pack, cast, wire, sum, unpack) in greys and
oranges.  What a Perfetto screenshot shows, drawn without a browser, so
that a report on a headless cluster node can include it.

Needs matplotlib (``pip install matplotlib``; the examples' extra has it).
"""

from mnopt.report import trace_analysis

#: Phase -> colour; phases not named here are drawn in the last one.
COLOURS = {
    'forward': '#7fbf7b', 'backward': '#1b7837', 'update': '#5aae61',
    'wait': '#d73027', 'pack': '#bababa', 'cast': '#878787',
    'wire': '#f46d43', 'sum': '#fdae61', 'unpack': '#4d4d4d',
    'other': '#abd9e9',
}
#: Drawn as the row's background (they hold the other phases).
BACKGROUND = ('step',)


def window(ranks, first, count):
    """(start, end, what) on the common axis, in us: from the start of
    step ``first`` to the end of step ``first + count - 1`` of the lowest
    rank, within the steps it has ('what' says which were drawn); the
    whole trace where it has none."""
    ref = ranks[min(ranks)]
    steps = sorted((s[3], s[4]) for s in ref.named(('step',), ref.main_tid))
    if not steps:
        spans = [s for r in ranks.values() for s in r.spans]
        if not spans:
            raise trace_analysis.TraceError('no spans to plot')
        return (min(s[3] + ranks[r].offset for r in ranks
                    for s in ranks[r].spans),
                max(s[4] + ranks[r].offset for r in ranks
                    for s in ranks[r].spans), 'the whole trace: no steps')
    first = max(0, min(first, len(steps) - 1))
    last = min(len(steps), first + max(1, count)) - 1
    what = 'step %d' % first if first == last else \
        'steps %d to %d' % (first, last)
    return (steps[first][0] + ref.offset, steps[last][1] + ref.offset,
            what + '; grey: the step')


def rows(ranks, lo, hi):
    """[(label, [(name, start_ms, length_ms)])] of every rank's threads
    that have a span in [lo, hi], main thread first; times from ``lo``."""
    out = []
    for rank in sorted(ranks):
        r = ranks[rank]
        main = r.main_tid
        tids = sorted({s[2] for s in r.spans}, key=lambda t: (t != main, t))
        for tid in tids:
            bars = []
            for name, _, t, start, end, _ in r.spans:
                start, end = start + r.offset, end + r.offset
                if t != tid or end < lo or start > hi:
                    continue
                start, end = max(start, lo), min(end, hi)
                bars.append((name, (start - lo) / 1e3, (end - start) / 1e3))
            if bars:
                thread = r.threads.get(tid) or 'thread %s' % tid
                out.append(('rank %d %s' % (rank, thread), bars))
    return out


def plot(paths, out, first=0, count=3, align_how='auto'):
    """Draw steps ``first`` .. ``first + count - 1`` of the traces in
    ``paths`` into the image file ``out``; returns the rows drawn."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = trace_analysis.load_traces(paths)
    trace_analysis.align(ranks, align_how)
    lo, hi, what = window(ranks, first, count)
    drawn = rows(ranks, lo, hi)
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(drawn) + 1.4))
    seen = set()
    for y, (_, bars) in enumerate(reversed(drawn)):
        for name, start, length in bars:
            background = name in BACKGROUND
            colour = '#eeeeee' if background else COLOURS.get(
                name, COLOURS['other'])
            height = 0.9 if background else 0.6
            ax.broken_barh([(start, length)], (y - height / 2, height),
                           facecolors=colour, edgecolor='none',
                           zorder=0 if background else 1)
            if not background:
                seen.add(name if name in COLOURS else 'other')
    ax.set_yticks(range(len(drawn)))
    ax.set_yticklabels([label for label, _ in reversed(drawn)])
    ax.set_xlim(0, (hi - lo) / 1e3)
    ax.set_xlabel('ms (%s)' % what)
    order = [n for n in COLOURS if n in seen]
    ax.legend(handles=[Patch(color=COLOURS[n], label=n) for n in order],
              loc='upper center', bbox_to_anchor=(0.5, -0.35 if
                                                  len(drawn) < 4 else -0.15),
              ncol=len(order), frameon=False, fontsize='small')
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drawn
