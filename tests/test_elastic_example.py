"""Lose a node, keep training, end to end: the ImageNet example under
``python -m mnopt.launch --hosts ... --min-nodes 1``, two fake hosts (this
machine's two names), one process each.  The second host's process
"loses its node" once the snapshot of iteration 4 is complete (it marks
its host down for the probe, then SIGKILLs itself); the launcher
relaunches on the host left, and the example resumes on 1 rank from the
newest complete snapshot (``--resume auto``) with the rest of the
interrupted epoch, and finishes."""

import os
import sys

import pytest

from conftest import REPO, build_embedded_set, mpiexec, python_path, run_job

pytestmark = pytest.mark.spawn
pytest.importorskip('chainer', reason='the example needs Chainer')
pytest.importorskip('PIL', reason="the example needs mnopt[examples]")
TRAIN = os.path.join(REPO, 'examples', 'imagenet', 'train_imagenet.py')

#: Each process: the example, and on the second host in the first attempt
#: a thread that takes its node away once snapshot 4 is complete.
WRAPPER = r'''
import os, runpy, signal, sys, threading, time
from mpi4py import MPI
out, flag = sys.argv[1], sys.argv[2]

def lose_the_node():
    done = [os.path.join(out, n) for n in ('snapshot_iter_4.npz',
            'snapshot_iter_4.rank0.npz', 'snapshot_iter_4.rank1.npz')]
    while not all(os.path.exists(p) for p in done):
        time.sleep(0.01)
    open(flag, 'w').close()
    os.kill(os.getpid(), signal.SIGKILL)

if os.environ['MNOPT_RESTART'] == '0' and MPI.COMM_WORLD.rank == 1:
    threading.Thread(target=lose_the_node, daemon=True).start()
sys.argv = [%r] + sys.argv[3:]
runpy.run_path(%r, run_name='__main__')
''' % (TRAIN, TRAIN)


def test_a_lost_node_costs_a_relaunch_on_the_nodes_left(tmp_path):
    cache = build_embedded_set(str(tmp_path / 'embedded'), 10, 2)
    wrapper = tmp_path / 'wrapper.py'
    wrapper.write_text(WRAPPER)
    out = tmp_path / 'out'
    env = dict(os.environ, PYTHONPATH=python_path())
    done = run_job([
        sys.executable, '-m', 'mnopt.launch', '--hosts',
        'localhost,127.0.0.1', '--min-nodes', '1', '--procs-per-node', '1',
        '--delay', '0', '--max-restarts', '2',
        '--probe', 'test ! -e %s/down-{host}' % tmp_path,
        '--mpiexec', mpiexec()[0], '--',
        sys.executable, '-m', 'mpi4py', str(wrapper), str(out),
        str(tmp_path / 'down-127.0.0.1'),
        '--out', str(out), '--data-cache', cache, '--batchsize', '4',
        '--val-batchsize', '8', '--cpu', '--noplot', '--iteration', '10',
        '--snapshot-interval', '2', '--resume', 'auto', '--async-snapshots'],
        360, env)
    assert done.returncode == 0, done.stderr[-3000:]
    err, said = done.stderr, done.stdout
    assert 'dropped 127.0.0.1: the probe exited with status 1' in err, err
    assert 'starting on 1 host (localhost), 1 process each' in err
    # Resumed on 1 rank from a snapshot of 2: iteration 4 or later, the
    # rest of the epoch split anew.
    assert 'restart 1: resuming from' in said, said[-3000:]
    assert '(data split anew for 1 ranks)' in said, said[-3000:]
    assert 'examples not read yet' in said, said[-3000:]
    assert (out / 'snapshot_iter_10.npz').exists()
