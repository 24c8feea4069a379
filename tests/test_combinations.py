"""Where features meet: a pairwise combination matrix.

Each feature's own tests exercise it alone; the defects found lately sat
where two meet (snapshots x several ranks, ZeRO x resume on another rank
count, split() x compression...).  Every pair of values of every factor
below that _allowed lets meet appears in at least one case (allpairspy,
and rows_for_missed_pairs for the pairs its filter makes it drop; the
full product would be thousands of cases), and each case checks what a
user would:

- no error on any rank, unless the combination is one mnopt refuses; then
  the same clear error on every rank (REFUSED says which and why);
- no hang (a stuck case aborts its job through MNOPT_TIMEOUT);
- every replica ends with the same parameters, bit for bit;
- a resume at the same number of ranks (``same``; ``lost``: one file of the
  newest snapshot deleted; ``stale``: one file replaced by the same file of
  another write) resumes from the newest snapshot every rank can load
  consistently and ends bit-identical to an uninterrupted run (where the
  iterator's orders are reproducible: bit_identical_promised);
- a resume at another number of ranks (``grow`` 2 -> 3, ``shrink`` 3 -> 2)
  resumes from the newest snapshot and trains on;
- no rank sees a sample twice within an epoch;
- an observed run shows what it promises: the timeline each phase of a
  step (step, forward, backward, update, wire), the CommunicationReport its
  keys in the log, MNOPT_DEBUG=detail its check of every collective,
  MNOPT_TIMELINE_STEPS the window's steps and no others, in each phase;
- under mnopt.join ('uneven+join') each rank trains on its own number
  of batches, as join reports on every rank.

The cases run in four mpiexec jobs (tests/combination_job.py): the first
halves at 2 and at 3 ranks, then the files are damaged as each case says,
then the second halves at 2 and at 3 ranks.  Add a feature's values to
FACTORS when it lands.
"""

import collections
import glob
import json
import os
import shutil

import pytest

from conftest import REPO, mpiexec, python_path, run_job

pytestmark = pytest.mark.spawn
pytest.importorskip('chainer', reason='the matrix trains Chainer models')
allpairspy = pytest.importorskip('allpairspy')

FACTORS = collections.OrderedDict([
    ('mode', ['sync', 'double_buffering', 'overlap', 'shard_state',
              'stage2', 'local_steps']),
    # Sign votes, PowerSGD, PowerSGD where it pays ('auto'), a user's
    # comm hook (top-k with error feedback: combination_job.topk_hook).
    ('compression', [None, 'sign', 'powersgd', 'auto', 'hook']),
    ('resume', ['none', 'same', 'grow', 'shrink', 'lost', 'stale']),
    ('comm', ['naive', 'flat', 'hierarchical', 'reduction_server']),
    ('wire', [None, 'float16', 'bfloat16']),
    # 'uneven+join': ranks hold one batch fewer each, trained under
    # mnopt.join (combination_job.JoinedEpochs: an iteration an epoch).
    ('data', ['shuffled+serial', 'plain+serial', 'shuffled+multiprocess',
              'uneven+join']),
    ('split', [False, True]),
    # multi_node_snapshot's replica sets; 'one+async': one set, written in
    # the background (asynchronous=True).
    ('sets', ['one', 'per_rank', 'one+async']),
    ('ranks', [2, 3]),   # where the case starts
    # A timeline recorded, a CommunicationReport in the log, every
    # collective checked across ranks (MNOPT_DEBUG=detail), or a timeline
    # of some steps only (MNOPT_TIMELINE_STEPS: combination_job.WINDOW).
    ('observe', ['none', 'timeline', 'report', 'debug', 'window']),
    # Settings as numbers, or 'auto' (tuned in the first averagings: the
    # cases stop inside the tuning, so it spans snapshots and resumes).
    ('tune', ['fixed', 'auto']),
    # accumulation_steps: 2 puts the snapshots (iterations 3 and 5) and
    # the stop (7) in the middle of an update's accumulation.
    ('accumulation', [1, 2]),
])


def _allowed(row):
    """allpairspy's filter: grow starts at 2 ranks, shrink at 3; 'auto'
    only where it is tuned."""
    values = dict(zip(FACTORS, row))
    if values.get('tune') == 'auto' and (
            values.get('comm') == 'naive' or values.get('mode') in (
                'overlap', 'shard_state', 'stage2') or
            values.get('compression') is not None):
        # Refused (refused() says why; tests/test_tune.py checks each
        # refusal on every rank): a case spent on it would test no pair.
        return False
    if values.get('mode') == 'local_steps' and \
            values.get('compression') == 'hook':
        # Refused likewise (tests/test_local_steps.py checks it on every
        # rank): the pairs of local_steps go to cases that train.
        return False
    if values.get('data') == 'uneven+join' and (
            values.get('mode', 'sync') != 'sync' or
            values.get('compression') is not None or
            values.get('accumulation', 1) > 1):
        # Refused likewise (join_refuses; tests/test_uneven_inputs.py
        # checks each refusal on every rank).
        return False
    if values.get('resume') == 'grow' and values.get('ranks') == 3:
        return False
    if values.get('resume') == 'shrink' and values.get('ranks') == 2:
        return False
    return True


def refused(case):
    """Why mnopt refuses this combination (the error must say so on every
    rank), or None."""
    sharded = case['mode'] in ('shard_state', 'stage2')
    if case['tune'] == 'auto' and (
            case['comm'] == 'naive' or sharded or
            case['mode'] == 'overlap' or
            case['compression'] is not None):
        # naive has nothing to tune; compression, overlap and ZeRO
        # average in ways a tuning cannot time (docs/tuning.md).
        return "='auto'"
    if case['compression'] == 'hook' and case['wire'] is not None:
        # The hook decides what travels (docs/hooks.md).
        return 'allreduce_grad_dtype=None'
    if sharded and case['compression'] == 'hook':
        return 'a comm hook averages whole buckets'
    if sharded and case['compression'] is not None:
        # Each rank would need the mean of its share only (docs/limits.md).
        return 'compression=%r' % (case['compression'],)
    if sharded and case['comm'] == 'reduction_server':
        return 'reduction_server'
    if case['mode'] == 'local_steps' and case['compression'] == 'hook':
        # Made for every step's gradients (docs/local_sgd.md).
        return 'registered comm hook'
    if case['data'] == 'uneven+join':
        return join_refuses(case)
    return None


def join_refuses(case):
    """What mnopt.join refuses (the first its check meets), or None:
    the synchronous optimizer only, without accumulation, compression or
    a comm hook (docs/uneven_inputs.md)."""
    keyword = {'double_buffering': 'double_buffering=True',
               'overlap': 'overlap=True', 'shard_state': 'shard_state=True',
               'stage2': 'shard_state=True',
               'local_steps': 'local_steps'}.get(case['mode'])
    if keyword is not None:
        return 'synchronous optimizer only, not with ' + keyword
    if case['accumulation'] > 1:
        return 'accumulation_steps=%d' % case['accumulation']
    if case['compression'] == 'hook':
        return 'a registered comm hook'
    if case['compression'] is not None:
        return 'compression=%r' % (case['compression'],)
    return None


def cases():
    rows = [list(row) for row in allpairspy.AllPairs(
        list(FACTORS.values()), filter_func=_allowed)]
    rows += rows_for_missed_pairs(rows)
    rows += sharded_resizes()
    out = []
    for i, row in enumerate(rows):
        case = dict(zip(FACTORS, row))
        case['id'], case['seed'] = 'case%02d' % i, 100 + i
        out.append(case)
    return out


def sharded_resizes():
    """ZeRO's rows that train and resume on another number of ranks
    (re-sharding the state element by element): the pairs rarely give
    one, as most sharded rows meet a refused value.  The model's first
    weight spans the ranks (combination_job checks it)."""
    base = dict(compression=None, wire=None, data='shuffled+serial',
                split=False, sets='one', observe='none', tune='fixed')
    rows = []
    for mode, resume, comm, acc in (
            ('shard_state', 'grow', 'flat', 1),
            ('stage2', 'shrink', 'hierarchical', 2),
            ('shard_state', 'shrink', 'naive', 1),
            ('stage2', 'grow', 'flat', 1)):
        values = dict(base, mode=mode, resume=resume, comm=comm,
                      accumulation=acc, ranks=2 if resume == 'grow' else 3)
        rows.append([values[k] for k in FACTORS])
    return rows


def pairs_of(row):
    """The pairs of values ``row`` holds: ((factor, value), (factor,
    value)), factors in FACTORS' order."""
    named = list(zip(range(len(row)), map(repr, row)))
    return {(a, b) for i, a in enumerate(named) for b in named[i + 1:]}


def rows_for_missed_pairs(rows, tries=3000):
    """Rows that cover the pairs allpairspy's rows miss (its filter only
    sees rows being built, and gives up on pairs the filter makes rare:
    mnopt.join's, 'auto''s): for each missed pair, the row among
    ``tries`` drawn with it (allowed by _allowed) that covers the most
    missed pairs; a pair no drawn row allows is one no row can hold
    (grow at 3 ranks).  Drawn from a fixed seed: the same cases each
    run."""
    import random
    draw = random.Random(54)
    values = list(FACTORS.values())
    covered = set().union(*(pairs_of(r) for r in rows))
    missed = [p for p in pairs_of_every_value() if p not in covered]
    added = []
    for (i, a), (j, b) in missed:
        if ((i, a), (j, b)) in covered:
            continue
        best, gain = None, 0
        for _ in range(tries):
            row = [draw.choice(v) for v in values]
            row[i] = next(v for v in values[i] if repr(v) == a)
            row[j] = next(v for v in values[j] if repr(v) == b)
            if _allowed(row):
                new = len(pairs_of(row) - covered)
                if new > gain:
                    best, gain = row, new
        if best is not None:
            added.append(best)
            covered |= pairs_of(best)
    return added


def pairs_of_every_value():
    """Every pair of values of two factors, in FACTORS' order."""
    values = list(FACTORS.values())
    return [((i, repr(a)), (j, repr(b)))
            for i in range(len(values)) for j in range(i + 1, len(values))
            for a in values[i] for b in values[j]]


def bit_identical_promised(case):
    """Whether a same-size resume must end bit-identical: not for sign
    compression with one replica set, and not with a
    shuffled MultiprocessIterator, whose prefetch thread draws the next
    epoch's order from numpy's global generator at a moment that depends
    on timing, and drops and redraws it when saved (plain Chainer, one
    process, shows it: a run writing snapshots trains on other orders
    than one that does not; docs/reliability.md)."""
    if case['tune'] == 'auto' and final_ranks(case) > 2 and \
            case['comm'] in ('flat', 'hierarchical'):
        # The bucket size a tuning picks depends on its timings, and at 3
        # ranks or more it can move the last bit of a sum (docs/tuning.md).
        return False
    if case['compression'] is not None and case['sets'] != 'per_rank':
        # Error-feedback residuals are each rank's own: with one replica
        # set only rank 0's are in the snapshot (docs/sign_compression.md,
        # docs/compression.md).
        return False
    if case['accumulation'] > 1 and case['sets'] != 'per_rank':
        # The partial sums are each rank's own: with one replica set
        # every rank resumes rank 0's (docs/accumulation.md).
        return False
    if case['mode'] == 'local_steps' and case['sets'] != 'per_rank':
        # The local parameters and inner state are each rank's own: with
        # one replica set every rank resumes rank 0's (docs/local_sgd.md).
        return False
    if case['compression'] == 'auto':
        # Which gradient sets are compressed follows the first steps'
        # timings: a resume before the choice may choose otherwise.
        return False
    return case['data'] != 'shuffled+multiprocess'


def final_ranks(case):
    return {'grow': 3, 'shrink': 2}.get(case['resume'], case['ranks'])


def run_phase(tmp_path, phase, n, todo):
    """Run ``todo`` (cases) in one job at ``n`` ranks; {id: report}."""
    if not todo:
        return {}
    path = tmp_path / ('%s_%d.json' % (phase, n))
    path.write_text(json.dumps(todo))
    env = dict(os.environ, PYTHONPATH=python_path(), OMP_NUM_THREADS='1',
               MNOPT_STALL_WARNING='20', MNOPT_TIMEOUT='60')
    proc = run_job(mpiexec() + ['-n', str(n), os.sys.executable, '-m',
                                'mpi4py', os.path.join(REPO, 'tests',
                                                       'combination_job.py'),
                                str(path), phase, str(tmp_path / 'runs')],
                   60 + 15 * len(todo), env)
    reports = {}
    for line in proc.stdout.splitlines():
        if line.startswith('CASE '):
            report = json.loads(line[5:])
            reports[report['id']] = report
    missing = [c['id'] for c in todo if c['id'] not in reports]
    assert not missing, ('job %s at %d ranks ended (%d) before %s:\n%s'
                         % (phase, n, proc.returncode, missing,
                            proc.stderr[-4000:]))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return reports


def newest_files(tmp_path, case):
    """The files of the newest snapshot the first half wrote."""
    run = tmp_path / 'runs' / case['id'] / 'run'
    return sorted(glob.glob(str(run / ('snapshot_iter_%d*' % 5))))


def damage(tmp_path, case):
    """Lose or replace one file of the newest snapshot; returns the
    iteration the resume must start from."""
    files = newest_files(tmp_path, case)
    assert files, (case, 'no snapshot written')
    if case['resume'] == 'lost':
        os.remove(files[-1])
        return 3
    if case['resume'] == 'stale':
        other = files[-1].replace(os.sep + 'run' + os.sep,
                                  os.sep + 'other' + os.sep)
        shutil.copyfile(other, files[-1])
        # One file is a whole write of its own; several are one write only
        # together, and a set mixing two writes is not loadable.
        return 5 if len(files) == 1 else 3
    return 5


def applies_by_its_stop(case, phase):
    """Whether a phase applies any update before it stops: the first
    update broadcasts, double buffering's second applies nothing, and
    with accumulation an update takes K iterations (double buffering
    with K=2 applies first at iteration 6, past the first half's 5)."""
    stop = 5 if phase == 'first' and case['resume'] != 'none' else 7
    first = (3 if case['mode'] == 'double_buffering' else 2) * \
        case['accumulation']
    return phase == 'second' or first <= stop


def problems_of(case, report, phase):
    """What is wrong with one phase of one case, as readable lines."""
    errors = report['errors']
    why = refused(case)
    if why is not None:
        if not all(e and why in e for e in errors):
            return ['%s: refused combination (%s) expected on every rank, '
                    'got %s' % (phase, why, errors)]
        return []
    if any(errors):
        return ['%s: %s' % (phase, errors)]
    out = []
    runs = [r['run'] for r in report['ranks']]
    if len({digest for _, digest, _, _, _ in runs}) != 1:
        out.append('%s: replicas differ' % phase)
    applies = applies_by_its_stop(case, phase)
    for rank, (_, _, twice, moved, missed) in enumerate(runs):
        if not applies:
            missed = [m for m in missed if m != 'update']
        if missed:
            out.append('%s: rank %d: observing (%s) missed %s'
                       % (phase, rank, case['observe'], missed))
        if twice:
            out.append('%s: rank %d saw samples twice in an epoch: %s'
                       % (phase, rank, twice))
        if not moved and applies:
            out.append('%s: rank %d did not train' % (phase, rank))
    return out


def test_pairwise_combinations(tmp_path):
    todo = cases()
    first = {}
    for n in (2, 3):
        first.update(run_phase(tmp_path, 'first', n,
                               [c for c in todo if c['ranks'] == n]))
    failures, expected_start = [], {}
    for case in todo:
        bad = problems_of(case, first[case['id']], 'first')
        if bad:
            failures.append((case, bad))
        elif case['resume'] != 'none' and refused(case) is None:
            expected_start[case['id']] = damage(tmp_path, case)
    second = {}
    for n in (2, 3):
        second.update(run_phase(
            tmp_path, 'second', n, [c for c in todo if c['id'] in
                                    expected_start and final_ranks(c) == n]))
    for case in todo:
        if case['id'] not in second:
            continue
        report = second[case['id']]
        bad = problems_of(case, report, 'second')
        if not bad:
            ranks = report['ranks']
            resumed = {r['run'][0] for r in ranks}
            if resumed != {expected_start[case['id']]}:
                bad.append('resumed from %s, expected %d' % (
                    sorted(resumed), expected_start[case['id']]))
            if 'reference' in ranks[0] and bit_identical_promised(case) \
                    and ranks[0]['run'][1] != ranks[0]['reference'][1]:
                bad.append('not bit-identical to the uninterrupted run')
        if bad:
            failures.append((case, bad))
    assert not failures, '%d of %d cases failed:\n%s' % (
        len(failures), len(todo), '\n'.join(
            '%s %s\n    %s' % (c['id'], {k: c[k] for k in FACTORS},
                               '\n    '.join(b)) for c, b in failures))
