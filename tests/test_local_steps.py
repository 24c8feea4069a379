"""Local steps with an outer optimizer (``create_multi_node_optimizer(
..., local_steps=H)``, docs/local_sgd.md): H=1 with an outer SGD of lr 1
is synchronous averaging; ranks differ between syncs and hold the same
bits at each; the outer Nesterov step is PyTorch's, against a
one-process reference built from every rank's local parameters;
fragments sync on their schedule; a snapshot mid-H or with a fragment in
flight resumes bit for bit; refusals and differing settings are an error
on every rank.

Run serially and under mpiexec -n 2 and -n 3."""

import warnings

import numpy
import pytest

chainer = pytest.importorskip(
    'chainer', reason='the Chainer layer (the numpy1 and numpy2 stacks run it)')
import chainer.functions as F   # noqa: E402
import chainer.links as L   # noqa: E402

import mnopt   # noqa: E402
from mnopt.timeline import recorder as timelines  # noqa: E402
from mnopt.optimizers.fragments import split_by_bytes, starting   # noqa
from conftest import WORLD, imagenet_example_module   # noqa: E402

pytestmark = pytest.mark.many_ranks

BATCH = 4


class MLP(chainer.Chain):
    def __init__(self):
        super(MLP, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, 8, initialW=_weights(8, 6, 1))
            self.l2 = L.Linear(8, 8, initialW=_weights(8, 8, 2))

    def __call__(self, x, t):
        return F.softmax_cross_entropy(self.l2(F.tanh(self.l1(x))), t)


class Linear(chainer.Chain):
    """A loss linear in the parameters, ``sum(W * x)``: its gradient is
    ``x``, whatever the parameters.  With dyadic data whose mean over the
    ranks is dyadic too, and a power-of-two lr, every value the optimizers
    compute is exact (no rounding anywhere)."""

    def __init__(self):
        super(Linear, self).__init__()
        with self.init_scope():
            self.W = chainer.Parameter(numpy.arange(
                12, dtype=numpy.float32).reshape(3, 4) / 8)

    def __call__(self, x):
        return F.sum(self.W * x)


def _weights(rows, cols, seed):
    return numpy.random.RandomState(seed).normal(
        0, 0.5, (rows, cols)).astype(numpy.float32)


def batch(step, rank):
    rng = numpy.random.RandomState(1000 * step + rank)
    return (rng.normal(0, 1, (BATCH, 6)).astype(numpy.float32),
            rng.randint(0, 8, BATCH).astype(numpy.int32))


def dyadic_batch(step, rank, size):
    """Quarters, spread about their mean over the ranks by whole
    multiples of a quarter that sum to zero: the mean is a quarter too."""
    rng = numpy.random.RandomState(step)
    base = rng.randint(-8, 9, (3, 4)).astype(numpy.float32) / 4
    spread = rng.randint(-2, 3, (3, 4)).astype(numpy.float32) / 4
    return (base + (2 * rank - (size - 1)) * spread,)


def make(comm, inner=None, model=None, **kwargs):
    model = MLP() if model is None else model
    opt = mnopt.create_multi_node_optimizer(
        inner or chainer.optimizers.SGD(lr=0.1), comm, **kwargs)
    return model, opt.setup(model)


def params_of(model):
    return {n: p.array.copy() for n, p in sorted(model.namedparams())}


def same_on_every_rank(comm, arrays):
    """Whether every rank holds ``arrays`` ({name: array}) bit for bit."""
    mine = {n: a.tobytes() for n, a in arrays.items()}
    return all(other == mine for other in comm.everyone(mine, 'test'))


def snapshot_of(model, opt):
    snapshot = {}
    for prefix, obj in (('model/', model), ('opt/', opt)):
        obj.serialize(chainer.serializers.DictionarySerializer(
            snapshot, prefix))
    return {key: numpy.array(value, copy=True)
            for key, value in snapshot.items()}


def load(snapshot, model, opt):
    """As Chainer's trainer loads: the optimizer, then the model."""
    for prefix, obj in (('opt/', opt), ('model/', model)):
        obj.serialize(chainer.serializers.NpzDeserializer(snapshot, prefix))


# ------------------------------------------------------------- H=1 is sync
@pytest.mark.parametrize('wire', [None, 'float16', 'bfloat16'])
def test_h1_with_outer_sgd_lr1_is_synchronous_averaging_bit_for_bit(
        comm_name, wire):
    """Exact arithmetic (a loss linear in the parameters, dyadic data
    with a dyadic mean, a power-of-two lr): no step rounds, so the outer
    SGD's synced - mean(synced - local_i) is synchronous averaging's
    param - lr*mean(g_i) bit for bit, on every communicator and wire."""
    comm = mnopt.create_communicator(comm_name, allreduce_grad_dtype=wire)
    try:
        results = []
        for local in (False, True):
            kwargs = {'local_steps': 1, 'outer_optimizer':
                      chainer.optimizers.SGD(lr=1.0)} if local else {}
            model, opt = make(comm, chainer.optimizers.SGD(lr=0.25),
                              model=Linear(), **kwargs)
            for step in range(5):
                opt.update(model, *dyadic_batch(step, comm.rank, comm.size))
            results.append(params_of(model))
        assert results[0]['/W'].tobytes() == results[1]['/W'].tobytes()
        assert same_on_every_rank(comm, results[1])
    finally:
        comm.finalize()


def test_h1_with_outer_sgd_lr1_is_synchronous_within_float32_rounding():
    """On a real model, synced - (synced - lr*g) is lr*g only up to
    float32's rounding of the inner step: the two runs agree to it."""
    comm = mnopt.create_communicator('flat')
    try:
        results = []
        for local in (False, True):
            kwargs = {'local_steps': 1, 'outer_optimizer':
                      chainer.optimizers.SGD(lr=1.0)} if local else {}
            model, opt = make(comm, **kwargs)
            for step in range(6):
                opt.update(model, *batch(step, comm.rank))
            results.append(params_of(model))
        for name in results[0]:
            numpy.testing.assert_allclose(results[1][name], results[0][name],
                                          rtol=1e-5, atol=1e-6)
        moved = params_of(make(comm)[0])
        assert any((moved[n] != results[1][n]).any() for n in moved)
    finally:
        comm.finalize()


# ----------------------------------------------------------- syncs and not
def test_ranks_differ_between_syncs_and_agree_at_each():
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, local_steps=3)
        opt.update(model, *batch(0, comm.rank))   # the broadcast
        for step in range(1, 10):
            opt.update(model, *batch(step, comm.rank))
            agree = same_on_every_rank(comm, params_of(model))
            if step % 3 == 0 or comm.size == 1:
                assert agree, step
            else:
                assert not agree, step
    finally:
        comm.finalize()


def pytorch_nesterov(param, buf, grad, lr, momentum):
    """PyTorch's SGD(nesterov=True) step, in place (torch/optim/sgd.py:
    buf = momentum*buf + grad; param -= lr*(grad + momentum*buf))."""
    buf *= momentum
    buf += grad
    param -= lr * (grad + momentum * buf)


def test_outer_nesterov_is_pytorchs_nesterov_sgd_bit_for_bit():
    link = chainer.Link()
    with link.init_scope():
        link.p = chainer.Parameter(_weights(3, 5, 3))
    param, buf = link.p.array.copy(), numpy.zeros_like(link.p.array)
    opt = mnopt.OuterNesterov(lr=0.7, momentum=0.9)
    opt.setup(link)
    for step in range(4):
        grad = _weights(3, 5, 10 + step)
        link.p.grad = grad.copy()
        opt.update()
        pytorch_nesterov(param, buf, grad, 0.7, 0.9)
        assert link.p.array.tobytes() == param.tobytes()


def test_the_outer_step_matches_a_one_process_reference():
    """Every rank replays every rank's inner updates (MomentumSGD on its
    own batches) in one process, averages the pseudo-gradients with NumPy
    and steps PyTorch's Nesterov (DiLoCo's lr 0.7, momentum 0.9): the
    model at each sync is that, to float32's rounding of the mean."""
    H, steps = 2, 7
    comm = mnopt.create_communicator('hierarchical')
    try:
        model, opt = make(comm, chainer.optimizers.MomentumSGD(lr=0.1),
                          local_steps=H, outer_optimizer=mnopt.OuterNesterov(
                              lr=0.7, momentum=0.9))
        replicas = []
        for rank in range(comm.size):
            replica = MLP()
            inner = chainer.optimizers.MomentumSGD(lr=0.1)
            replicas.append((replica, inner.setup(replica)))
        synced = params_of(replicas[0][0])
        bufs = {n: numpy.zeros_like(a) for n, a in synced.items()}
        opt.update(model, *batch(0, comm.rank))   # the broadcast
        for step in range(1, steps + 1):
            opt.update(model, *batch(step, comm.rank))
            for rank, (replica, inner) in enumerate(replicas):
                inner.update(replica, *batch(step, rank))
            if step % H:
                continue
            locals_ = [params_of(r) for r, _ in replicas]
            for name in synced:
                mean = numpy.mean([synced[name] - p[name] for p in locals_],
                                  axis=0)
                pytorch_nesterov(synced[name], bufs[name], mean, 0.7, 0.9)
            for replica, _ in replicas:
                for name, param in replica.namedparams():
                    param.array[...] = synced[name]
            got = params_of(model)
            for name in synced:
                numpy.testing.assert_allclose(got[name], synced[name],
                                              rtol=1e-5, atol=1e-6)
    finally:
        comm.finalize()


# ---------------------------------------------------------------- fragments
def test_fragments_are_contiguous_and_about_equal_in_bytes():
    named = [('a', 100), ('b', 100), ('c', 10), ('d', 90), ('e', 100)]
    assert split_by_bytes(named, 2) == [['a', 'b'], ['c', 'd', 'e']]
    assert split_by_bytes(named, 1) == [['a', 'b', 'c', 'd', 'e']]
    assert starting(4, 4, 2) == [0] and starting(2, 4, 2) == [1]
    assert starting(3, 4, 2) == [] and starting(8, 8, 4) == [0]


@pytest.mark.parametrize('delay', [0, 1, 2])
def test_fragments_sync_on_their_schedule(delay):
    """H=4, F=2: fragment f lands (the same on every rank) after local
    steps s with (s - delay - 2f) % 4 == 0, and only then."""
    H, frags = 4, 2
    comm = mnopt.create_communicator('naive')
    try:
        model, opt = make(comm, local_steps=H, fragments=frags,
                          fragment_sync_delay=delay)
        opt.update(model, *batch(0, comm.rank))
        for step in range(1, 13):
            opt.update(model, *batch(step, comm.rank))
            params = params_of(model)
            for f in range(frags):
                names = opt._synced.names(f)
                assert names
                landed = step - delay >= 1 and \
                    (step - delay - f * H // frags) % H == 0
                agree = same_on_every_rank(
                    comm, {n: params[n] for n in names})
                assert agree == (landed or comm.size == 1), (step, f)
    finally:
        comm.finalize()


def test_each_sync_sends_one_fragment():
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, local_steps=4, fragments=2)
        sent = []
        mean_grads = comm.mean_grads

        def recorded(named, *args, **kwargs):
            named = list(named)
            sent.append(sorted(n for n, _ in named))
            return mean_grads(named, *args, **kwargs)
        comm.mean_grads = recorded
        for step in range(9):
            opt.update(model, *batch(step, comm.rank))
        assert sent == [opt._synced.names(1), opt._synced.names(0)] * 2
        assert set(sent[0]).isdisjoint(sent[1])
    finally:
        comm.finalize()


# ---------------------------------------------------------------- snapshots
@pytest.mark.parametrize('at, settings', [
    (3, {'local_steps': 4}),                                  # mid-H
    (2, {'local_steps': 4, 'fragments': 2,
         'fragment_sync_delay': 1}),                          # in flight
    (4, {'local_steps': 4, 'fragments': 2,
         'fragment_sync_delay': 2}),                          # in flight
    (1, {'local_steps': 2, 'sync_warmup_steps': 2}),          # warm-up
    (5, {'local_steps': 2, 'sync_warmup_steps': 2,
         'outer_optimizer': chainer.optimizers.Adam(alpha=0.01)}),
])
def test_a_snapshot_resumes_bit_for_bit(at, settings):
    comm = mnopt.create_communicator('flat')
    try:
        inner = chainer.optimizers.MomentumSGD(lr=0.1)
        model, opt = make(comm, inner, **settings)
        for step in range(12):
            opt.update(model, *batch(step, comm.rank))
            if step == at:
                snapshot = snapshot_of(model, opt)
        resumed_model, resumed = make(
            comm, chainer.optimizers.MomentumSGD(lr=0.1), **settings)
        load(snapshot, resumed_model, resumed)
        for step in range(at + 1, 12):
            resumed.update(resumed_model, *batch(step, comm.rank))
        final, again = params_of(model), params_of(resumed_model)
        assert all(final[n].tobytes() == again[n].tobytes() for n in final)
        assert resumed.t == opt.t
    finally:
        comm.finalize()


def test_a_snapshot_of_other_settings_is_refused_clearly():
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, local_steps=4)
        for step in range(3):
            opt.update(model, *batch(step, comm.rank))
        snapshot = snapshot_of(model, opt)
        other_model, other = make(comm, local_steps=8)
        with pytest.raises(ValueError, match='written with local_steps=4'):
            load(snapshot, other_model, other)
    finally:
        comm.finalize()


@pytest.mark.parametrize('other', [dict(), dict(double_buffering=True),
                                   dict(shard_state=True)])
def test_a_snapshot_loaded_by_a_synchronous_optimizer_is_refused(other):
    # Between syncs each rank's file holds its own parameters: resuming
    # them synchronously would start every rank from different weights.
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, local_steps=4, fragments=2,
                          fragment_sync_delay=1, sync_warmup_steps=1,
                          outer_optimizer=chainer.optimizers.SGD(lr=1.0))
        for step in range(3):
            opt.update(model, *batch(step, comm.rank))
        snapshot = snapshot_of(model, opt)
        other_model, synchronous = make(comm, **other)
        # Every setting it recorded, written as the advice's keywords.
        said = (r'local_steps=4, fragments=2, fragment_sync_delay=1, '
                r'sync_warmup_steps=1, outer_optimizer=chainer\.optimizers'
                r'\.sgd\.SGD')
        with pytest.raises(ValueError, match='written with %s:.*'
                           r'create_multi_node_optimizer\(\.\.\., %s\(\.\.\.'
                           r'\)\)' % (said, said)):
            load(snapshot, other_model, synchronous)
        # The advice followed: it loads.
        advised_model, advised = make(
            comm, local_steps=4, fragments=2, fragment_sync_delay=1,
            sync_warmup_steps=1, outer_optimizer=chainer.optimizers.SGD())
        load(snapshot, advised_model, advised)
    finally:
        comm.finalize()


def test_a_resume_with_other_outer_hyperparameters_says_so():
    # The default outer momentum changed (0.9 to 0.5): a run resumed with
    # defaults would go on with another momentum than it trained with.
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, local_steps=2, outer_optimizer=mnopt.
                          OuterNesterov(lr=0.7, momentum=0.9))
        for step in range(4):
            opt.update(model, *batch(step, comm.rank))
        snapshot = snapshot_of(model, opt)
        same_model, same = make(comm, local_steps=2, outer_optimizer=mnopt.
                                OuterNesterov(lr=0.7, momentum=0.9))
        with warnings.catch_warnings():
            warnings.simplefilter('error')
            load(snapshot, same_model, same)
        other_model, other = make(comm, local_steps=2)
        with pytest.warns(UserWarning, match=r"outer optimizer at lr=0\.7, "
                          r"momentum=0\.9; this one has lr=0\.7, "
                          r"momentum=0\.5"):
            load(snapshot, other_model, other)
    finally:
        comm.finalize()


@pytest.mark.parametrize('saved, current, match', [
    (dict(), dict(outer_optimizer=chainer.optimizers.Adam()),
     r'outer_optimizer=mnopt\.optimizers\.outer_nesterov\.OuterNesterov'
     r'.*this optimizer has .*Adam'),
    (dict(fragments=2, fragment_sync_delay=1), dict(fragments=2),
     'fragment_sync_delay=1.*this optimizer has .*fragment_sync_delay=0'),
])
def test_a_snapshot_of_another_outer_optimizer_or_delay_is_refused(
        saved, current, match):
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, local_steps=4, **saved)
        for step in range(6):
            opt.update(model, *batch(step, comm.rank))
        snapshot = snapshot_of(model, opt)
        other_model, other = make(comm, local_steps=4, **current)
        with pytest.raises(ValueError, match=match):
            load(snapshot, other_model, other)
    finally:
        comm.finalize()


@pytest.mark.skipif(WORLD.size < 2, reason='ranks that differ')
def test_a_snapshot_loaded_on_rank_0_alone_gives_every_rank_its_state():
    comm = mnopt.create_communicator('naive')
    try:
        model, opt = make(comm, local_steps=4)
        for step in range(6):
            opt.update(model, *batch(step, comm.rank))
        snapshot = snapshot_of(model, opt)
        resumed_model, resumed = make(comm, local_steps=4)
        if comm.rank == 0:
            load(snapshot, resumed_model, resumed)
        resumed.update(resumed_model, *batch(6, comm.rank))  # agrees
        assert same_on_every_rank(comm, params_of(resumed_model))
        for step in range(7, 10):
            resumed.update(resumed_model, *batch(step, comm.rank))
        # Rank 0's count: local step 8 (update 8) is a sync.
        assert same_on_every_rank(comm, params_of(resumed_model))
    finally:
        comm.finalize()


# ---------------------------------------------------------------- evaluator
def test_the_synced_parameters_swap_in_for_evaluation():
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, local_steps=4)
        for step in range(7):
            opt.update(model, *batch(step, comm.rank))
        local = params_of(model)
        with opt.using_synced_parameters():
            inside = params_of(model)
        assert same_on_every_rank(comm, inside)
        after = params_of(model)
        assert all(local[n].tobytes() == after[n].tobytes() for n in local)
        if comm.size > 1:
            assert any((inside[n] != local[n]).any() for n in local)
    finally:
        comm.finalize()


def test_the_multi_node_evaluator_sees_the_synced_parameters():
    """docs/local_sgd.md's SyncedEvaluator: what every rank evaluates
    is the synced parameters, whatever its local ones."""
    comm = mnopt.create_communicator('naive')
    try:
        model, opt = make(comm, local_steps=4)
        for step in range(7):
            opt.update(model, *batch(step, comm.rank))

        class Probe(chainer.training.extensions.Evaluator):
            def evaluate(self):
                return {'w': float(model.l1.W.array.astype(
                    numpy.float64).sum())}

        class SyncedEvaluator(Probe):
            def evaluate(self):
                with opt.using_synced_parameters():
                    return super(SyncedEvaluator, self).evaluate()

        evaluator = mnopt.create_multi_node_evaluator(
            SyncedEvaluator(chainer.iterators.SerialIterator(
                [0], 1, repeat=False), model),
            comm)
        with opt.using_synced_parameters():
            synced = float(model.l1.W.array.astype(numpy.float64).sum())
        assert evaluator.evaluate()['w'] == pytest.approx(synced, abs=1e-9)
    finally:
        comm.finalize()


def test_every_communicator_and_wire_syncs_and_resumes(any_comm):
    settings = {'local_steps': 4, 'fragments': 2, 'fragment_sync_delay': 1}
    model, opt = make(any_comm, chainer.optimizers.MomentumSGD(lr=0.1),
                      **settings)
    for step in range(11):
        opt.update(model, *batch(step, any_comm.rank))
        if step == 6:
            snapshot = snapshot_of(model, opt)
    opt.wait()
    with opt.using_synced_parameters():
        synced = params_of(model)
    assert same_on_every_rank(any_comm, synced)
    resumed_model, resumed = make(
        any_comm, chainer.optimizers.MomentumSGD(lr=0.1), **settings)
    load(snapshot, resumed_model, resumed)
    for step in range(7, 11):
        resumed.update(resumed_model, *batch(step, any_comm.rank))
    again = params_of(resumed_model)
    assert all(again[n].tobytes() == v.tobytes()
               for n, v in params_of(model).items())


@pytest.mark.parametrize('wire', ['float16', 'bfloat16'])
def test_a_16_bit_wire_carries_the_pseudo_gradients(wire):
    """Within the wire's rounding of the float32 run, and not equal to
    it: the pseudo-gradients did travel in 16 bits."""
    results = []
    for dtype in (None, wire):
        comm = mnopt.create_communicator('flat', allreduce_grad_dtype=dtype)
        try:
            model, opt = make(comm, local_steps=2)
            for step in range(7):
                opt.update(model, *batch(step, comm.rank))
            results.append(params_of(model))
        finally:
            comm.finalize()
    for name in results[0]:
        numpy.testing.assert_allclose(results[1][name], results[0][name],
                                      rtol=0, atol=2e-2)
    if WORLD.size > 1:
        assert any((results[0][n] != results[1][n]).any()
                   for n in results[0])


def test_the_timeline_shows_each_sync_with_its_bytes(tmp_path):
    path = str(tmp_path / 'trace.json')
    comm = mnopt.create_communicator('flat', timeline=path)
    try:
        model, opt = make(comm, local_steps=4, fragments=2)
        for step in range(9):   # syncs after local steps 2, 4, 6, 8
            opt.update(model, *batch(step, comm.rank))
        fragments = [opt._synced.names(f) for f in (1, 0)] * 2
        nbytes = [sum(4 * p.array.size for n, p in model.namedparams()
                      if n in names) for names in fragments]
    finally:
        comm.finalize()
    events = timelines.load(timelines.trace_path(path, WORLD.rank))
    wires = [e for e in events if e.get('name') == 'wire'
             and e.get('ph') == 'X']
    by_seq = {}
    for e in wires:
        by_seq.setdefault(e['args']['seq'], []).append(e)
    if comm.size > 1:   # one rank sends nothing
        assert len(by_seq) == 4   # one averaging per sync, none between
        sent = [sum(e['args']['bytes'] for e in by_seq[k])
                for k in sorted(by_seq)]
        assert all(s > 0 for s in sent)
        # Each sync carries its fragment: the bigger one more bytes.
        assert (sent[0] > sent[1]) == (nbytes[0] > nbytes[1])


def test_accumulation_counts_inner_updates():
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, local_steps=2, accumulation_steps=2)
        for step in range(10):   # 5 updates: broadcast, then 4 local
            opt.update(model, *batch(step, comm.rank))
        assert opt.t == 4
        assert same_on_every_rank(comm, params_of(model))
    finally:
        comm.finalize()


# ----------------------------------------------------------------- refusals
@pytest.mark.parametrize('kwargs, match', [
    ({'local_steps': 2, 'double_buffering': True}, 'double_buffering=True'),
    ({'local_steps': 2, 'overlap': True}, 'overlap=True'),
    ({'local_steps': 2, 'shard_state': True}, 'shard_state=True'),
    ({'local_steps': 0}, 'local_steps must be a whole number'),
    ({'local_steps': True}, 'local_steps must be a whole number'),
    ({'local_steps': 4, 'fragments': 3}, 'fragments must be a whole number'),
    ({'local_steps': 4, 'fragments': 2, 'fragment_sync_delay': 3},
     'fragment_sync_delay must be'),
    ({'local_steps': 4, 'sync_warmup_steps': -1}, 'sync_warmup_steps must'),
    ({'fragments': 2}, 'only apply with local_steps'),
    ({'local_steps': 2, 'outer_optimizer': chainer.optimizers.SGD},
     'outer_optimizer takes a Chainer optimizer instance'),
])
def test_a_refused_setting_is_an_error_on_every_rank(kwargs, match):
    comm = mnopt.create_communicator('naive')
    try:
        with pytest.raises((ValueError, TypeError), match=match):
            make(comm, **kwargs)
    finally:
        comm.finalize()


def test_a_tuning_with_more_fragments_than_it_waits_is_refused():
    """The tuning times one gradient set and gives it up after
    REKEY_AFTER averagings of others: with more fragments it would never
    end."""
    from mnopt.averaging.tuning import REKEY_AFTER
    comm = mnopt.create_communicator('flat', bucket_bytes='auto')
    try:
        fragments = REKEY_AFTER + 1
        with pytest.raises(ValueError, match="fragments=%d.*'auto'"
                           % fragments):
            make(comm, local_steps=fragments, fragments=fragments)
        make(comm, local_steps=REKEY_AFTER, fragments=REKEY_AFTER)
    finally:
        comm.finalize()


# --------------------------------------------- compression and the tuner
def compressed(kind):
    """A communicator compressing with ``kind``, error feedback on."""
    if kind == 'sign':
        return mnopt.create_communicator('flat', compression='sign',
                                         error_feedback=True)
    return mnopt.create_communicator('flat', compression=kind)


def compression_keys(comm):
    """The names of each gradient set whose compression state the
    communicator holds: PowerSGD's states, or the sign codecs'
    residuals (both groups)."""
    averaging = comm.averaging
    if averaging.low_rank is not None:
        return sorted(names for _, names in averaging.low_rank.states)
    return sorted(names for group in averaging.groups()
                  for names in group.sign_residuals())


@pytest.mark.parametrize('kind', ['sign', 'powersgd', 'auto'])
@pytest.mark.parametrize('delay', [0, 1])
def test_compression_averages_each_fragments_pseudo_gradients(kind, delay):
    """Each fragment's pseudo-gradients are compressed, with state of
    their own; every rank holds the same synced parameters, and they
    differ from an uncompressed run's (where a compression moves
    anything: one rank's PowerSGD mean is exact)."""
    settings = {'local_steps': 4, 'fragments': 2,
                'fragment_sync_delay': delay}
    results = []
    for comm in (mnopt.create_communicator('flat'), compressed(kind)):
        try:
            model, opt = make(comm, **settings)
            for step in range(13):
                opt.update(model, *batch(step, comm.rank))
            opt.wait()
            with opt.using_synced_parameters():
                synced = params_of(model)
            assert same_on_every_rank(comm, synced)
            results.append(synced)
            if comm.compression is not None:
                fragments = sorted(tuple(opt._synced.names(f))
                                   for f in (0, 1))
                assert compression_keys(comm) == fragments
        finally:
            comm.finalize()
    if kind == 'sign' or WORLD.size > 1:
        assert any((results[0][n] != results[1][n]).any()
                   for n in results[0])


@pytest.mark.parametrize('kind', ['sign', 'powersgd'])
@pytest.mark.parametrize('at, settings', [
    (6, {'local_steps': 4}),
    (6, {'local_steps': 4, 'fragments': 2, 'fragment_sync_delay': 1}),
    (4, {'local_steps': 4, 'fragments': 2, 'fragment_sync_delay': 2}),
])
def test_a_snapshot_keeps_the_compression_state_bit_for_bit(
        kind, at, settings):
    """Each rank's snapshot holds its error feedback (and PowerSGD's warm
    factors): a run resumed on a new communicator ends bit for bit as
    the uninterrupted one."""
    finals = []
    comm = compressed(kind)
    try:
        model, opt = make(comm, chainer.optimizers.MomentumSGD(lr=0.1),
                          **settings)
        for step in range(14):
            opt.update(model, *batch(step, comm.rank))
            if step == at:
                snapshot = snapshot_of(model, opt)
        finals.append(params_of(model))
    finally:
        comm.finalize()
    assert any(k.endswith('residual0') or '/residuals/' in k or
               'residual' in k for k in snapshot)
    comm = compressed(kind)
    try:
        model, opt = make(comm, chainer.optimizers.MomentumSGD(lr=0.1),
                          **settings)
        load(snapshot, model, opt)
        for step in range(at + 1, 14):
            opt.update(model, *batch(step, comm.rank))
        finals.append(params_of(model))
    finally:
        comm.finalize()
    assert all(finals[0][n].tobytes() == finals[1][n].tobytes()
               for n in finals[0])


@pytest.mark.skipif(WORLD.size < 2, reason='ranks that differ')
def test_a_compression_counter_loaded_on_rank_0_alone_is_given_to_all():
    """The averaging counter (which decides the compression's warm-up)
    is part of the state the replicas agree on after a load."""
    comm = mnopt.create_communicator('flat', compression='powersgd',
                                     warmup_steps=3)
    try:
        model, opt = make(comm, local_steps=2)
        for step in range(7):
            opt.update(model, *batch(step, comm.rank))
        snapshot = snapshot_of(model, opt)
        for step in range(7, 9):   # one more sync: the counter moves on
            opt.update(model, *batch(step, comm.rank))
        if comm.rank == 0:
            load(snapshot, model, opt)
            # Its first update meets the others at their next sync (an
            # update between syncs exchanges nothing), where they agree.
            opt.update(model, *batch(9, comm.rank))
        else:
            for step in (9, 10):   # local steps 9 and 10 (a sync)
                opt.update(model, *batch(step, comm.rank))
        counts = comm.everyone(comm.averaging.steps, 'test')
        assert counts == [counts[0]] * comm.size
        for step in range(10, 14):
            opt.update(model, *batch(step, comm.rank))
        with opt.using_synced_parameters():
            assert same_on_every_rank(comm, params_of(model))
    finally:
        comm.finalize()


@pytest.mark.parametrize('settings', [
    {'local_steps': 2},
    {'local_steps': 4, 'fragments': 4},
    {'local_steps': 4, 'fragments': 2, 'fragment_sync_delay': 1},
    {'local_steps': 4, 'fragments': 4, 'sync_warmup_steps': 3},
])
def test_the_tuner_tunes_across_the_syncs(settings):
    """bucket_bytes='auto' and segment_bytes='auto' are tuned on the
    syncs' averagings (one every H/F updates, a fragment each): the
    tuning ends with the same choice on every rank, and the synced
    parameters agree throughout."""
    from mnopt.averaging.tuning import max_steps
    comm = mnopt.create_communicator('flat', bucket_bytes='auto',
                                     segment_bytes='auto')
    try:
        model, opt = make(comm, **settings)
        per_sync = settings['local_steps'] // settings.get('fragments', 1)
        limit = settings.get('sync_warmup_steps', 0) + 1 + per_sync * (
            settings.get('fragments', 1) * (max_steps() + 1) + 2)
        step = 0
        while comm.tuned_settings is None and step < limit:
            opt.update(model, *batch(step, comm.rank))
            step += 1
        opt.wait()
        chosen = comm.tuned_settings
        assert chosen is not None and set(chosen) == {'bucket_bytes',
                                                      'segment_bytes'}
        assert comm.everyone(chosen, 'test') == [chosen] * comm.size
        with opt.using_synced_parameters():
            assert same_on_every_rank(comm, params_of(model))
    finally:
        comm.finalize()


def test_a_comm_hook_and_join_are_refused_on_every_rank():
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, local_steps=2)
        with pytest.raises(ValueError, match='not with local_steps'):
            with mnopt.join(opt):
                pass
        comm.register_comm_hook({}, lambda state, bucket, c: None)
        with pytest.raises(ValueError, match='registered comm hook'):
            make(comm, local_steps=2)
    finally:
        comm.finalize()


@pytest.mark.parametrize('warmup', [0, 2])
def test_a_comm_hook_registered_after_the_optimizer_is_refused_at_sync(
        warmup):
    """A hook registered once the optimizer exists (DDP's usual order) is
    refused at the next update that exchanges (a warm-up step or a
    sync), on every rank, before it averages anything; taken away again,
    training goes on."""
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, local_steps=2, sync_warmup_steps=warmup)
        opt.update(model, *batch(0, comm.rank))   # the broadcast
        calls = []
        comm.register_comm_hook({}, lambda *args: calls.append(args))
        with pytest.raises(ValueError, match='registered comm hook'):
            for step in range(1, 4):   # local step 2 syncs
                opt.update(model, *batch(step, comm.rank))
        assert calls == []
        comm.register_comm_hook(None, None)
        for step in range(4, 8):
            opt.update(model, *batch(step, comm.rank))
        with opt.using_synced_parameters():
            assert same_on_every_rank(comm, params_of(model))
    finally:
        comm.finalize()


@pytest.mark.skipif(WORLD.size < 2, reason='ranks that differ')
@pytest.mark.parametrize('differ', [
    lambda rank: {'local_steps': 2 + rank},
    lambda rank: {'local_steps': 4, 'fragments': 2 ** rank},
    lambda rank: {'local_steps': 4, 'outer_optimizer':
                  mnopt.OuterNesterov(lr=0.7 + rank)},
    lambda rank: {'local_steps': 4, 'sync_warmup_steps': rank},
])
def test_settings_that_differ_across_ranks_fail_together(differ):
    comm = mnopt.create_communicator('naive')
    try:
        with pytest.raises(ValueError, match='every rank must pass the same'):
            make(comm, **differ(comm.rank))
    finally:
        comm.finalize()


# ------------------------------------------- no waiting between syncs
#: The communicator's exchanges (those it has are counted).
EXCHANGES = ('everyone', 'raise_together', 'same', 'common', 'bcast_data',
             'bcast_obj', 'mean_grads', 'mean_grads_async',
             'multi_node_mean_grad', 'allreduce_obj', 'allreduce',
             'allreduce_grad', 'gather_obj', 'scatter', 'alltoall', 'send',
             'recv', 'send_obj', 'recv_obj', 'split')


def counting_exchanges(comm):
    """Every exchange ``comm`` runs from now on, by name, in a list."""
    calls = []
    for name in EXCHANGES:
        run = getattr(comm, name, None)
        if callable(run):
            def counted(*args, _run=run, _name=name, **kwargs):
                calls.append(_name)
                return _run(*args, **kwargs)
            setattr(comm, name, counted)
    return calls


@pytest.mark.parametrize('settings', [
    dict(local_steps=4),
    dict(local_steps=4, fragments=2, fragment_sync_delay=1,
         sync_warmup_steps=2),
])
def test_no_exchange_between_syncs(settings):
    """An update that starts no sync exchanges nothing with the other
    ranks (docs/local_sgd.md: between syncs no rank waits for another);
    the warm-up's and the syncs' updates do."""
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, **settings)
        opt.update(model, *batch(0, comm.rank))   # the broadcast
        calls = counting_exchanges(comm)
        warmup = settings.get('sync_warmup_steps', 0)
        for step in range(1, 13):
            before = len(calls)
            opt.update(model, *batch(step, comm.rank))
            local_step = step - warmup
            syncs = local_step >= 1 and starting(
                local_step, settings['local_steps'],
                settings.get('fragments', 1))
            exchanged = calls[before:]
            if local_step < 1 or syncs:
                assert exchanged, step
            else:
                assert exchanged == [], (step, exchanged)
    finally:
        comm.finalize()


@pytest.mark.skipif(WORLD.size < 2, reason='ranks that differ')
def test_a_rank_held_up_between_syncs_holds_up_no_other(tmp_path):
    """Rank 1 starts its local updates only once rank 0 has done all of
    its own (a file says so: no exchange, no clock): were an update to
    exchange anything, rank 0 would wait for rank 1 and the file would
    not come before rank 1 gives up waiting."""
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, local_steps=1000)
        opt.update(model, *batch(0, comm.rank))   # the broadcast
        done = comm.bcast_obj(str(tmp_path / 'rank0_done')
                              if comm.rank == 0 else None)
        seen = True
        if comm.rank == 0:
            for step in range(1, 11):
                opt.update(model, *batch(step, comm.rank))
            open(done, 'w').close()
        else:
            import os
            import time
            give_up = time.monotonic() + 60
            while not os.path.exists(done) and time.monotonic() < give_up:
                time.sleep(0.05)
            seen = os.path.exists(done)
            for step in range(1, 11):
                opt.update(model, *batch(step, comm.rank))
        assert all(comm.everyone(seen, 'test')), \
            'rank 0 waited for rank 1 between syncs'
    finally:
        comm.finalize()


@pytest.mark.parametrize('settings', [
    dict(local_steps=2),
    dict(local_steps=4, fragments=2, fragment_sync_delay=1),
])
def test_the_outer_optimizers_hyperparameters_reach_every_fragment(
        settings):
    """An outer lr schedule sets the lr on the outer optimizer given:
    each fragment's copy takes it at its next outer update, so lr 0
    after the first syncs freezes the synced parameters."""
    comm = mnopt.create_communicator('flat')
    try:
        outer = mnopt.OuterNesterov(lr=0.7, momentum=0.9)
        model, opt = make(comm, outer_optimizer=outer, **settings)
        steps = settings['local_steps']
        for step in range(steps + 2):   # every fragment synced once
            opt.update(model, *batch(step, comm.rank))
        opt.wait()
        with opt.using_synced_parameters():
            synced = params_of(model)
        outer.lr = 0.0
        for step in range(steps + 2, 3 * steps + 2):
            opt.update(model, *batch(step, comm.rank))
        opt.wait()
        assert [f.outer.lr for f in opt._synced.fragments] == \
            [0.0] * len(opt._synced.fragments)
        with opt.using_synced_parameters():
            frozen = params_of(model)
        assert all(frozen[n].tobytes() == synced[n].tobytes()
                   for n in synced)
    finally:
        comm.finalize()


@pytest.mark.skipif(WORLD.size < 2, reason='ranks that differ')
def test_an_outer_lr_set_on_one_rank_fails_every_rank_at_sync():
    comm = mnopt.create_communicator('flat')
    try:
        outer = mnopt.OuterNesterov()
        model, opt = make(comm, local_steps=4, outer_optimizer=outer)
        opt.update(model, *batch(0, comm.rank))   # the broadcast
        if comm.rank == 1:
            outer.lr = 0.1
        with pytest.raises(ValueError, match="outer optimizer's "
                           r'hyperparameters differ across ranks \(rank 0: '
                           r'OuterNesterov\(lr=0\.7, momentum=0\.5\); '
                           r'rank 1: OuterNesterov\(lr=0\.1'):
            for step in range(1, 5):   # local step 4 syncs
                opt.update(model, *batch(step, comm.rank))
    finally:
        comm.finalize()


@pytest.mark.skipif(WORLD.size < 2, reason='ranks that differ')
def test_a_hook_added_on_one_rank_between_syncs_fails_every_rank_at_sync():
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, local_steps=4)
        opt.update(model, *batch(0, comm.rank))   # the broadcast
        if comm.rank == 1:
            opt.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))
        with pytest.raises(ValueError, match='hooks differ across ranks'):
            for step in range(1, 5):   # local step 4 syncs
                opt.update(model, *batch(step, comm.rank))
    finally:
        comm.finalize()


class LateBranch(chainer.Chain):
    """A branch with a lazy link, first used mid-run."""

    def __init__(self):
        super(LateBranch, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, 8, initialW=_weights(8, 6, 1))
            self.extra = L.Linear(None, 8)

    def __call__(self, x, t, use_extra=False):
        h = self.l1(x)
        if use_extra:
            h = h + self.extra(x)
        return F.softmax_cross_entropy(h, t)


def test_a_parameter_that_appears_later_joins_and_keeps_the_state():
    """The lazy link's parameters get their data at update 9 (between
    syncs): at the next sync they take rank 0's values and join the
    synced copy; the outer momentum, the step within H and the warm-up
    count go on (no broadcast of the whole model, no restart)."""
    comm = mnopt.create_communicator('flat')
    try:
        model = LateBranch()
        model, opt = make(comm, model=model, local_steps=4,
                          sync_warmup_steps=3)
        averaged = counting_exchanges(comm)
        for step in range(9):
            opt.update(model, *batch(step, comm.rank))
        fragment = opt._synced.fragments[0]
        momentum = fragment.params()[fragment.names.index('/l1/W')] \
            .update_rule.state['buf'].copy()
        assert abs(momentum).sum() > 0
        for step in range(9, 14):
            averaged_before = averaged.count('multi_node_mean_grad')
            opt.update(model, *batch(step, comm.rank), use_extra=True)
            assert averaged.count('multi_node_mean_grad') == \
                averaged_before, 'a synchronous step after the warm-up'
            assert opt._done == step   # the first update applied nothing
            if step == 9:   # no sync since the momentum was copied
                kept = fragment.params()[fragment.names.index('/l1/W')] \
                    .update_rule.state['buf']
                assert kept.tobytes() == momentum.tobytes()
        # Update 9 is local step 6 (its data), 11 local step 8 (a sync:
        # it joins).
        names = opt._synced.names(0)
        assert '/extra/W' in names and '/extra/b' in names
        with opt.using_synced_parameters():
            synced = params_of(model)
        assert same_on_every_rank(comm, synced)
        assert set(synced) == {'/l1/W', '/l1/b', '/extra/W', '/extra/b'}
    finally:
        comm.finalize()


@pytest.mark.parametrize('warmup', [0, 2])
def test_a_branch_first_used_at_the_first_local_step_joins_once(warmup):
    """The synced copy is made at the last update that exchanges (the
    broadcast, the last warm-up step), of the parameters every rank holds
    alike: a lazy link that gets its data (each rank's own) at the first
    local step is not in it, and joins once at the next sync with rank
    0's values; that first local step exchanges nothing, and
    ``using_synced_parameters`` gives back each rank's local values."""
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, model=LateBranch(), local_steps=4,
                          sync_warmup_steps=warmup)
        calls = counting_exchanges(comm)
        for step in range(warmup + 7):   # to local step 6: mid-H
            numpy.random.seed(100 + comm.rank)   # each rank's own init
            before = len(calls)
            opt.update(model, *batch(step, comm.rank),
                       use_extra=step > warmup)
            if step == warmup + 1:   # the first local step
                assert calls[before:] == []
        names = opt._synced.names(0)
        assert sorted(names) == ['/extra/W', '/extra/b', '/l1/W', '/l1/b']
        local = params_of(model)
        if comm.size > 1:
            assert not same_on_every_rank(comm, local)
        with opt.using_synced_parameters():
            assert same_on_every_rank(comm, params_of(model))
        after = params_of(model)
        assert all(after[n].tobytes() == local[n].tobytes() for n in local)
    finally:
        comm.finalize()


def _train_late_branch(comm, model, opt, start, stop, first_use,
                       snapshot_at=None):
    """Updates ``start`` to ``stop`` of a LateBranch whose lazy link gets
    its data (each rank's own) at ``first_use``; the snapshot after
    update ``snapshot_at``."""
    snapshot = None
    for step in range(start, stop):
        numpy.random.seed(100 + comm.rank)   # each rank's own init
        opt.update(model, *batch(step, comm.rank),
                   use_extra=step >= first_use)
        if step == snapshot_at:
            snapshot = snapshot_of(model, opt)
    return snapshot


@pytest.mark.parametrize('snapshot_at, first_use, settings', [
    (6, 5, dict(local_steps=4)),   # between its first use and the sync
    (7, 5, dict(local_steps=4)),   # resumed at the sync's update
    (4, 5, dict(local_steps=4)),   # first used in the resumed update
    (5, 3, dict(local_steps=4, fragments=2, fragment_sync_delay=1)),
    (1, 2, dict(local_steps=2, sync_warmup_steps=3)),   # in the warm-up
])
def test_a_parameter_that_appears_around_a_snapshot_joins_as_without_one(
        snapshot_at, first_use, settings):
    """A snapshot records the parameter set the ranks last agreed on: a
    lazy link that got its data since (or gets it in the resumed update)
    joins the synced copy at the same update as in the uninterrupted run
    (rank 0's values), which the resumed run follows bit for bit."""
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, model=LateBranch(), **settings)
        snapshot = _train_late_branch(comm, model, opt, 0, 14, first_use,
                                      snapshot_at)
        again, resumed = make(comm, model=LateBranch(), **settings)
        load(snapshot, again, resumed)
        _train_late_branch(comm, again, resumed, snapshot_at + 1, 14,
                           first_use)
        final, resumed_final = params_of(model), params_of(again)
        assert all(final[n].tobytes() == resumed_final[n].tobytes()
                   for n in final)
        assert sorted(resumed._synced.names(0) + (
            resumed._synced.names(1) if len(resumed._synced.fragments) > 1
            else [])) == ['/extra/W', '/extra/b', '/l1/W', '/l1/b']
        with resumed.using_synced_parameters():
            assert same_on_every_rank(comm, params_of(again))
    finally:
        comm.finalize()


# ------------------------------------------------- the ImageNet example
class BatchNormMLP(chainer.Chain):
    """A batch-normalized hidden layer (its gamma and beta are synced,
    its running statistics each rank's own between syncs and averaged at
    them), as the example's CNN."""

    def __init__(self):
        super(BatchNormMLP, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, 8, initialW=_weights(8, 6, 1))
            self.bn = L.BatchNormalization(8)
            self.l2 = L.Linear(8, 8, initialW=_weights(8, 8, 2))

    def __call__(self, x, t):
        return F.softmax_cross_entropy(
            self.l2(F.relu(self.bn(self.l1(x)))), t)


def persistents_of(model):
    return {'%s/%s' % (path, name): numpy.array(link.__dict__[name])
            for path, link in sorted(model.namedlinks())
            for name in sorted(link._persistent)
            if getattr(link.__dict__[name], 'ndim', 0) > 0}


@pytest.mark.parametrize('settings', [
    dict(local_steps=4), dict(local_steps=4, fragments=2,
                              fragment_sync_delay=1)])
def test_the_running_statistics_are_averaged_at_syncs_and_swapped_in(
        settings):
    """Batch normalization's running statistics: each rank's own between
    syncs, their mean over the ranks at each sync of the first fragment,
    and what ``using_synced_parameters`` evaluates with (the same on
    every rank), kept by a snapshot."""
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, model=BatchNormMLP(), **settings)
        for step in range(7):   # local step 4 syncs fragment 0
            opt.update(model, *batch(step, comm.rank))
        local = persistents_of(model)
        with opt.using_synced_parameters():
            synced = persistents_of(model)
        assert same_on_every_rank(comm, synced)
        assert persistents_of(model).keys() == local.keys()
        assert all(persistents_of(model)[k].tobytes() == local[k].tobytes()
                   for k in local)   # the local ones again after
        if comm.size > 1:
            assert not same_on_every_rank(comm, local)
        snapshot = snapshot_of(model, opt)
        resumed_model, resumed = make(comm, model=BatchNormMLP(),
                                      **settings)
        load(snapshot, resumed_model, resumed)
        with resumed.using_synced_parameters():
            again = persistents_of(resumed_model)
        assert all(again[k].tobytes() == synced[k].tobytes()
                   for k in synced)
    finally:
        comm.finalize()


def test_the_running_statistics_average_is_counted_in_float32(tmp_path):
    """Their mean travels in their float32 (not float64) and counts as
    the communicator's averagings do: in ``communication_stats()`` and as
    a 'wire' of the timeline (args ``persistents``: the local step)."""
    path = str(tmp_path / 'trace.json')
    comm = mnopt.create_communicator('flat', timeline=path)
    try:
        model, opt = make(comm, model=BatchNormMLP(), local_steps=4)
        for step in range(4):
            opt.update(model, *batch(step, comm.rank))
        comm.communication_stats()
        sent, allreduce = [], comm.allreduce
        comm.allreduce = lambda x: sent.append(x.copy()) or allreduce(x)
        opt.update(model, *batch(4, comm.rank))   # local step 4 syncs
        counted = comm.communication_stats()['bytes']
        with opt.using_synced_parameters():
            synced = persistents_of(model)
        params = sum(p.array.nbytes for p in model.params())
        statistics = sum(v.nbytes for v in synced.values())
        assert [a.dtype for a in sent] == [numpy.float32]
        everyone = comm.everyone(sent[0], 'test')
    finally:
        comm.finalize()
    mean = numpy.mean(everyone, axis=0, dtype=numpy.float64)
    numpy.testing.assert_allclose(numpy.concatenate(
        [synced[k].ravel() for k in sorted(synced)]), mean, rtol=1e-6)
    events = timelines.load(timelines.trace_path(path, WORLD.rank))
    wires = [e['args'] for e in events if e.get('name') == 'wire'
             and 'persistents' in e.get('args', {})]
    if comm.size > 1:
        assert counted == params + statistics
        assert [(w['persistents'], w['bytes']) for w in wires] == \
            [(4, statistics)]
    else:   # nothing moves
        assert counted == 0 and wires == []


def _train_with_the_examples_evaluator(comm, evaluate, steps=9):
    """The example's path: a Trainer, the StandardUpdater calling update
    with the loss, and (``evaluate``) its multi-node evaluator every
    iteration reporting the sum of the weights it sees.  The parameters
    after, and each evaluation's sum."""
    flags = imagenet_example_module('local_steps_flags')
    model, opt = make(comm, chainer.optimizers.MomentumSGD(lr=0.1),
                      model=BatchNormMLP(), local_steps=4)
    data = [(x, t) for step in range(steps)
            for x, t in zip(*batch(step, comm.rank))]
    updater = chainer.training.StandardUpdater(
        chainer.iterators.SerialIterator(data, BATCH, shuffle=False), opt)
    trainer = chainer.training.Trainer(updater, (steps, 'iteration'))
    seen = []

    def weights(*_):
        chainer.report({'w': sum(float(p.array.astype(numpy.float64).sum())
                                 for p in model.params())})

    if evaluate:
        evaluator = flags.evaluating_synced(
            chainer.training.extensions.Evaluator(
                chainer.iterators.SerialIterator([0], 1, repeat=False),
                model, eval_func=weights), opt)
        evaluator = mnopt.create_multi_node_evaluator(evaluator, comm)

        def record(trainer):
            seen.append(evaluator.evaluate()['w'])
            with opt.using_synced_parameters():
                seen.append(sum(float(p.array.astype(numpy.float64).sum())
                                for p in model.params()))
        trainer.extend(record, trigger=(1, 'iteration'))
    trainer.run()
    return params_of(model), seen


def test_the_examples_evaluator_sees_the_synced_parameters_and_restores():
    """What the example's evaluator reports is the synced parameters
    (not the mean of the ranks' local ones), and training goes on from
    the local parameters bit for bit as without an evaluator."""
    comm = mnopt.create_communicator('flat')
    try:
        trained, seen = _train_with_the_examples_evaluator(comm, True)
        for reported, synced in zip(seen[::2], seen[1::2]):
            assert reported == pytest.approx(synced, abs=1e-9)
        unevaluated, _ = _train_with_the_examples_evaluator(comm, False)
        assert all(trained[n].tobytes() == unevaluated[n].tobytes()
                   for n in trained)
    finally:
        comm.finalize()


@pytest.mark.parametrize('local_steps, given, expected', [
    (8, False, 0.05 / WORLD.size),   # the inner lr for one rank's batch
    (8, True, 0.05),                 # --lr given: as given
    (None, False, 0.05),             # synchronous: the example's lr
])
def test_the_examples_inner_lr_is_for_one_ranks_batch(
        local_steps, given, expected):
    """The example's default lr (0.05 on its CNN) is for the synchronous
    batch of ranks x batchsize; the inner optimizer of local steps sees
    one rank's batch (at 0.05 and 16 images the CNN does not train)."""
    import argparse
    flags = imagenet_example_module('local_steps_flags')
    args = argparse.Namespace(local_steps=local_steps,
                              lr=0.05 if given else None)
    flags.note_lr_given(args)
    args.lr = args.lr or 0.05   # as the example's load_datasets
    comm = mnopt.create_communicator('naive')
    try:
        flags.set_inner_lr(args, comm)
    finally:
        comm.finalize()
    assert args.lr == expected


@pytest.mark.parametrize('same_ranks, local_steps, given, warned', [
    (False, 8, False, True),    # the default inner lr changed: said
    (True, 8, False, False),
    (False, 8, True, False),    # --lr given: kept
    (False, None, False, False),
])
def test_the_example_says_when_a_resume_changes_the_inner_lr(
        capsys, same_ranks, local_steps, given, warned):
    import argparse
    flags = imagenet_example_module('local_steps_flags')
    args = argparse.Namespace(local_steps=local_steps, lr=0.05 / 3,
                              lr_given=given)
    comm = mnopt.create_communicator('naive')
    try:
        assert flags.warn_of_resumed_lr(args, comm, same_ranks) == warned
        said = capsys.readouterr().out
        assert ('not the one the snapshot trained with' in said) == (
            warned and comm.rank == 0)
    finally:
        comm.finalize()


@pytest.mark.skipif(WORLD.size < 2, reason='ranks that differ')
def test_ranks_resumed_from_rank_0s_file_start_from_its_replica():
    """Resuming on more ranks, a rank without a file of its own loads
    rank 0's (docs/local_sgd.md): it starts from rank 0's local
    parameters, not the synced ones, so rank 0's progress since the last
    sync counts once per such rank at the next sync; the ranks hold the
    same synced parameters there."""
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = make(comm, local_steps=4)
        for step in range(7):   # local step 6: mid-H
            opt.update(model, *batch(step, comm.rank))
        with opt.using_synced_parameters():
            synced = params_of(model)
        snapshot = comm.bcast_obj(snapshot_of(model, opt)
                                  if comm.rank == 0 else None)
        rank0_local = comm.bcast_obj(params_of(model))
        resumed_model, resumed = make(comm, local_steps=4)
        load(snapshot, resumed_model, resumed)
        local = params_of(resumed_model)
        assert all(local[n].tobytes() == rank0_local[n].tobytes()
                   for n in local)
        assert any(local[n].tobytes() != synced[n].tobytes() for n in local)
        for step in range(7, 9):   # local step 8 syncs
            resumed.update(resumed_model, *batch(step, comm.rank))
        with resumed.using_synced_parameters():
            assert same_on_every_rank(comm, params_of(resumed_model))
    finally:
        comm.finalize()
