"""The ImageNet example's snapshots in the background (--async-snapshots):
the same state as the snapshots written in line, no half-written file
left, and a resume from them on another number of ranks that goes on with
the rest of the interrupted epoch.  Whole mpiexec jobs."""

import os

import pytest

from conftest import build_embedded_set, snapshot_models_equal

pytestmark = pytest.mark.spawn
pytest.importorskip('chainer', reason='the example needs Chainer')
pytest.importorskip('PIL', reason="the example needs mnopt[examples]")

from test_examples import train  # NOQA


@pytest.fixture(scope='module')
def data_cache(tmp_path_factory):
    return build_embedded_set(str(tmp_path_factory.mktemp('embedded')),
                              10, 2)


def test_async_snapshots_hold_what_snapshots_in_line_hold(tmp_path,
                                                           data_cache):
    runs = {}
    for mode in ('inline', 'async'):
        out = tmp_path / mode
        proc = train(2, out, data_cache, '--iteration', '4', '--seed', '3',
                     '--snapshot-interval', '2', '--keep-snapshots', '1',
                     *(['--async-snapshots'] if mode == 'async' else []))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = out
    snapshot_models_equal(runs['inline'] / 'snapshot_iter_4.npz',
                          runs['async'] / 'snapshot_iter_4.npz')
    names = sorted(os.listdir(runs['async']))
    assert not [n for n in names if 'partial' in n or '.tmp' in n], names
    for r in (0, 1):
        assert 'snapshot_iter_4.rank%d.npz' % r in names
    # The write in flight is no snapshot yet: one complete one is kept
    # beside it (in line, the new one is complete when the old one goes).
    assert 'snapshot_iter_2.npz' in names
    assert 'snapshot_iter_2.npz' not in os.listdir(runs['inline'])
    # Resumed on 3 ranks: the rest of the epoch, split among them.
    proc = train(3, runs['async'], data_cache, '--iteration', '6',
                 '--resume', 'auto', '--async-snapshots')
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'at iteration 4 (data split anew for 3 ranks)' in proc.stdout
    assert 'examples not read yet' in proc.stdout, proc.stdout[-3000:]
    assert (runs['async'] / 'snapshot_iter_6.npz').exists()
