#!/usr/bin/env python
"""The fault table of docs/reliability.md: inject each fault into a real
job and time how long until every process has ended or recovered.

    python benchmarks/faults.py [--runs 3] [--json FILE] [--markdown FILE]

Each fault runs ``--runs`` times under a hard timeout (a hang shows as
HANG, never as a stuck script).  Jobs run on 3 ranks of this machine with
short stall settings (MNOPT_STALL_WARNING=3, MNOPT_TIMEOUT=10); the
snapshot faults use the ImageNet example on 2 ranks.  "Seconds" count from
the moment the fault is injected (the faulty rank prints the time first)
to the end of the launcher, or for the snapshot faults the whole command.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'tests'))
from conftest import mpiexec  # NOQA  (the launcher the tests use)

HARD_TIMEOUT_S = 120
ENV = {'MNOPT_STALL_WARNING': '3', 'MNOPT_TIMEOUT': '10',
       'PYTHONPATH': REPO}

# argv: fault, communicator.  Rank 1 (or every rank) misbehaves at step 3.
JOB = r'''
import os, signal, sys, time, numpy, mnopt
fault, name = sys.argv[1], sys.argv[2]
comm = mnopt.create_communicator(
    name, allreduce_grad_dtype='float16' if 'overflow' in fault else None,
    on_overflow='error' if fault == 'overflow-error' else 'warn')
def mark():
    print('FAULT_AT %.3f' % time.time(), flush=True)
for step in range(6):
    grads = [('w', numpy.full(1000, 1.0, numpy.float32)),
             ('v', numpy.full(10, 2.0, numpy.float32))]
    if step == 3:
        if comm.rank == 1 and fault in ('kill', 'stall', 'mismatch', 'nan'):
            mark()
            if fault == 'kill':
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == 'stall':
                os.kill(os.getpid(), signal.SIGSTOP)
            if fault == 'mismatch':
                grads[1] = ('v', numpy.full(11, 2.0, numpy.float32))
            if fault == 'nan':
                grads[0][1][0] = numpy.nan
        if fault.startswith('overflow'):
            if comm.rank == 0:
                mark()
            grads[0][1][:] = 1e5
    try:
        comm.mean_grads(grads)
    except (mnopt.LayoutMismatchError, mnopt.GradientOverflowError) as e:
        print('rank %d stopped: %s: %s' % (comm.rank, type(e).__name__,
                                            str(e)[:100]), flush=True)
        sys.exit(2)
    if step == 3 and fault == 'nan':
        assert numpy.isnan(grads[0][1][0]) and grads[0][1][1] == 1.0
print('rank %d done' % comm.rank, flush=True)
'''

SERVER_FAULT = r'''
import os, signal, sys, time
how = sys.argv.pop(1)
from mnopt import server
from mnopt.server import loop as server_loop
serve_one = server_loop._reduce
calls = [0]
def serve_then_fail(*args, **kwargs):
    serve_one(*args, **kwargs)
    calls[0] += 1
    if calls[0] == 3:
        print('FAULT_AT %.3f' % time.time(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL if how == 'kill'
                else signal.SIGSTOP)
server_loop._reduce = serve_then_fail
server.main()
'''

FAULTS = [
    # (key, description, kind)
    ('kill', 'rank killed (SIGKILL) before an averaging', 'job'),
    ('stall', 'rank stalled (SIGSTOP) before an averaging', 'job'),
    ('server-kill', 'reduction server killed mid-job', 'server'),
    ('server-stall', 'reduction server stalled (SIGSTOP) mid-job', 'server'),
    ('mismatch', 'layout mismatch (one rank\'s gradient has another shape)',
     'job'),
    ('nan', 'NaN in one rank\'s gradients', 'job'),
    ('overflow', 'float16 wire overflow (gradients of 1e5)', 'job'),
    ('overflow-error', "float16 overflow with on_overflow='error'", 'job'),
    ('snapshot-corrupt', 'corrupt snapshot given to --resume', 'snapshot'),
    ('snapshot-truncated', 'newest snapshot truncated, --resume auto',
     'snapshot'),
    ('snapshot-kill-during-write', 'rank killed while snapshots were '
     'written (the newest set incomplete), --resume auto', 'snapshot'),
    ('unwritable-out', 'output directory cannot be written', 'snapshot'),
]


def launch(argv, env):
    """(status or 'HANG', stdout, stderr, seconds) under the hard timeout,
    killing the launcher's process group on a hang."""
    start = time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(os.environ, **env),
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=HARD_TIMEOUT_S)
        status = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        status = 'HANG'
    return status, out, err, start, time.time()


def fault_time(out, fallback):
    for line in out.splitlines():
        if line.startswith('FAULT_AT '):
            return float(line.split()[1])
    return fallback


def run_job(key, tmp):
    script = os.path.join(tmp, 'job.py')
    with open(script, 'w') as f:
        f.write(JOB)
    n = 3
    argv = mpiexec() + ['-n', str(n), sys.executable, '-m', 'mpi4py',
                        script, key, 'flat']
    status, out, err, start, end = launch(argv, ENV)
    t = end - fault_time(out, start)
    if key in ('kill',):
        what = 'the job ends (MPI launcher), exit %s' % status
    elif key == 'stall':
        named = err.count('not arrived: rank 1 (no answer')
        what = ('%d ranks name rank 1 at the warning time (3 s), then the '
                'job is aborted at the timeout (10 s), exit %s'
                % (named // 2, status))
    elif key == 'mismatch':
        what = ('LayoutMismatchError on %d of %d ranks, naming the '
                'gradient; exit %s' % (out.count('LayoutMismatchError'), n,
                                       status))
    elif key == 'nan':
        what = ('passes through unchanged, unreported (%d of %d ranks '
                'finish)' % (out.count(' done'), n))
    elif key == 'overflow':
        what = ('%d warning(s) on rank 0 naming the parameter; the job goes '
                'on (%d of %d ranks finish)' % (
                    err.count('overflowed'), out.count(' done'), n))
    else:
        what = ('GradientOverflowError on %d of %d ranks; exit %s'
                % (out.count('GradientOverflowError'), n, status))
    return status, t, what, err


def run_server(key, tmp):
    script = os.path.join(tmp, 'job.py')
    with open(script, 'w') as f:
        f.write(JOB)
    server = os.path.join(tmp, 'server.py')
    with open(server, 'w') as f:
        f.write(SERVER_FAULT)
    how = 'kill' if key == 'server-kill' else 'stall'
    argv = mpiexec() + ['-n', '2', sys.executable, '-m', 'mpi4py', script,
                        'none', 'reduction_server', ':', '-n', '1',
                        sys.executable, '-m', 'mpi4py', server, how]
    status, out, err, start, end = launch(argv, ENV)
    t = end - fault_time(out, start)
    if how == 'kill':
        what = 'the job ends (MPI launcher), exit %s' % status
    else:
        what = ('workers name "server 0 (no answer" at the warning time, '
                'abort at the timeout; exit %s (%d report lines)'
                % (status, err.count('servers: server 0 (no answer')))
    return status, t, what, err


TRAIN = os.path.join(REPO, 'examples', 'imagenet', 'train_imagenet.py')


def train(out, cache, *extra):
    return mpiexec() + ['-n', '2', sys.executable, '-m', 'mpi4py', TRAIN,
                        '--out', out, '--data-cache', cache, '--cpu',
                        '--batchsize', '4', '--val-batchsize', '8',
                        '--snapshot-interval', '2', '--keep-snapshots',
                        '3'] + list(extra)


def run_snapshot(key, tmp, cache):
    out = os.path.join(tmp, 'out')
    if key != 'unwritable-out':
        status, _, err, _, _ = launch(train(out, cache, '--iteration', '4'),
                                      ENV)
        assert status == 0, err[-2000:]
    newest = os.path.join(out, 'snapshot_iter_4.npz')
    if key == 'snapshot-corrupt':
        with open(newest, 'r+b') as f:
            f.seek(100)
            f.write(b'\0' * 200)
        argv = train(out, cache, '--iteration', '6', '--resume', newest)
    elif key == 'snapshot-truncated':
        with open(newest, 'r+b') as f:
            f.truncate(os.path.getsize(newest) // 2)
        argv = train(out, cache, '--iteration', '6', '--resume', 'auto')
    elif key == 'snapshot-kill-during-write':
        # What a kill between two ranks' writes leaves: the shared file and
        # rank 0's, no rank-1 file, and a temporary file cut short.
        os.remove(os.path.join(out, 'snapshot_iter_4.rank1.npz'))
        with open(os.path.join(out, 'snapshot_iter_4.rank1.npz.tmp99'),
                  'wb') as f:
            f.write(b'PK\x03\x04 cut short')
        argv = train(out, cache, '--iteration', '6', '--resume', 'auto')
    else:
        with open(out, 'w') as f:   # a file where the directory should be
            f.write('not a directory')
        argv = train(out, cache, '--iteration', '2')
    env = dict(ENV, MNOPT_RESTART='1')
    status, stdout, err, start, end = launch(argv, env)
    if key == 'snapshot-corrupt':
        what = ('clear error on every rank before training (%s), exit %s'
                % ('rank 0 and rank 1 named' if 'rank 0:' in err and
                   'rank 1:' in err else 'NOT on every rank', status))
    elif key in ('snapshot-truncated', 'snapshot-kill-during-write'):
        line = [s for s in stdout.splitlines() if 'restart 1:' in s]
        what = ('%s; the run completes, exit %s' % (
            line[0].split('restart 1: ')[1].replace(out + '/', '')
            if line else 'did not resume', status))
    else:
        what = ('error on every rank before training: %s; exit %s' % (
            'yes' if 'rank 0:' in err and 'rank 1:' in err else 'NO',
            status))
    return status, end - start, what, err


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--runs', type=int, default=3)
    p.add_argument('--only', nargs='+', help='these faults only')
    p.add_argument('--json')
    p.add_argument('--markdown')
    args = p.parse_args()
    cache = tempfile.mkdtemp(prefix='mnopt-faults-cache-')
    rows = []
    for key, description, kind in FAULTS:
        if args.only and key not in args.only:
            continue
        times, whats, statuses = [], [], []
        for _ in range(args.runs):
            tmp = tempfile.mkdtemp(prefix='mnopt-fault-')
            try:
                if kind == 'job':
                    status, t, what, err = run_job(key, tmp)
                elif kind == 'server':
                    status, t, what, err = run_server(key, tmp)
                else:
                    status, t, what, err = run_snapshot(key, tmp, cache)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            times.append(t)
            whats.append(what)
            statuses.append(status)
            if status == 'HANG':
                what = 'HANG (killed after %d s)' % HARD_TIMEOUT_S
        row = {'fault': key, 'description': description, 'what': whats[0],
               'statuses': statuses, 'seconds': times,
               'same_outcome_every_run': len(set(whats)) == 1}
        rows.append(row)
        times.sort()
        print('%-28s %6.1f %6.1f %6.1f s  %s' % (
            key, times[0], times[len(times) // 2], times[-1], whats[0]),
            flush=True)
        if len(set(whats)) > 1:
            print('    (outcomes differ between runs: %s)' % whats)
    shutil.rmtree(cache, ignore_errors=True)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(rows, f, indent=1)
    if args.markdown:
        with open(args.markdown, 'w') as f:
            f.write('| fault | what mnopt does | seconds to end or recover '
                    '(min / median / max of %d) |\n|---|---|---|\n'
                    % args.runs)
            for r in rows:
                t = sorted(r['seconds'])
                f.write('| %s | %s | %.1f / %.1f / %.1f |\n' % (
                    r['description'], r['what'], t[0], t[len(t) // 2],
                    t[-1]))


if __name__ == '__main__':
    main()
