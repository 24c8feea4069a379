"""Restart without losing work: a rank SIGKILLed at a random point of an
ImageNet-example run; python -m mnopt.launch relaunches the job, which
resumes from the newest complete snapshot (--resume auto) and ends with
parameters bit-identical to an uninterrupted run, across an epoch
boundary, for the plain, the double-buffered and the sharded optimizer
(each rank's share of the optimizer state comes back from its own
file) and with PowerSGD (each rank's residuals too)."""

import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import (REPO, build_embedded_set, mpiexec, run_mpi,
                      snapshot_models_equal, snapshot_plots_equal, slack)

pytestmark = pytest.mark.spawn
pytest.importorskip('chainer', reason='the example needs Chainer')
pytest.importorskip('PIL', reason="the example needs mnopt[examples]")
TRAIN = os.path.join(REPO, 'examples', 'imagenet', 'train_imagenet.py')
# A sixteenth of the embedded set, 40 images at 2 ranks x 4: 5 iterations
# an epoch.  The run resumes in epoch 1 (a new order was drawn once) and
# crosses into epoch 2 (drawn again): the order's generator must come back
# with the snapshot.
ITERATIONS, INTERVAL, EPOCH = 12, 2, 5
IMAGES_PER_CLASS, BATCH = 5, 4


@pytest.fixture(scope='module')
def data_cache(tmp_path_factory):
    return build_embedded_set(str(tmp_path_factory.mktemp('embedded')),
                              IMAGES_PER_CLASS, IMAGES_PER_CLASS // 4)


MODES = {'plain': [], 'double-buffering': ['--double-buffering'],
         'sharded': ['--shard-state'],
         # Residuals and warm Qs come back from each rank's own file.
         'powersgd': ['--compression', 'powersgd', '--powersgd-rank', '2']}


#: The plots drawn (matplotlib: half a short job's time) in one mode, whose
#: runs draw them at the end of each epoch; every mode's restarted run
#: ends with the uninterrupted run's plot state.
PLOTTED = 'plain'
PLOTS = ('accuracy.png', 'loss.png', 'communication.png')


def flags(out, cache, mode):
    return ['--out', str(out), '--data-cache', cache, '--batchsize',
            str(BATCH), '--val-batchsize', '8', '--cpu', '--seed', '3',
            '--iteration', str(ITERATIONS), '--snapshot-interval',
            str(INTERVAL), '--keep-snapshots', '2'] + MODES[mode] + (
                [] if mode == PLOTTED else ['--noplot'])


def ranks_of(out):
    """PIDs of the job's ranks (python processes running the example with
    this output directory), from /proc."""
    pids = []
    for pid in os.listdir('/proc'):
        try:
            with open('/proc/%s/cmdline' % pid, 'rb') as f:
                argv = f.read().split(b'\0')
        except OSError:
            continue
        if argv and os.path.basename(argv[0]).startswith(b'python') and \
                TRAIN.encode() in argv and str(out).encode() in argv and \
                b'mnopt.launch' not in argv:
            pids.append(int(pid))
    return pids


@pytest.mark.parametrize('mode', sorted(MODES))
def test_killed_rank_restart_is_bit_identical(tmp_path, data_cache, mode):
    rng = random.Random()
    whole, part = tmp_path / 'whole', tmp_path / 'part'
    code = 'import runpy, sys\nrunpy.run_path(%r, run_name="__main__")\n' \
        % TRAIN
    proc = run_mpi(2, code, timeout=300, args=flags(whole, data_cache,
                                                    mode))
    assert proc.returncode == 0, proc.stderr[-3000:]

    launcher = [sys.executable, '-m', 'mnopt.launch', '--max-restarts', '2',
                '--'] + mpiexec() + ['-n', '2', sys.executable, '-m',
                                     'mpi4py', TRAIN, '--resume', 'auto'] \
        + flags(part, data_cache, mode)
    job = subprocess.Popen(launcher, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=REPO,
                           env=dict(os.environ, PYTHONPATH=REPO),
                           start_new_session=True)
    try:
        # Kill one rank at a random moment in epoch 1, shortly after the
        # shared file of snapshot 8 appears: while the ranks' own files may
        # still be written (then 6 is the newest complete one).  The moment
        # is drawn from the first half of the time 6 to 8 took, so the kill
        # lands before snapshot 10 however fast or busy the machine is.
        after = 8
        deadline = time.time() + slack(240)
        appeared = {}
        for snapshot in (after - INTERVAL, after):
            path = part / ('snapshot_iter_%d.npz' % snapshot)
            while not path.exists():
                assert time.time() < deadline and job.poll() is None
                time.sleep(0.01)
            appeared[snapshot] = time.time()
        time.sleep(rng.uniform(0, 0.5) * (
            appeared[after] - appeared[after - INTERVAL]))
        victims = ranks_of(part)
        assert len(victims) == 2, victims
        os.kill(rng.choice(victims), signal.SIGKILL)
        out, err = job.communicate(timeout=slack(300))
    except BaseException:
        os.killpg(job.pid, signal.SIGKILL)
        raise
    assert job.returncode == 0, err[-3000:]
    assert err.count('mnopt.launch: the job exited with status') == 1, \
        err[-3000:]
    assert 'restart 1: resuming from' in out, out[-3000:]
    resumed = int(out.split('restart 1: resuming from ')[1].split(
        'snapshot_iter_')[1].split('.npz')[0])
    assert resumed in (after - INTERVAL, after)   # both in epoch 1
    assert EPOCH < resumed < 2 * EPOCH
    # The restarted run's summary: its own iterations, the ones before the
    # resume apart, at a rate (not nan); its own last snapshot.
    closing = out[out.rindex('== mnopt'):]
    # Within 80 columns (a path alone on its line is never broken).
    assert all(len(line) <= 80 or len(line.split()) == 1
               for line in closing.splitlines()), closing
    closing = re.sub(r'\n {11}(?=\S)', ' ', closing)
    assert re.search(r'^training   %d iterations this run \(%d before the '
                     r'resume\) in [\d.]+ s: \d+ images/s' % (
                         ITERATIONS - resumed, resumed), closing, re.M), \
        closing
    assert 'nan' not in closing
    assert re.search(r'^snapshot\s+%s ' % re.escape(str(
        part / ('snapshot_iter_%d.npz' % ITERATIONS))), closing, re.M), \
        closing
    # The plots it drew, by name, in the folder it names once.
    assert bool(re.search(r'^plots      accuracy\.png, loss\.png, '
                          r'communication\.png in %s$' % re.escape(str(part)),
                          closing, re.M)) == (mode == PLOTTED), closing
    snapshot_models_equal(whole / ('snapshot_iter_%d.npz' % ITERATIONS),
                          part / ('snapshot_iter_%d.npz' % ITERATIONS))
    snapshot_plots_equal(whole / ('snapshot_iter_%d.npz' % ITERATIONS),
                         part / ('snapshot_iter_%d.npz' % ITERATIONS))
    for out in whole, part:
        assert all((out / p).exists() for p in PLOTS) == (mode == PLOTTED)


def test_launcher_gives_up_after_max_restarts(tmp_path):
    proc = subprocess.run(
        [sys.executable, '-m', 'mnopt.launch', '--max-restarts', '2',
         '--delay', '0', '--', sys.executable, '-c',
         'import os, sys; print("attempt", os.environ["MNOPT_RESTART"]); '
         'sys.exit(3)'], capture_output=True, text=True, timeout=slack(60),
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 3
    assert proc.stdout.split() == ['attempt', '0', 'attempt', '1',
                                   'attempt', '2']
    assert 'attempt 3 of 3); no restarts left' in proc.stderr


def test_launcher_stops_at_the_first_success():
    proc = subprocess.run(
        [sys.executable, '-m', 'mnopt.launch', '--delay', '0', '--',
         sys.executable, '-c', 'import os, sys; '
         'sys.exit(0 if os.environ["MNOPT_RESTART"] == "1" else 1)'],
        capture_output=True, text=True, timeout=slack(60), cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0
    assert proc.stderr.count('exited with status 1') == 1


def test_resume_auto_without_snapshots_starts_afresh(tmp_path, data_cache):
    code = 'import runpy, sys\nrunpy.run_path(%r, run_name="__main__")\n' \
        % TRAIN
    proc = run_mpi(2, code, timeout=200, args=[
        '--out', str(tmp_path), '--data-cache', data_cache, '--batchsize',
        '4', '--val-batchsize', '8', '--cpu', '--iteration', '2',
        '--resume', 'auto', '--noplot'], env={'MNOPT_RESTART': '1'})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'no complete snapshot yet, starting afresh' in proc.stdout
