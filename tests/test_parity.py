"""ChainerMN's data-parallel pieces beyond the communicator: datasets,
iterators, trainer extensions, set_config/get_config.  Serially and under
mpiexec -n 2 / -n 3, on every CPU communicator, with exact values; ranks
that disagree get the same error on every rank."""

import types

import numpy
import pytest

from conftest import chainer, needs_chainer

pytestmark = needs_chainer

import mnopt  # NOQA


@pytest.fixture
def comm(any_comm):
    """Every CPU communicator, reduction_server workers included."""
    return any_comm


def test_config_per_communicator(comm):
    assert comm.get_config('allreduce_grad_dtype') is None
    assert comm.get_config('batched_copy') is True
    comm.set_config('allreduce_grad_dtype', numpy.float16)
    assert comm.get_config('allreduce_grad_dtype') == numpy.dtype('float16')
    other = mnopt.create_communicator('flat')
    assert other.get_config('allreduce_grad_dtype') is None  # not shared
    comm.set_config('allreduce_grad_dtype', dtype='bfloat16')
    assert comm.get_config() == {'allreduce_grad_dtype': 'bfloat16',
                                 'batched_copy': True}
    comm.set_config('batched_copy', False)
    assert comm.get_config('batched_copy') is False  # kept, as ChainerMN
    grads = [('w', numpy.full(4, comm.rank, numpy.float32))]
    comm.mean_grads(grads)
    numpy.testing.assert_array_equal(grads[0][1], (comm.size - 1) / 2.0)
    with pytest.raises(ValueError, match='allreduce_grad_dtype must be'):
        comm.set_config('allreduce_grad_dtype', numpy.int32)
    with pytest.raises(ValueError, match='unknown config'):
        comm.get_config('batch_size')
    other.finalize()


@needs_chainer
def test_debug_mode_reports_a_mean_that_is_not_finite(comm):
    # ChainerMN's check under chainer.set_debug(True): a mean gradient
    # that is not finite is a ValueError on every rank.
    model = chainer.Link()
    with model.init_scope():
        model.w = chainer.Parameter(numpy.ones(3, numpy.float32))
    model.w.grad = numpy.array([1, numpy.nan if comm.rank == 0 else 2, 3],
                               numpy.float32)
    comm.multi_node_mean_grad(model)  # not in debug mode: no check
    model.w.grad = numpy.array([1, numpy.nan if comm.rank == 0 else 2, 3],
                               numpy.float32)
    with chainer.using_config('debug', True):
        with pytest.raises(ValueError, match='diverged .*w'):
            comm.multi_node_mean_grad(model)
        model.w.grad = numpy.ones(3, numpy.float32)
        comm.multi_node_mean_grad(model)  # finite: no error


def test_copies_of_a_model_share_its_communicator(comm):
    # A communicator is a handle on shared MPI state: a deep copy of a
    # user's model holding one (as ChainerMN scripts keep it on the model)
    # must work and talk to the same ranks.
    import copy
    model = chainer.Link()
    model.comm = comm
    for clone in (copy.deepcopy(model), copy.copy(model),
                  model.copy(mode='copy')):
        assert clone.comm is comm
    grads = [('w', numpy.full(2, comm.rank, numpy.float32))]
    copy.deepcopy(model).comm.mean_grads(grads)
    numpy.testing.assert_array_equal(grads[0][1], (comm.size - 1) / 2.0)


def test_create_empty_dataset():
    data = mnopt.datasets.create_empty_dataset(list(range(7)))
    assert data == [()] * 7
    assert mnopt.datasets.create_empty_dataset([]) == []


def _iterator(n, batch, repeat=True, shuffle=False):
    import chainer
    return chainer.iterators.SerialIterator(list(range(n)), batch,
                                            repeat=repeat, shuffle=shuffle)


@pytest.mark.parametrize('master', [0, -1])
def test_multi_node_iterator_broadcasts_the_masters_batches(comm, master):
    master = master % comm.size
    actual = _iterator(10, 4, repeat=False) if comm.rank == master else None
    it = mnopt.iterators.create_multi_node_iterator(actual, comm, master)
    batches = [(b, it.epoch, it.is_new_epoch) for b in it]
    assert batches == [([0, 1, 2, 3], 0, False), ([4, 5, 6, 7], 0, False),
                       ([8, 9], 1, True)]
    # The same batches on every rank.
    assert all(b == batches for b in comm.allgather_obj(batches))
    with pytest.raises(StopIteration):
        it.next()


def test_multi_node_iterator_repeats_and_serializes(comm):
    import chainer
    actual = _iterator(6, 4) if comm.rank == 0 else None
    it = mnopt.iterators.create_multi_node_iterator(actual, comm)
    assert it.next() == [0, 1, 2, 3]
    assert it.next() == [4, 5, 0, 1]
    assert (it.epoch, it.is_new_epoch) == (1, True)
    assert it.epoch_detail == pytest.approx(8 / 6.0)
    state = {}
    it.serialize(chainer.serializers.DictionarySerializer(state))
    assert int(state['epoch']) == 1


def test_multi_node_iterator_masters_must_agree(comm):
    if comm.size == 1:
        pytest.skip('needs two ranks')
    with pytest.raises(ValueError, match='ranks disagree on rank_master of '
                                         'create_multi_node_iterator: rank 0: '
                                         '0, rank 1: 1'):
        mnopt.iterators.create_multi_node_iterator(
            _iterator(4, 2), comm, rank_master=min(comm.rank, 1))


def test_synchronized_iterator_draws_one_order(comm):
    numpy.random.seed(100 + comm.rank)  # ranks would shuffle differently
    it = mnopt.iterators.create_synchronized_iterator(
        _iterator(20, 5, shuffle=True), comm)
    seen = [it.next() for _ in range(8)]   # two epochs
    assert all(s == seen for s in comm.allgather_obj(seen))
    assert sorted(sum(seen[:4], [])) == list(range(20))
    assert sum(seen[:4], []) != sum(seen[4:], [])   # reshuffled


def test_synchronized_iterator_lengths_must_agree(comm):
    if comm.size == 1:
        pytest.skip('needs two ranks')
    with pytest.raises(ValueError, match='the length of the dataset of '
                                         'create_synchronized_iterator: rank '
                                         '0: 10, rank 1: 11'):
        mnopt.iterators.create_synchronized_iterator(
            _iterator(10 + min(comm.rank, 1), 5, shuffle=True), comm)


def fake_trainer():
    updater = types.SimpleNamespace(iteration=0, epoch=0, epoch_detail=0.0,
                                    previous_epoch_detail=None,
                                    is_new_epoch=False)
    return types.SimpleNamespace(observation={}, updater=updater)


def step(trainer):
    trainer.updater.iteration += 1
    trainer.updater.epoch_detail = trainer.updater.iteration / 100.0
    trainer.observation = {}


def test_observation_aggregator_means_over_ranks_and_iterations(comm):
    agg = mnopt.extensions.ObservationAggregator(
        comm, 'main/loss', 'main/mean_loss', comm_trigger=(2, 'iteration'))
    trainer = fake_trainer()
    got = []
    for k in range(1, 5):
        step(trainer)
        trainer.observation['main/loss'] = numpy.float32(10 * k + comm.rank)
        agg(trainer)
        got.append(trainer.observation.get('main/mean_loss'))
    mean_rank = (comm.size - 1) / 2.0
    assert got == [None, 15 + mean_rank, None, 35 + mean_rank]


def test_observation_aggregator_keys_must_agree(comm):
    if comm.size == 1:
        pytest.skip('needs two ranks')
    agg = mnopt.extensions.ObservationAggregator(comm, 'val/loss')
    trainer = fake_trainer()
    step(trainer)
    if comm.rank != 1:
        trainer.observation['val/loss'] = 1.0
    with pytest.raises(ValueError, match="ranks reported 'val/loss' at "
                                         "different iterations: rank 0: x; "
                                         "rank 1: \\."):
        agg(trainer)


def test_allreduce_persistent_averages_running_statistics(comm):
    import chainer.links as L
    model = L.BatchNormalization(3)
    model.avg_mean[...] = comm.rank
    model.avg_var[...] = 2.0 * comm.rank + 1
    model.N = 7 + comm.rank   # an int counter: left alone
    mnopt.extensions.AllreducePersistent(model, comm)()
    numpy.testing.assert_array_equal(model.avg_mean, (comm.size - 1) / 2.0)
    numpy.testing.assert_array_equal(model.avg_var, comm.size)
    assert model.avg_mean.dtype == numpy.float32
    assert model.N == 7 + comm.rank


def test_allreduce_persistent_layouts_must_agree(comm):
    import chainer.links as L
    if comm.size == 1:
        pytest.skip('needs two ranks')
    model = L.BatchNormalization(3 + min(comm.rank, 1))
    with pytest.raises(ValueError, match='the persistent values of rank 0 '
                                         'and rank 1 differ'):
        mnopt.extensions.AllreducePersistent(model, comm)()


def test_early_stopping_decides_alike_on_the_mean(comm):
    from chainer.training import triggers
    # The mean loss over ranks improves twice, then worsens: patience 2.
    means = [5.0, 4.0, 3.0, 3.5, 3.6, 3.7, 3.8]
    trig = mnopt.extensions.MultiNodeEarlyStoppingTrigger(
        comm, check_trigger=(1, 'iteration'), patience=2,
        max_trigger=(100, 'iteration'))
    alone = triggers.EarlyStoppingTrigger(
        check_trigger=(1, 'iteration'), patience=2,
        max_trigger=(100, 'iteration'))
    trainer, reference = fake_trainer(), fake_trainer()
    stops, want = [], []
    for m in means:
        step(trainer)
        step(reference)
        # Rank r reports m + (r - mean rank): the mean over ranks is m.
        trainer.observation['main/loss'] = m + comm.rank - (comm.size - 1) / 2
        reference.observation['main/loss'] = m
        stops.append(trig(trainer))
        assert trainer.observation['main/loss'] == pytest.approx(m)
        want.append(alone(reference))
    assert stops == want and True in stops
    assert all(s == stops for s in comm.allgather_obj(stops))


def test_generic_evaluator_aggregates_every_ranks_batches(comm):
    import chainer

    class Accuracy(mnopt.extensions.GenericMultiNodeEvaluator):
        def calc_local(self, x, t):
            return (int((x.argmax(axis=1) == t).sum()), len(t))

        def aggregate(self, results):
            return {'accuracy': sum(r[0] for r in results) /
                    float(sum(r[1] for r in results)),
                    'batches': len(results)}

    # Rank r holds 2 + r examples; example k is right when k is even.
    n = 2 + comm.rank
    x = numpy.zeros((n, 2), numpy.float32)
    t = numpy.zeros(n, numpy.int32)
    x[::2, 0] = 1   # predicted 0 == t
    x[1::2, 1] = 1  # predicted 1 != t
    data = chainer.datasets.TupleDataset(x, t)
    it = chainer.iterators.SerialIterator(data, 2, repeat=False,
                                          shuffle=False)
    seen = []
    ev = Accuracy(comm, it, None, root=comm.size - 1,
                  progress_hook=seen.append)
    result = ev()
    assert len(seen) == -(-n // 2)
    sizes = [2 + r for r in range(comm.size)]
    if comm.rank == comm.size - 1:
        right = sum((s + 1) // 2 for s in sizes)
        assert result == {'accuracy': right / float(sum(sizes)),
                          'batches': sum(-(-s // 2) for s in sizes)}
    else:
        assert result is None
    assert ev() == result   # the iterator is reset each time
