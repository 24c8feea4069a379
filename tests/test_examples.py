"""The ImageNet and digits examples, run as whole mpiexec jobs."""

import os

import pytest

from conftest import REPO, run_mpi, snapshot_models_equal

pytestmark = pytest.mark.spawn
pytest.importorskip('chainer', reason='the examples need Chainer')
pytest.importorskip('PIL', reason="the examples need mnopt[examples]")
TRAIN = os.path.join(REPO, 'examples', 'imagenet', 'train_imagenet.py')
DIGITS = os.path.join(REPO, 'examples', 'digits', 'train_digits.py')


@pytest.fixture(scope='module')
def data_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp('embedded'))


def train(n, out, cache, *flags, timeout=240):
    code = 'import runpy, sys\nrunpy.run_path(%r, run_name="__main__")\n' \
        % TRAIN
    return run_mpi(n, code, timeout=timeout, args=[
        '--out', str(out), '--data-cache', cache, '--batchsize', '4',
        '--val-batchsize', '8', '--cpu'] + list(flags))


@pytest.mark.parametrize('flags', [
    ['--communicator', 'flat'],
    ['--communicator', 'hierarchical'],
    ['--communicator', 'naive'],
    ['--communicator', 'flat', '--allreduce-grad-dtype', 'float16'],
    ['--communicator', 'flat', '--double-buffering'],
    ['--communicator', 'flat', '--loaderjob', '2'],
    ['--communicator', 'flat', '--arch', 'resnet50', '--mnbn'],
], ids=['flat', 'hierarchical', 'naive', 'fp16', 'double-buffering',
        'loader-processes', 'resnet50-mnbn'])
def test_a_few_iterations(tmp_path, data_cache, flags):
    proc = train(2, tmp_path, data_cache, '--iteration', '4', *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'mnopt ImageNet example: 2 ranks' in proc.stdout
    assert proc.stdout.count('mnopt ImageNet example') == 1  # rank 0 only
    assert (tmp_path / 'log').exists()
    assert (tmp_path / 'snapshot_iter_4.npz').exists()
    if '--mnbn' in flags:
        assert ', multi-node batch normalization' in proc.stdout


@pytest.mark.parametrize('double_buffering', [False, True])
def test_resume_reproduces_an_uninterrupted_run(tmp_path, data_cache,
                                                double_buffering):
    db = ['--double-buffering'] if double_buffering else []
    whole, part = tmp_path / 'whole', tmp_path / 'part'
    assert train(2, whole, data_cache, '--iteration', '6',
                 '--snapshot-interval', '3', '--keep-snapshots', '5',
                 *db).returncode == 0
    assert train(2, part, data_cache, '--iteration', '3',
                 '--snapshot-interval', '3', *db).returncode == 0
    proc = train(2, part, data_cache, '--iteration', '6',
                 '--snapshot-interval', '3', '--resume',
                 str(part / 'snapshot_iter_3.npz'), *db)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'resumed from' in proc.stdout
    snapshot_models_equal(whole / 'snapshot_iter_6.npz',
                          part / 'snapshot_iter_6.npz')


def test_resume_on_another_number_of_ranks(tmp_path, data_cache):
    assert train(1, tmp_path, data_cache, '--iteration', '2',
                 '--snapshot-interval', '2').returncode == 0
    proc = train(3, tmp_path, data_cache, '--iteration', '4', '--resume',
                 str(tmp_path / 'snapshot_iter_2.npz'))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'data split anew for 3 ranks' in proc.stdout
    assert (tmp_path / 'snapshot_iter_4.npz').exists()


@pytest.mark.parametrize('damage', ['missing', 'corrupt'])
def test_bad_snapshot_is_a_clear_error(tmp_path, data_cache, damage):
    snap = tmp_path / 'snapshot_iter_9.npz'
    if damage == 'corrupt':
        snap.write_bytes(b'PK\x03\x04 this is not a snapshot')
    proc = train(2, tmp_path, data_cache, '--iteration', '2', '--resume',
                 str(snap), timeout=120)
    assert proc.returncode != 0
    assert 'cannot resume from' in proc.stderr
    assert 'rank 0:' in proc.stderr and 'rank 1:' in proc.stderr


def test_digits_smoke(tmp_path):
    out = tmp_path / 'digits.json'
    code = 'import runpy\nrunpy.run_path(%r, run_name="__main__")\n' % DIGITS
    proc = run_mpi(2, code, args=['--epoch', '3', '--json', str(out),
                                  '--allreduce-grad-dtype', 'float16',
                                  '--double-buffering'], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    result = json.load(open(str(out)))
    assert result['n_ranks'] == 2 and len(result['curve']) == 3
    assert result['test_accuracy'] > 0.3  # 3x chance: it learns
