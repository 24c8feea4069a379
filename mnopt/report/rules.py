"""The report's advice: which setting would have helped, and the evidence.

Each rule reads what ``trace_analysis.analyze`` measured and returns
advice (a dict: ``rule``, ``advice``, ``evidence``) or None.  The
thresholds are the constants below; a rule speaks only past them.

=============  =========================================================
rule           speaks when
=============  =========================================================
overlap        exposed communication >= EXPOSED of the step, and hidden
               communication < HIDDEN_NONE of the exposed (no overlap)
wire_dtype     exposed >= EXPOSED despite overlap, and no 'cast' phase
               (gradients travel in their own dtype)
bucket_bytes   the link idle >= LINK_IDLE of backward between buckets,
               with 2 or more buckets per backward
straggler      a rank arrives last in more than half of the collectives,
               late by LATE_SHARE of the mean step and LATE_MS or more
               on average (a rank always arrives last: 0.5 ms on a
               250 ms step is no straggler)
bandwidth      the bus bandwidth < LOW_BUSBW of the link rate (when given)
idle           the main thread idle >= IDLE of the step
=============  =========================================================

Leaf module: imports only the standard library.
"""

EXPOSED = 0.15
HIDDEN_NONE = 0.1
LINK_IDLE = 0.2
LOW_BUSBW = 0.5
IDLE = 0.3
LATE_SHARE = 0.02
LATE_MS = 1.0


def late_enough(late_ms, step_ms):
    """Whether arriving ``late_ms`` late on average (at a step of
    ``step_ms``, None where the traces have no steps) makes a straggler."""
    return late_ms >= LATE_MS and (
        step_ms is None or late_ms >= LATE_SHARE * step_ms)


def size(nbytes):
    """4194304 -> '4 MiB'."""
    for unit, scale in (('GiB', 1 << 30), ('MiB', 1 << 20), ('KiB', 1 << 10)):
        if nbytes >= scale:
            return '%.3g %s' % (nbytes / scale, unit)
    return '%d B' % nbytes


def rate(bits):
    """1e9 -> '1 Gbit/s'."""
    for unit, scale in (('Tbit/s', 1e12), ('Gbit/s', 1e9), ('Mbit/s', 1e6),
                        ('kbit/s', 1e3)):
        if bits >= scale:
            return '%.3g %s' % (bits / scale, unit)
    return '%.3g bit/s' % bits


def pct(share):
    return '%.0f%%' % (100 * share)


def _overlap(a):
    o = a['overall']
    if not o or o['exposed_share'] < EXPOSED or (
            o['hidden_ms'] >= HIDDEN_NONE * o['exposed_ms']):
        return None
    return dict(
        advice='try create_multi_node_optimizer(..., overlap=True) (or '
               'double_buffering=True; the ImageNet example: --overlap or '
               '--double-buffering): average during backward' + (
                   " (overlap with the tuned numbers, not 'auto': "
                   'comm.tuned_settings)' if a.get('tuned') else ''),
        evidence='exposed communication is %s of the step (%.1f ms) and '
                 'only %.1f ms of communication is hidden behind compute'
                 % (pct(o['exposed_share']), o['exposed_ms'],
                    o['hidden_ms']))


def _wire_dtype(a):
    o = a['overall']
    if not o or a['cast'] or o['exposed_share'] < EXPOSED or (
            o['hidden_ms'] < HIDDEN_NONE * o['exposed_ms']):
        return None
    return dict(
        advice="try create_communicator(..., allreduce_grad_dtype="
               "'float16') (or 'bfloat16'; the ImageNet example: "
               "--allreduce-grad-dtype float16): half the bytes on the "
               "wire",
        evidence='exposed communication is still %s of the step (%.1f ms) '
                 'with %.1f ms hidden, and gradients travel uncast'
                 % (pct(o['exposed_share']), o['exposed_ms'],
                    o['hidden_ms']))


def _bucket_bytes(a):
    b = a['buckets']
    if not b or not b['bucket_bytes'] or b['buckets'] < 2 or (
            b['idle_share'] < LINK_IDLE):
        return None
    suggest = 1
    while suggest < 4 * b['bucket_bytes']:
        suggest *= 2
    return dict(
        advice='try create_communicator(..., bucket_bytes=%d) (%s; the '
               'ImageNet example: --bucket-bytes %d): fewer, larger '
               'collectives' % (suggest, size(suggest), suggest),
        evidence='buckets of %s leave the link idle %s of backward '
                 '(%.1f buckets per backward)'
                 % (size(b['bucket_bytes']), pct(b['idle_share']),
                    b['buckets']))


def _straggler_advice(rank, a):
    """Where to look for what makes ``rank`` late."""
    if rank == 0:
        # Training scripts give rank 0 alone the log, its printing, the
        # plots, the shared snapshot: late by its own work, on any host.
        alone = ("look at what rank 0 alone does between steps: the log "
                 "and its printing (LogReport, PrintReport, ProgressBar: "
                 "a longer log interval), plots (draw them less often), "
                 "the shared snapshot")
    else:
        alone = None
    if a.get('hosts') == 1 or a.get('hosts') is None and rank == 0:
        return alone or ("look at what rank %d does that the others do "
                         "not: its data loading, a busy core (the ranks "
                         "share one machine)" % rank)
    host = (a.get('host_of') or {}).get(rank)
    blame = ("look at rank %d's host%s: its data loading, a slower GPU, a "
             "busy core, or its link" % (rank, ' (%s)' % host if host
                                         else ''))
    return blame + ('; or ' + alone[len('look at '):] if alone else '')


def _stragglers(a):
    return [dict(
        advice=_straggler_advice(s['rank'], a),
        evidence='rank %d arrives last in %s of collectives, by %.1f ms '
                 'on average' % (s['rank'], pct(s['share']), s['late_ms']))
        for s in a['collectives']['stragglers']]


def _bandwidth(a):
    bw, link = a['bandwidth'], a['link_bits']
    if not bw or not link or bw['busbw_bits'] >= LOW_BUSBW * link:
        return None
    tune = "let the first averagings tune the pipeline " \
        "(bucket_bytes='auto', segment_bytes='auto'; on the " \
        "reduction_server communicator chunk_bytes='auto', " \
        "window='auto'; the ImageNet example: --bucket-bytes auto " \
        "--segment-bytes auto, --chunk-bytes auto --window auto; not " \
        "with overlap or shard_state: docs/tuning.md); else "
    return dict(
        # A job that tuned already: only the link is left to look at.
        advice=('' if a.get('tuned') else tune) + 'check the link '
               '(another job on it, a slower port)',
        evidence='the collectives reach %s of bus bandwidth, %s of the %s '
                 'link' % (rate(bw['busbw_bits']),
                           pct(bw['busbw_bits'] / link), rate(link)))


def _idle(a):
    o = a['overall']
    if not o or o['idle_share'] < IDLE:
        return None
    return dict(
        advice='look at what runs between the phases: data loading (a '
               'MultiprocessIterator, more prefetch), evaluation, logging',
        evidence='the main thread is outside forward, backward, update and '
                 'communication %s of the step (%.1f ms)'
                 % (pct(o['idle_share']), o['idle_ms']))


RULES = (('overlap', _overlap), ('wire_dtype', _wire_dtype),
         ('bucket_bytes', _bucket_bytes), ('straggler', _stragglers),
         ('bandwidth', _bandwidth), ('idle', _idle))


def advise(analysis):
    """[{rule, advice, evidence}] for the rules that speak."""
    out = []
    for name, rule in RULES:
        said = rule(analysis)
        for one in (said if isinstance(said, list) else [said]):
            if one:
                out.append(dict(rule=name, **one))
    return out
