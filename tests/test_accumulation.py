"""Gradient accumulation (``create_multi_node_optimizer(...,
accumulation_steps=K)``, docs/accumulation.md): K micro-steps over
batches of b give the parameters of one step over the K*b batch, in
every mode, on every CPU communicator and wire, with compression and the
tuner; a snapshot taken mid-accumulation resumes bit for bit; bad or
differing values are an error on every rank.

Run serially and under mpiexec -n 2 and -n 3."""

import os

import numpy
import pytest

chainer = pytest.importorskip(
    'chainer', reason='the Chainer layer (the numpy1 and numpy2 stacks run it)')
import chainer.functions as F   # noqa: E402
import chainer.links as L   # noqa: E402

import mnopt   # noqa: E402
from conftest import WORLD, imagenet_example_module   # noqa: E402

pytestmark = pytest.mark.many_ranks

K, BATCH, UPDATES = 3, 4, 4
MODES = {
    'sync': {},
    'double_buffering': {'double_buffering': True},
    'overlap': {'overlap': True},
    'shard_state': {'shard_state': True},
    'stage2': {'shard_state': True, 'overlap': True},
}


class MLP(chainer.Chain):
    def __init__(self):
        super(MLP, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, 16, initialW=_weights(16, 6, 1))
            self.l2 = L.Linear(16, 4, initialW=_weights(4, 16, 2))

    def __call__(self, x, t):
        return F.softmax_cross_entropy(self.l2(F.tanh(self.l1(x))), t)


def _weights(rows, cols, seed):
    return numpy.random.RandomState(seed).normal(
        0, 0.5, (rows, cols)).astype(numpy.float32)


def micro_batch(update, micro, rank):
    """Rank ``rank``'s micro-batch ``micro`` of update ``update``."""
    rng = numpy.random.RandomState(1000 * update + 10 * micro + rank)
    return (rng.normal(0, 1, (BATCH, 6)).astype(numpy.float32),
            rng.randint(0, 4, BATCH).astype(numpy.int32))


def whole_batch(update, rank):
    """The K micro-batches of an update as one batch of K*b."""
    parts = [micro_batch(update, k, rank) for k in range(K)]
    return (numpy.concatenate([p[0] for p in parts]),
            numpy.concatenate([p[1] for p in parts]))


def make(comm, steps, **mode):
    model = MLP()
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(lr=0.1), comm,
        accumulation_steps=steps, **mode)
    return model, opt.setup(model)


def train(comm, steps, updates=UPDATES, **mode):
    """Parameters after ``updates`` updates: K calls of ``steps``=K over
    micro-batches, or one call over the whole batch (``steps``=1)."""
    model, opt = make(comm, steps, **mode)
    for u in range(updates):
        if steps == 1:
            opt.update(model, *whole_batch(u, comm.rank))
        else:
            for k in range(steps):
                opt.update(model, *micro_batch(u, k, comm.rank))
    if mode.get('double_buffering'):
        opt.wait()
    return {n: p.array.copy() for n, p in model.namedparams()}, opt


def snapshot_of(model, opt):
    """The model's and the optimizer's snapshot, as a file holds it (a
    copy: the serializer keeps references)."""
    snapshot = {}
    for prefix, obj in (('model/', model), ('opt/', opt)):
        obj.serialize(chainer.serializers.DictionarySerializer(
            snapshot, prefix))
    return {key: numpy.array(value, copy=True)
            for key, value in snapshot.items()}


def load(snapshot, model, opt, strict=True):
    """``snapshot`` loaded as Chainer's trainer loads: the optimizer,
    then the model."""
    for prefix, obj in (('opt/', opt), ('model/', model)):
        obj.serialize(chainer.serializers.NpzDeserializer(
            snapshot, prefix, strict=strict))


def assert_same_bits(model_a, model_b):
    for (name, a), (_, b) in zip(sorted(model_a.namedparams()),
                                 sorted(model_b.namedparams())):
        assert a.array.tobytes() == b.array.tobytes(), name


def updated_afresh(comm, steps, snapshot):
    """The model after one update over batch 5's micro-batches from
    ``snapshot``'s parameters and state without its partial sums."""
    fresh_model, fresh = make(comm, steps)
    load(snapshot, fresh_model, fresh, strict=False)
    fresh._accumulation.loaded = None
    for k in range(steps):
        fresh.update(fresh_model, *micro_batch(5, k, comm.rank))
    return fresh_model


def assert_close(a, b, rtol=1e-5, atol=1e-6):
    assert sorted(a) == sorted(b)
    for name in a:
        numpy.testing.assert_allclose(a[name], b[name], rtol=rtol,
                                      atol=atol, err_msg=name)


@pytest.mark.parametrize('mode', sorted(MODES))
def test_k_micro_steps_update_as_one_step_over_k_batches(comm_name, mode):
    comm = mnopt.create_communicator(comm_name)
    try:
        accumulated, opt = train(comm, K, **MODES[mode])
        whole, whole_opt = train(comm, 1, **MODES[mode])
        assert_close(accumulated, whole)
        # t counts updates (Horovod's), not micro-steps.
        assert opt.t == whole_opt.t
    finally:
        comm.finalize()


@pytest.mark.parametrize('setting', [
    {'allreduce_grad_dtype': 'float16'}, {'allreduce_grad_dtype': 'bfloat16'},
    {'compression': 'sign'}, {'compression': 'powersgd'},
    {'bucket_bytes': 'auto'}])
def test_wires_compression_and_tuning(setting):
    """float16's divide-before-sum: the sum of K is divided by K before
    it is cast.  Sign and PowerSGD: one averaging per update, so their
    error feedback runs once per K micro-steps, as for the whole batch."""
    name = 'naive' if 'compression' in setting else 'flat'
    rtol = {'float16': 2e-3, 'bfloat16': 2e-2}.get(
        setting.get('allreduce_grad_dtype'), 1e-4)
    results = []
    for steps in (K, 1):
        comm = mnopt.create_communicator(name, **setting)
        try:
            results.append(train(comm, steps)[0])
        finally:
            comm.finalize()
    assert_close(results[0], results[1], rtol=rtol, atol=rtol)


def test_update_without_loss_function_counts_calls():
    """The user's loop computes the gradients (clearing them only before
    an update's first backward); every K-th call averages and updates."""
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, K)
        for u in range(UPDATES):
            model.cleargrads()
            for k in range(K):
                model(*micro_batch(u, k, comm.rank)).backward()
                opt.update()
                # The first update broadcasts; t counts the others.
                assert opt.t == (u if k == K - 1 else max(0, u - 1))
        whole, _ = train(comm, 1)
        assert_close({n: p.array for n, p in model.namedparams()}, whole)
    finally:
        comm.finalize()


@pytest.mark.parametrize('mode', sorted(MODES))
def test_a_snapshot_mid_accumulation_resumes_bit_for_bit(mode):
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, K, **MODES[mode])
        calls = [(u, k) for u in range(UPDATES + 1) for k in range(K)]
        # One micro-step into the fourth update (double buffering's
        # first to have applied a mean, so its state is in the snapshot).
        stop = 3 * K + 1
        for i, (u, k) in enumerate(calls):
            if i == stop:
                snapshot = snapshot_of(model, opt)
            opt.update(model, *micro_batch(u, k, comm.rank))
        resumed_model, resumed = make(comm, K, **MODES[mode])
        load(snapshot, resumed_model, resumed)
        for u, k in calls[stop:]:
            resumed.update(resumed_model, *micro_batch(u, k, comm.rank))
        if MODES[mode].get('double_buffering'):
            opt.wait()
            resumed.wait()
        assert_same_bits(model, resumed_model)
        assert resumed.t == opt.t
    finally:
        comm.finalize()


@pytest.mark.parametrize('steps', [0, -2, 1.5, True, '4', None])
def test_a_bad_value_is_an_error_on_every_rank(steps):
    comm = mnopt.create_communicator('naive')
    try:
        with pytest.raises(ValueError, match='accumulation_steps must be a '
                           'whole number .* got %s' % repr(steps)[:2]):
            make(comm, steps)
    finally:
        comm.finalize()


@pytest.mark.skipif(WORLD.size < 2, reason='ranks that differ')
def test_ranks_with_different_steps_fail_together():
    comm = mnopt.create_communicator('naive')
    try:
        with pytest.raises(ValueError, match='accumulation_steps'):
            make(comm, 2 if comm.rank == 0 else 3)
    finally:
        comm.finalize()


@pytest.mark.skipif(WORLD.size < 2, reason='ranks that differ')
def test_a_mid_accumulation_snapshot_loaded_on_rank_0_alone_fails_together():
    comm = mnopt.create_communicator('naive')
    try:
        model, opt = make(comm, K)
        for i in range(2 * K + 1):   # one micro-step past an update
            opt.update(model, *micro_batch(i // K, i % K, comm.rank))
        snapshot = {}
        opt.serialize(chainer.serializers.DictionarySerializer(snapshot))
        resumed_model, resumed = make(comm, K)
        if comm.rank == 0:
            resumed.serialize(chainer.serializers.NpzDeserializer(snapshot))
        with pytest.raises(RuntimeError, match='middle of a gradient '
                           'accumulation'):
            for k in range(K):
                resumed.update(resumed_model, *micro_batch(1, k, comm.rank))
    finally:
        comm.finalize()


def train_example_model(comm, steps, batch, epochs=2):
    """The ImageNet example's NIN and weight decay under Chainer's Trainer
    and StandardUpdater (one ``update`` per iteration), ``steps``
    iterations per update; dropout off (its masks are drawn per call).
    Returns the parameters and the trainer's iteration count."""
    models = imagenet_example_module('models')
    numpy.random.seed(0)   # the lazily initialised weights (rank 0's win)
    model = models.NIN(n_classes=4)
    rng = numpy.random.RandomState(comm.rank)
    images = rng.uniform(-1, 1, (24, 3, 48, 48)).astype(numpy.float32)
    labels = rng.randint(0, 4, 24).astype(numpy.int32)
    data = chainer.datasets.TupleDataset(images, labels)
    order = chainer.iterators.ShuffleOrderSampler(
        numpy.random.RandomState(7))
    iterator = chainer.iterators.SerialIterator(data, batch,
                                                order_sampler=order)
    optimizer = mnopt.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(lr=0.05, momentum=0.9), comm,
        accumulation_steps=steps)
    optimizer.setup(model)
    optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))
    updater = chainer.training.StandardUpdater(iterator, optimizer)
    trainer = chainer.training.Trainer(updater, (epochs, 'epoch'),
                                       out=os.devnull)
    with chainer.using_config('train', False):
        trainer.run()
    return ({n: p.array.copy() for n, p in model.namedparams()},
            updater.iteration, optimizer.t)


def test_the_trainer_makes_k_iterations_per_update():
    """The example's case (--accumulation-steps 4 against 4 times the
    batch): the same samples, the same epochs and parameters; K times
    the iterations, the same number of updates."""
    comm = mnopt.create_communicator('flat')
    try:
        accumulated, iterations, t = train_example_model(comm, 4, 2)
        whole, whole_iterations, whole_t = train_example_model(comm, 1, 8)
        assert (iterations, t) == (4 * whole_iterations, whole_t)
        assert_close(accumulated, whole, rtol=1e-4, atol=1e-6)
    finally:
        comm.finalize()


@pytest.mark.parametrize('mode', sorted(MODES))
def test_micro_steps_do_not_communicate(mode):
    """Only the K-th call of an update averages (overlap: during its
    backward), whatever the mode."""
    comm = mnopt.create_communicator('flat')
    calls = []
    for name in ('everyone', 'mean_grads_async', 'multi_node_mean_grad',
                 'reduce_scatter_mean', 'reduce_scatter_mean_async',
                 'allgather_params', 'bcast_data'):
        def counted(*args, _original=getattr(comm, name), _name=name,
                    **kwds):
            calls.append(_name)
            return _original(*args, **kwds)
        setattr(comm, name, counted)
    try:
        model, opt = make(comm, K, **MODES[mode])
        for u in range(UPDATES):
            for k in range(K):
                before = len(calls)
                opt.update(model, *micro_batch(u, k, comm.rank))
                assert (len(calls) > before) == (k == K - 1), (u, k, calls)
        if mode in ('overlap', 'stage2'):
            assert opt.overlap_stats['during_backward'] > 0
    finally:
        comm.finalize()


@pytest.mark.parametrize('mode', ['sync', 'double_buffering', 'overlap'])
def test_a_snapshot_before_the_first_applied_update_loads(mode):
    """Within the first K calls nothing is applied yet, so the snapshot
    holds no optimizer state (MomentumSGD's v): it loads, and the run
    goes on as the uninterrupted one (Chainer's strict deserializer
    refused it: KeyError '.../v')."""
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, K, **MODES[mode])
        calls = [(u, k) for u in range(UPDATES) for k in range(K)]
        stop = K + 1   # one micro-step past the broadcast
        for u, k in calls[:stop]:
            opt.update(model, *micro_batch(u, k, comm.rank))
        snapshot = snapshot_of(model, opt)
        for u, k in calls[stop:]:
            opt.update(model, *micro_batch(u, k, comm.rank))
        resumed_model, resumed = make(comm, K, **MODES[mode])
        load(snapshot, resumed_model, resumed)
        for u, k in calls[stop:]:
            resumed.update(resumed_model, *micro_batch(u, k, comm.rank))
        if mode == 'double_buffering':
            opt.wait()
            resumed.wait()
        assert_same_bits(model, resumed_model)
    finally:
        comm.finalize()


@pytest.mark.parametrize('strict', [True, False])
def test_a_snapshot_without_accumulation_loads_with_nothing_accumulated(
        strict):
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, 1)
        for u in range(3):
            opt.update(model, *whole_batch(u, comm.rank))
        snapshot = {}
        opt.serialize(chainer.serializers.DictionarySerializer(snapshot))
        _, resumed = make(comm, K)
        resumed.serialize(chainer.serializers.NpzDeserializer(
            snapshot, strict=strict))
        assert resumed._accumulation.loaded == (0, {})
    finally:
        comm.finalize()


def test_update_without_loss_function_resumes_mid_accumulation():
    """The user's backward comes before the call that restores the
    partial sums: they are added to its gradients, not put in their
    place."""
    comm = mnopt.create_communicator('flat')
    try:
        def run(opt, model, calls):
            for u, k in calls:
                if k == 0:
                    model.cleargrads()
                model(*micro_batch(u, k, comm.rank)).backward()
                opt.update()

        calls = [(u, k) for u in range(UPDATES) for k in range(K)]
        stop = 2 * K + 1
        model, opt = make(comm, K)
        run(opt, model, calls[:stop])
        snapshot = snapshot_of(model, opt)
        run(opt, model, calls[stop:])
        resumed_model, resumed = make(comm, K)
        load(snapshot, resumed_model, resumed)
        # A fresh model's gradients are NaN (Chainer's): the loop starts
        # from cleared ones, its next update() adds the saved sums.
        resumed_model.cleargrads()
        run(resumed, resumed_model, calls[stop:])
        assert_same_bits(model, resumed_model)
    finally:
        comm.finalize()


@pytest.mark.parametrize('steps', [1, 2])
def test_partial_sums_another_k_drops_are_said_once_on_rank_0(steps, caplog):
    """A snapshot written with K=3 two micro-steps in, loaded where K is
    1 (or 2): its partial sums cannot be resumed, and a warning on rank 0
    says what is dropped and what to pass; the next update is over its
    own batches only."""
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, K)
        for k in range(K + 2):   # one update, then two micro-steps
            opt.update(model, *micro_batch(k // K, k % K, comm.rank))
        snapshot = snapshot_of(model, opt)
        resumed_model, resumed = make(comm, steps)
        with caplog.at_level('WARNING', logger='mnopt'):
            load(snapshot, resumed_model, resumed)
            for k in range(steps):
                resumed.update(resumed_model, *micro_batch(5, k, comm.rank))
        said = [r.getMessage() for r in caplog.records
                if 'partial sums' in r.getMessage()]
        if comm.rank == 0:
            assert len(said) == 1, said
            assert 'accumulation_steps=3, 2 micro-steps' in said[0]
            assert 'accumulation_steps=%d' % steps in said[0]
            assert 'pass accumulation_steps=3' in said[0]
        else:
            assert said == []
        # Nothing of the snapshot's micro-steps in the update: it equals
        # one from the same state over the new batches alone.
        assert_same_bits(resumed_model,
                         updated_afresh(comm, steps, snapshot))
    finally:
        comm.finalize()


@pytest.mark.parametrize('other', [1, 3])   # ranks, fewer or more
def test_partial_sums_of_another_number_of_ranks_are_dropped_on_every_rank(
        other, caplog):
    """A snapshot written mid-accumulation by a job of another size: no
    rank of this job holds its own partial sums (at 2 -> 3 rank 2 would
    resume rank 0's, counting its micro-batches twice; at 3 -> 2 rank
    2's would be lost), so every rank drops them, rank 0 says so once,
    and the accumulation starts again: K more calls per update."""
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, K)
        for k in range(K + 2):   # one update, then two micro-steps
            opt.update(model, *micro_batch(k // K, k % K, comm.rank))
        snapshot = snapshot_of(model, opt)
        written_by = other if other != comm.size else other + 1
        snapshot['opt/mnopt_accumulation/size'] = numpy.int64(written_by)
        resumed_model, resumed = make(comm, K)
        with caplog.at_level('WARNING', logger='mnopt'):
            load(snapshot, resumed_model, resumed)
            t = resumed.t
            for k in range(K):
                resumed.update(resumed_model, *micro_batch(5, k, comm.rank))
                assert resumed.t == t + (k == K - 1)   # K calls, then one
        said = [r.getMessage() for r in caplog.records
                if 'micro-steps' in r.getMessage()]
        if comm.rank == 0:
            assert len(said) == 1, said
            assert 'written by %d ranks' % written_by in said[0]
            assert 'dropped on every rank' in said[0]
        else:
            assert said == []
        assert_same_bits(resumed_model,
                         updated_afresh(comm, K, snapshot))
    finally:
        comm.finalize()
