"""The multi-node and synchronized iterators: Chainer iterators that give
every rank the same batches, serialize as ChainerMN's, and fail on every
rank together.  Serially and under mpiexec -n 2 / -n 3."""

import os
import shutil
import tempfile

import numpy
import pytest

from conftest import naive_comm as comm  # NOQA: the comm fixture
from conftest import chainer, needs_chainer

# Also under mpiexec -n 3: a dataset scatters unevenly over 3 ranks.
pytestmark = [needs_chainer, pytest.mark.many_ranks]

import mnopt  # NOQA


def serial(data, batch_size=3, **kw):
    return chainer.iterators.SerialIterator(data, batch_size, **kw)


def data(n=10):
    return numpy.arange(n, dtype=numpy.float32)


def test_public_names_and_chainermn_module_paths():
    from mnopt.iterators.multi_node_iterator import create_multi_node_iterator
    from mnopt.iterators.synchronized_iterator import \
        create_synchronized_iterator
    assert mnopt.iterators.create_multi_node_iterator \
        is create_multi_node_iterator
    assert mnopt.iterators.create_synchronized_iterator \
        is create_synchronized_iterator


@pytest.mark.parametrize('rank_master', ['first', 'last'])
def test_every_rank_gets_the_masters_batches_and_counters(comm, rank_master):
    master = 0 if rank_master == 'first' else comm.size - 1
    # Only the master's iterator is read: the others pass None.
    it = mnopt.iterators.create_multi_node_iterator(
        serial(data(), shuffle=True) if comm.rank == master else None,
        comm, rank_master=master)
    assert isinstance(it, chainer.dataset.Iterator)
    for _ in range(8):
        batch = it.next()
        seen = comm.allgather_obj((batch, it.epoch, it.is_new_epoch,
                                   it.epoch_detail, it.previous_epoch_detail,
                                   it.current_position))
        assert all(s == seen[0] for s in seen)
    assert it.epoch == 2 and it.batch_size == 3


def test_the_end_of_a_non_repeating_iterator_stops_every_rank(comm):
    it = mnopt.iterators.create_multi_node_iterator(
        serial(data(7), repeat=False, shuffle=False), comm)
    assert [len(b) for b in it] == [3, 3, 1]
    it.reset()
    assert it.epoch == 0 and len(list(it)) == 3


def test_a_batch_that_is_not_arrays_is_a_type_error_on_every_rank(comm):
    it = mnopt.iterators.create_multi_node_iterator(
        serial(['text'] * 4), comm)
    with pytest.raises(TypeError, match='ndarray or tuple'):
        it.next()
    it = mnopt.iterators.create_multi_node_iterator(
        serial([{'x': 1}] * 4), comm)
    with pytest.raises(TypeError, match='not dict'):
        it.next()


def test_tuples_of_arrays_pass(comm):
    x, t = data(6), numpy.arange(6, dtype=numpy.int32)
    it = mnopt.iterators.create_multi_node_iterator(
        serial(chainer.datasets.TupleDataset(x, t), shuffle=False), comm)
    assert it.next() == [(x[i], t[i]) for i in range(3)]


def test_a_dataset_error_on_the_master_is_raised_on_every_rank(comm):
    class Broken(chainer.dataset.DatasetMixin):
        def __len__(self):
            return 4

        def get_example(self, i):
            raise ValueError('example %d is unreadable' % i)
    it = mnopt.iterators.create_multi_node_iterator(serial(Broken()), comm)
    with pytest.raises(ValueError, match='unreadable'):
        it.next()


def test_ranks_that_disagree_on_the_master_fail_together(comm):
    if comm.size == 1:
        with pytest.raises(ValueError, match='not a rank'):
            mnopt.iterators.create_multi_node_iterator(serial(data()), comm,
                                                       rank_master=1)
        return
    with pytest.raises(ValueError, match='ranks disagree on rank_master'):
        mnopt.iterators.create_multi_node_iterator(
            serial(data()), comm, rank_master=comm.rank % 2)


def test_chainer_updaters_and_evaluators_take_it(comm):
    L = chainer.links
    x = numpy.random.RandomState(0).standard_normal((8, 3)).astype('f')
    t = (x[:, 0] > 0).astype(numpy.int32)
    model = L.Classifier(L.Linear(3, 2))
    opt = chainer.optimizers.SGD()
    opt.setup(model)
    it = mnopt.iterators.create_multi_node_iterator(
        serial(chainer.datasets.TupleDataset(x, t), 4), comm)
    updater = chainer.training.StandardUpdater(it, opt)
    updater.update()
    assert updater.iteration == 1 and updater.epoch_detail == 0.5
    val = mnopt.iterators.create_multi_node_iterator(
        serial(chainer.datasets.TupleDataset(x, t), 4, repeat=False), comm)
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    with reporter:
        result = chainer.training.extensions.Evaluator(val, model).evaluate()
    assert 'main/loss' in result


def save_to_dict(it):
    serializer = chainer.serializers.DictionarySerializer()
    it.serialize(serializer)
    return serializer.target


def test_every_rank_writes_the_masters_iterator_state(comm):
    it = mnopt.iterators.create_multi_node_iterator(
        serial(data(9), shuffle=True), comm)
    batches = [it.next(), it.next()]
    state = save_to_dict(it)
    assert sorted(state) == ['current_position', 'epoch', 'is_new_epoch',
                             'order', 'previous_epoch_detail']
    everyone = comm.allgather_obj(state)
    for key in state:
        assert all(numpy.array_equal(s[key], state[key]) for s in everyone)
    # A plain iterator loaded from any rank's state goes on where the
    # master's stands.
    plain = serial(data(9), shuffle=True)
    plain.serialize(chainer.serializers.NpzDeserializer(state))
    rest = plain.next()
    assert sorted(x for b in batches + [rest] for x in b) == \
        list(range(9))  # one epoch: 3 batches of 3
    assert rest == it.next()


def test_a_resume_from_each_ranks_file_continues_the_masters_order(comm):
    out = comm.bcast_obj(tempfile.mkdtemp(prefix='mnopt-it-')
                         if comm.rank == 0 else None)
    try:
        it = mnopt.iterators.create_multi_node_iterator(
            serial(data(12), shuffle=True), comm)
        it.next(), it.next()
        path = os.path.join(out, 'it.%d.npz' % comm.rank)
        chainer.serializers.save_npz(path, it)
        # The rest of the epoch (the next one's order is drawn afresh).
        expected = [it.next(), it.next()]
        again = mnopt.iterators.create_multi_node_iterator(
            serial(data(12), shuffle=True), comm)
        chainer.serializers.load_npz(path, again)
        assert again.epoch_detail == pytest.approx(0.5)
        assert again.current_position == 6
        assert [again.next(), again.next()] == expected
        assert again.is_new_epoch and again.epoch == 1
    finally:
        comm.allgather_obj(None)
        if comm.rank == 0:
            shutil.rmtree(out, ignore_errors=True)


def test_synchronized_iterator_draws_one_order_on_every_rank(comm):
    it = mnopt.iterators.create_synchronized_iterator(
        serial(data(), shuffle=True), comm)
    assert isinstance(it, chainer.dataset.Iterator)
    batches = [it.next() for _ in range(7)]
    everyone = comm.allgather_obj(batches)
    assert all(b == everyone[0] for b in everyone)
    assert it.epoch == 2
    it.batch_size = 5   # sets the wrapped iterator's, as ChainerMN's
    assert len(it.next()) == 5 and it.actual_iterator.batch_size == 5


def test_synchronized_iterator_needs_an_order_sampler_on_every_rank(comm):
    class NoSampler(chainer.dataset.Iterator):
        dataset = data()
    it = NoSampler() if comm.rank == comm.size - 1 else serial(data())
    with pytest.raises(ValueError, match='must have order_sampler'):
        mnopt.iterators.create_synchronized_iterator(it, comm)


def test_synchronized_iterator_datasets_must_be_as_long(comm):
    if comm.size == 1:
        pytest.skip('needs two ranks')
    with pytest.raises(ValueError, match='ranks disagree on the length'):
        mnopt.iterators.create_synchronized_iterator(
            serial(data(10 + comm.rank)), comm)
