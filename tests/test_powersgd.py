"""compression='powersgd' and 'auto' on the communicators: the mean each
gives against PowerSGD written out in float64 from every rank's gradients,
the same bits on every rank, the exact mean at full rank, plain averaging
during warm-up, error feedback losing nothing, 'auto' choosing alike on
every rank, and the refusals.

Runs serially and under mpiexec -n 2 / -n 3."""

import numpy
import pytest

import mnopt
from mnopt.codecs import powersgd
from mnopt.averaging import compression_guard
from conftest import WORLD, mnopt_records

pytestmark = pytest.mark.many_ranks

KINDS = ['naive', 'flat', 'hierarchical', 'reduction_server']
# A conv kernel, a wide and a tall matrix, a bias, one too small to pay.
SHAPES = [(8, 3, 3, 3), (12, 40), (50, 6), (12,), (3, 3)]


def grads_of(step, shapes=SHAPES):
    rng = numpy.random.RandomState(100 * step + WORLD.rank)
    return [('g%d' % i, rng.standard_normal(s).astype(numpy.float32))
            for i, s in enumerate(shapes)]


def everyone_same(named):
    mine = b''.join(a.tobytes() for _, a in named)
    return all(other == mine for other in WORLD.allgather(mine))


def written_out(named_by_rank, rank, qs=None, errors=None):
    """One step of PowerSGD over every rank's gradients, in float64 from
    the paper's equations: the expected means, and the Qs and this rank's
    residuals after it."""
    size = len(named_by_rank)
    shapes = [a.shape for _, a in named_by_rank[0]]
    entries = powersgd.plan(shapes, rank)
    qs, errors = dict(qs or {}), [dict(e or {}) for e in
                                  (errors or [None] * size)]
    means = []
    for e in entries:
        grads = [named[e.index][1].astype(numpy.float64)
                 for named in named_by_rank]
        if e.matrix is None:
            means.append(sum(grads) / size)
            continue
        ms = [g.reshape(e.matrix) + errors[r].get(e.index, 0)
              for r, g in enumerate(grads)]
        q = qs.get(e.index)
        if q is None:
            q = powersgd.random_q(0, e.index, e.matrix[1], e.rank,
                                  numpy.float32).astype(numpy.float64)
        p = sum(m @ q for m in ms) / size
        p = powersgd.orthogonalize(p)
        q = sum(m.T @ p for m in ms) / size
        m_hat = p @ q.T
        for r, m in enumerate(ms):
            errors[r][e.index] = m - m_hat
        qs[e.index] = q
        means.append(m_hat.reshape(e.shape))
    return means, qs, errors


@pytest.mark.parametrize('kind', KINDS)
def test_the_mean_is_powersgds_on_every_rank(kind):
    comm = mnopt.create_communicator(kind, compression='powersgd',
                                     powersgd_rank=2)
    qs = errors = None
    try:
        for step in range(3):   # the warm Q and the residuals carry over
            named = grads_of(step)
            every = WORLD.allgather(named)
            expected, qs, errors = written_out(every, 2, qs, errors)
            comm.mean_grads(named)
            assert everyone_same(named)
            for (name, got), want in zip(named, expected):
                numpy.testing.assert_allclose(got, want, rtol=2e-4,
                                              atol=2e-5, err_msg=name)
    finally:
        comm.finalize()


@pytest.mark.parametrize('wire', ['float16', 'bfloat16'])
@pytest.mark.parametrize('kind', ['flat', 'reduction_server'])
def test_16_bit_factors(kind, wire):
    comm = mnopt.create_communicator(kind, compression='powersgd',
                                     powersgd_rank=2,
                                     allreduce_grad_dtype=wire)
    try:
        named = grads_of(0)
        expected, _, _ = written_out(WORLD.allgather(named), 2)
        comm.mean_grads(named)
        assert everyone_same(named)
        for (name, got), want in zip(named, expected):
            # The factors' rounding, not a wrong mean: a tenth of the
            # gradients' scale.
            assert numpy.abs(got - want).max() < 0.1, name
    finally:
        comm.finalize()


@pytest.mark.parametrize('kind', ['naive', 'flat'])
def test_full_rank_is_the_uncompressed_mean(kind):
    # Rank 50 covers every matrix; min_compression_rate 0 compresses all.
    comm = mnopt.create_communicator(kind, compression='powersgd',
                                     powersgd_rank=50,
                                     min_compression_rate=0.0)
    try:
        state_sizes = []
        for step in range(2):
            named = grads_of(step)
            exact = [sum(a[i][1].astype(numpy.float64)
                         for a in WORLD.allgather(named)) / WORLD.size
                     for i in range(len(named))]
            comm.mean_grads(named)
            for (name, got), want in zip(named, exact):
                numpy.testing.assert_allclose(got, want, rtol=1e-4,
                                              atol=1e-5, err_msg=name)
            (state,) = comm.averaging.low_rank.states.values()
            state_sizes.append([e.rank for e in state.plan])
        # Every matrix compressed (at its full rank), the bias whole.
        assert state_sizes[0] == [8, 12, 6, 0, 3]
    finally:
        comm.finalize()


def test_warmup_averagings_are_plain_means():
    plain = mnopt.create_communicator('flat')
    comm = mnopt.create_communicator('flat', compression='powersgd',
                                     warmup_steps=2)
    try:
        for step in range(3):
            named, reference = grads_of(step), grads_of(step)
            comm.mean_grads(named)
            plain.mean_grads(reference)
            same = all(a.tobytes() == b.tobytes()
                       for (_, a), (_, b) in zip(named, reference))
            assert same == (step < 2), step
        assert comm.averaging.low_rank.states
    finally:
        comm.finalize()
        plain.finalize()


def test_error_feedback_loses_nothing():
    """Over steps, the means sent plus the ranks' mean residual are the
    true means summed: what a step leaves out comes in later."""
    comm = mnopt.create_communicator('flat', compression='powersgd')
    try:
        sent = true = 0
        for step in range(4):
            named = grads_of(step, [(30, 20)])
            every = WORLD.allgather(named)
            true = true + sum(n[0][1].astype(numpy.float64)
                              for n in every) / WORLD.size
            comm.mean_grads(named)
            sent = sent + named[0][1]
        mine = comm.averaging.low_rank.residuals[('sync', 'g0')]
        residual = sum(WORLD.allgather(mine)) / WORLD.size
        numpy.testing.assert_allclose(sent + residual, true, rtol=1e-4,
                                      atol=1e-4)
        # And the compression did leave something out.
        assert numpy.abs(residual).max() > 1e-3
    finally:
        comm.finalize()


@pytest.mark.parametrize('quicker', [compression_guard.PLAIN,
                                     compression_guard.COMPRESSED])
def test_auto_keeps_the_quicker_way_on_every_rank(quicker, monkeypatch):
    """The guard's timings made up (each rank its own): every rank keeps
    the way whose slowest rank was quicker; a set kept plain first adds
    its residual to its gradient."""
    record = compression_guard.CompressionGuard.record

    def made_up(self, key, way, seconds, quickest):
        slow = 2.0 if way != quicker else 1.0
        return record(self, key, way, slow + 0.1 * WORLD.rank, quickest)

    monkeypatch.setattr(compression_guard.CompressionGuard, 'record',
                        made_up)
    comm = mnopt.create_communicator('flat', compression='auto')
    reference = mnopt.create_communicator('flat')
    try:
        ways = []
        for step in range(4):   # plain, compressed, plain, compressed
            named = grads_of(step)
            ways.append(comm.averaging.low_rank.guard.next(
                ('sync', tuple(n for n, _ in named))))
            comm.mean_grads(named)
        assert ways == ['plain', 'compressed'] * 2
        choices = comm.averaging.low_rank.guard.choices
        assert list(choices.values()) == [quicker]
        assert all(c == choices for c in WORLD.allgather(choices))
        residuals = comm.averaging.low_rank.residuals
        named = grads_of(9)
        if quicker == compression_guard.PLAIN:
            # The residuals of the last compressed averaging go in.
            expected = [(n, a + residuals[('sync', n)].reshape(a.shape)
                         if ('sync', n) in residuals else a.copy())
                        for n, a in named]
            assert len(expected) > len(residuals) > 0
            reference.mean_grads(expected)
            comm.mean_grads(named)
            assert residuals == {}
            for (name, got), (_, want) in zip(named, expected):
                assert got.tobytes() == want.tobytes(), name
        else:
            comm.mean_grads(named)
            assert residuals
        assert everyone_same(named)
    finally:
        comm.finalize()
        reference.finalize()


def test_overlap_buckets_each_have_their_state():
    chainer = pytest.importorskip('chainer')
    import chainer.links as L
    comm = mnopt.create_communicator('flat', compression='powersgd',
                                     bucket_bytes=256)
    try:
        numpy.random.seed(3)
        model = chainer.Sequential(L.Linear(10, 20), chainer.functions.relu,
                                   L.Linear(20, 5))
        optimizer = mnopt.create_multi_node_optimizer(
            chainer.optimizers.SGD(0.1), comm, overlap=True)
        optimizer.setup(model)
        rng = numpy.random.RandomState(WORLD.rank)
        for _ in range(3):
            x = rng.standard_normal((4, 10)).astype(numpy.float32)
            t = rng.randint(0, 5, 4).astype(numpy.int32)
            optimizer.update(lambda x, t: chainer.functions.
                             softmax_cross_entropy(model(x), t), x, t)
        sets = [names for _, names in comm.averaging.low_rank.states]
        assert len([s for s in sets if len(s) < 4]) >= 2, sets
        assert everyone_same(sorted(model.namedparams()) and
                             [(n, p.array) for n, p in
                              sorted(model.namedparams())])
    finally:
        comm.finalize()


def test_a_foreign_snapshot_warns_at_first_use():
    """Loading another rank's state drops its residuals; said once, at the
    first averaging that uses the state (a later load of this rank's own
    file, as a snapshot in two parts does, would have replaced it)."""
    chainer = pytest.importorskip('chainer')
    comm = mnopt.create_communicator('flat', compression='powersgd')
    other = mnopt.create_communicator('flat', compression='powersgd')
    try:
        comm.mean_grads(grads_of(0))
        state = {}
        comm.serialize_compression(
            chainer.serializers.DictionarySerializer(state))
        state['rank'] = numpy.int64(WORLD.rank + 1)   # as another's
        with mnopt_records() as records:
            other.serialize_compression(
                chainer.serializers.NpzDeserializer(state))
            loaded = [r.getMessage() for r in records]
            other.mean_grads(grads_of(1))
            other.mean_grads(grads_of(2))
        said = [r.getMessage() for r in records
                if 'PowerSGD residuals restart at zero' in r.getMessage()]
        assert loaded == [] and len(said) == 1, said
        (mine,) = comm.averaging.low_rank.states.values()
        (theirs,) = other.averaging.low_rank.states.values()
        assert theirs.iteration == mine.iteration + 2
    finally:
        comm.finalize()
        other.finalize()


@pytest.mark.parametrize('kwargs, match', [
    ({'powersgd_rank': 2}, "powersgd_rank=2 only applies with "
                           "compression='powersgd'"),
    ({'compression': 'sign', 'warm_start': False},
     "warm_start=False only applies"),
    ({'compression': 'powersgd', 'powersgd_rank': 0},
     'powersgd_rank must be a whole number >= 1'),
    ({'compression': 'powersgd', 'min_compression_rate': -1},
     'min_compression_rate must be a finite number >= 0'),
    ({'compression': 'powersgd', 'warm_start': 'yes'},
     'warm_start must be True or False'),
    ({'compression': 'powersgd', 'bucket_bytes': 'auto'},
     "bucket_bytes='auto' does not combine with compression='powersgd'"),
    ({'compression': 'powersgd', 'vote': 'ring'},
     "vote='ring' only applies with compression='sign'"),
    ({'compression': 'lowrank'}, "unknown compression 'lowrank'"),
])
def test_refused_on_every_rank(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mnopt.create_communicator('flat', **kwargs)


def test_shard_state_is_refused_on_every_rank():
    chainer = pytest.importorskip('chainer')
    comm = mnopt.create_communicator('flat', compression='powersgd')
    try:
        with pytest.raises(ValueError, match='low-rank factors of whole '
                                             'gradient matrices'):
            mnopt.create_multi_node_optimizer(chainer.optimizers.SGD(), comm,
                                              shard_state=True)
    finally:
        comm.finalize()


# -- where PowerSGD meets the rest ------------------------------------------

@pytest.mark.parametrize('wire', [None, 'float16'])
def test_a_non_finite_step_leaves_the_state_as_it_was(wire):
    """An inf in one rank's gradient (a loss scaler's overflow), or a
    float16 wire that overflows: that step's mean is not finite (the
    optimizer skips it); the Qs and residuals stay those of the step
    before, and the next steps are finite again."""
    comm = mnopt.create_communicator('flat', compression='powersgd',
                                     allreduce_grad_dtype=wire)
    comm.skip_single_rank = False   # one rank too packs into the wire
    try:
        finite = []
        for step in range(4):
            named = grads_of(step)
            if step == 1 and WORLD.rank == 0:
                named[1][1][0, 0] = numpy.inf if wire is None else 1e6
            if step == 1:
                (state,) = comm.averaging.low_rank.states.values()
                before = ({i: q.copy() for i, q in state.qs.items()},
                          {k: r.copy() for k, r in
                           comm.averaging.low_rank.residuals.items()})
            with mnopt_records():   # the overflow's warning
                comm.mean_grads(named)
            finite.append(all(numpy.isfinite(a).all() for _, a in named))
            if step == 1:
                qs, residuals = before
                assert state.iteration == 1
                assert all(state.qs[i].tobytes() == q.tobytes()
                           for i, q in qs.items())
                assert all(comm.averaging.low_rank.residuals[k].tobytes()
                           == r.tobytes() for k, r in residuals.items())
        assert finite == [True, False, True, True]
        assert state.iteration == 3
    finally:
        comm.finalize()


def test_every_gradient_set_keeps_its_state_however_many():
    comm = mnopt.create_communicator('flat', compression='powersgd')
    try:
        for _ in range(2):
            for b in range(300):   # overlap's buckets of a large model
                comm.mean_grads([('b%d' % b, numpy.ones((6, 5),
                                                        numpy.float32))])
        states = comm.averaging.low_rank.states
        assert len(states) == 300
        assert {s.iteration for s in states.values()} == {2}
    finally:
        comm.finalize()


def test_a_residual_follows_its_parameter_into_another_set():
    """Overlap's first updates average the whole model, its later ones
    bucket by bucket: each parameter's residual goes with it."""
    comm = mnopt.create_communicator('flat', compression='powersgd')
    try:
        whole = grads_of(0)
        comm.mean_grads(whole)
        residuals = comm.averaging.low_rank.residuals
        held = {k: r.copy() for k, r in residuals.items()}
        assert sorted(n for _, n in held) == ['g0', 'g1', 'g2']
        bucket = grads_of(1)[1:3]
        comm.mean_grads(bucket)
        # g1, g2 took theirs in (and left new ones); g0's waits for it.
        assert residuals[('sync', 'g0')].tobytes() == \
            held[('sync', 'g0')].tobytes()
        assert all(residuals[('sync', n)].tobytes() !=
                   held[('sync', n)].tobytes() for n in ('g1', 'g2'))
    finally:
        comm.finalize()


@pytest.mark.skipif(WORLD.size < 2, reason='ranks that differ')
@pytest.mark.parametrize('what', ['dtype', 'shape'])
def test_gradients_that_differ_across_ranks_are_refused(what):
    """Their factors would look alike (float32, the same matrix): the
    layout check still sees the gradients' dtypes and shapes."""
    comm = mnopt.create_communicator('flat', compression='powersgd')
    try:
        g = numpy.ones((8, 3, 3, 3), numpy.float32)
        if WORLD.rank == 1:
            g = g.astype(numpy.float16) if what == 'dtype' \
                else g.reshape(8, 27)
        with pytest.raises(mnopt.LayoutMismatchError, match='powersgd.P'):
            comm.mean_grads([('w', g)])
    finally:
        comm.finalize()


@pytest.mark.parametrize('saved, loaded', [('sign', 'powersgd'),
                                           ('powersgd', 'sign'),
                                           ('sign', 'auto')])
def test_a_snapshot_of_another_compression_loads(saved, loaded):
    chainer = pytest.importorskip('chainer')
    comm = mnopt.create_communicator('flat', compression=saved)
    other = mnopt.create_communicator('flat', compression=loaded)
    try:
        comm.mean_grads(grads_of(0))
        state = {}
        comm.serialize_compression(
            chainer.serializers.DictionarySerializer(state))
        with mnopt_records() as records:
            other.serialize_compression(
                chainer.serializers.NpzDeserializer(state))
        assert any('another compression' in r.getMessage()
                   for r in records)
        assert other.averaging.steps == comm.averaging.steps
        named = grads_of(1)
        other.mean_grads(named)
        assert everyone_same(named)
    finally:
        comm.finalize()
        other.finalize()


def test_a_snapshot_of_other_settings_runs_with_the_communicators():
    chainer = pytest.importorskip('chainer')
    comm = mnopt.create_communicator('flat', compression='powersgd')
    other = mnopt.create_communicator('flat', compression='powersgd',
                                      powersgd_rank=2, error_feedback=False)
    try:
        comm.mean_grads(grads_of(0))
        state = {}
        comm.serialize_compression(
            chainer.serializers.DictionarySerializer(state))
        other.serialize_compression(
            chainer.serializers.NpzDeserializer(state))
        with mnopt_records() as records:
            other.mean_grads(grads_of(1))
        said = [r.getMessage() for r in records
                if 'powersgd_rank=1' in r.getMessage()]
        assert len(said) == (WORLD.rank == 0), said
        (state,) = other.averaging.low_rank.states.values()
        assert (state.rank, state.use_error_feedback) == (2, False)
        assert state.iteration == 2   # the count comes along
        assert other.averaging.low_rank.residuals == {}
    finally:
        comm.finalize()
        other.finalize()


def test_auto_is_not_a_tuned_setting():
    comm = mnopt.create_communicator('flat', compression='auto')
    try:
        assert 'tuned' not in comm.shared_settings(comm.settings)
        assert comm.tuned_settings == {}
    finally:
        comm.finalize()


@pytest.mark.parametrize('share, way', [(0.97, 'plain'), (0.9, 'compressed')])
def test_auto_compresses_only_by_a_margin(share, way):
    """A compressed time within MARGIN of the plain one keeps the set
    plain: two rounds cannot tell them apart, and plain approximates
    nothing."""
    guard = compression_guard.CompressionGuard()

    def quickest(times):   # one rank's agreement.quickest
        return times.index(min(times)), times

    for _ in range(compression_guard.ROUNDS):
        guard.record('k', compression_guard.PLAIN, 1.0, quickest)
        guard.record('k', compression_guard.COMPRESSED, share, quickest)
    assert guard.choices == {'k': way}
