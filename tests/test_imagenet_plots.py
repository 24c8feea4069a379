"""The ImageNet example's epoch plots (examples/imagenet/plots.py), in the
process: what an epoch's point averages, what a snapshot keeps, and what a
resume leaves out.  tests/test_examples.py and tests/test_restart.py
resume them in whole jobs."""

import json
import types

import numpy
import pytest

from conftest import imagenet_example_module

pytestmark = pytest.mark.one_rank
chainer = pytest.importorskip('chainer', reason='the example needs Chainer')


@pytest.fixture(scope='module')
def epoch_plots():
    return imagenet_example_module('plots')


def step(extension, epoch, new_epoch, **observed):
    trainer = types.SimpleNamespace(
        observation={k.replace('__', '/'): v for k, v in observed.items()},
        updater=types.SimpleNamespace(epoch=epoch, is_new_epoch=new_epoch),
        out=None)
    extension(trainer)


def test_a_point_is_the_weighted_mean_of_its_epoch(epoch_plots):
    ext = epoch_plots.EpochPlots(draw=False)
    loss = chainer.Variable(numpy.array(1.0, numpy.float32))
    step(ext, 0, False, main__loss=loss,
         main__accuracy=(numpy.float32(0.5), 3))
    step(ext, 0, False, main__loss=numpy.array(3.0, numpy.float32),
         main__accuracy=(numpy.float32(1.0), 1),
         comm__hidden=numpy.ones(2))            # not a scalar: left out
    # A validation before the epoch's end (where --iteration stops) is not
    # the epoch's.
    step(ext, 0, False, validation__main__loss=7.0)
    assert ext.sums['main/loss'] == [4.0, 2.0]
    assert 'validation/main/loss' not in ext.sums
    assert 'comm/hidden' not in ext.sums
    step(ext, 1, True, main__loss=5.0, validation__main__loss=9.0)
    assert ext.sums == {}
    assert ext.points == {'main/loss': [[1, 3.0]],
                          'main/accuracy': [[1, (1.5 + 1.0) / 4]],
                          'validation/main/loss': [[1, 9.0]]}


def test_the_snapshot_keeps_the_epochs_sums_and_points(epoch_plots):
    ext = epoch_plots.EpochPlots(draw=False)
    step(ext, 0, False, main__loss=0.1)
    step(ext, 1, True, main__loss=0.2)
    step(ext, 1, False, main__loss=1.0 / 3)
    saved = {}
    ext.serialize(chainer.serializers.DictionarySerializer(saved))
    again = epoch_plots.EpochPlots(draw=False)
    again.serialize(chainer.serializers.NpzDeserializer(saved))
    assert again.sums == {'main/loss': [1.0 / 3, 1.0]}   # bit for bit
    assert again.points == {'main/loss': [[1, (0.1 + 0.2) / 2]]}


def test_a_resume_skips_what_the_snapshot_lacks_or_another_size_restarts(
        epoch_plots):
    key = epoch_plots.SNAPSHOT_KEY
    ours = [key + 'sums', key + 'points', 'updater/iteration']
    earlier = ['extensions/PlotReport/_plot_loss.png', 'updater/iteration']
    skip = epoch_plots.keys_to_skip(ours, same_layout=True)
    assert not skip(key + 'sums') and not skip(key + 'points')
    skip = epoch_plots.keys_to_skip(ours, same_layout=False)
    assert skip(key + 'sums') and not skip(key + 'points')
    skip = epoch_plots.keys_to_skip(earlier, same_layout=True)
    assert skip(key + 'sums') and skip(key + 'points')
    assert not skip('updater/iteration')


def test_the_points_of_chainers_plot_reports_carry_over(epoch_plots,
                                                         tmp_path):
    path = str(tmp_path / 'snapshot.npz')
    numpy.savez(path, **{
        'extensions/PlotReport/_plot_loss.png': json.dumps(
            {'main/loss': [[1, 2.5]], 'validation/main/loss': [[1, 3.0]]}),
        'extensions/PlotReport_1/_plot_accuracy.png': json.dumps(
            {'main/accuracy': [[1, 0.25]]}),
        'updater/iteration': 10})
    with numpy.load(path) as f:
        assert epoch_plots.points_of_plot_reports(f) == {
            'main/loss': [[1, 2.5]], 'validation/main/loss': [[1, 3.0]],
            'main/accuracy': [[1, 0.25]]}
