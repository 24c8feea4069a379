"""Sharded optimizer state (mnopt/optimizers/zero/) and its collectives
(mnopt/averaging/sharded.py).  Runs serially and under mpiexec -n 2
and -n 3, as every test module."""

import numpy
import pytest
from mpi4py import MPI

import mnopt
from mnopt.transport.layouts import LayoutMismatchError

from conftest import chainer, needs_chainer

# Also under mpiexec -n 3: parameters split unevenly over 3 ranks.
pytestmark = pytest.mark.many_ranks

if chainer is not None:   # the sharded optimizer is of the Chainer layer
    from mnopt import zero

WORLD = MPI.COMM_WORLD


def _per_rank(n_arrays, size):
    """Arrays per rank for tests: as even as whole arrays go."""
    return [n_arrays * (r + 1) // size - n_arrays * r // size
            for r in range(size)]


SHAPES = [(5, 3), (7,), (4, 4, 2), (1,), (0,), (33,), (6, 2)]


def _exact_grads(size, rank, dtype=numpy.float32):
    """size * (pattern + rank): divided by ``size`` while packed, every
    value and every partial sum is exact, so the mean is
    size * (pattern + (size - 1) / 2) whatever order the ranks are summed
    in."""
    out = []
    for i, s in enumerate(SHAPES):
        pattern = (numpy.arange(int(numpy.prod(s))).reshape(s) % 11
                   * 0.125 - 0.5 + i)
        out.append(((pattern + rank) * size).astype(dtype))
    return out


def _exact_mean(size, dtype=numpy.float32):
    return [((g / size + (size - 1) / 2.0) * size).astype(dtype)
            for g in _exact_grads(size, 0, dtype)]


# ------------------------------------------------------------ partition

@needs_chainer
def test_partition_cuts_each_dtype_into_equal_shares():
    specs = [('b', 50, 'float32'), ('a', 100, 'float32'),
             ('h', 40, 'float16'), ('e', 0, 'float32')]
    pieces = zero.partition(specs, 2, align=4)
    P = zero.Piece
    # Each dtype on its own (their names sorted), in name order, cut
    # every ceil(total / N) elements rounded up to the alignment.
    assert pieces == [P('h', 0, 20, 0), P('h', 20, 40, 1),
                      P('a', 0, 76, 0), P('a', 76, 100, 1),
                      P('b', 0, 50, 1)]
    assert zero.elements_per_rank(pieces, 2) == [96, 94]
    assert zero.by_rank(pieces, 2) == (
        [pieces[0], pieces[2], pieces[1], pieces[3], pieces[4]], [2, 3])
    # One dominant array spans every rank; more ranks than elements:
    # the last ranks hold nothing.
    assert [p.rank for p in zero.partition([('w', 1000, 'f')], 3)] == \
        [0, 1, 2]
    assert zero.partition([('w', 5, 'f')], 3, align=4) == [
        P('w', 0, 4, 0), P('w', 4, 5, 1)]


@needs_chainer
def test_the_largest_share_is_total_over_n_within_the_alignment():
    rng = numpy.random.RandomState(0)
    specs = [('p%03d' % k, int(rng.randint(1, 5000)), 'float32')
             for k in range(60)] + [('big', 10 ** 6, 'float32')]
    total = sum(s for _, s, _ in specs)
    for n in (2, 3, 4, 8, 16, 32):
        counts = zero.elements_per_rank(zero.partition(specs, n), n)
        assert sum(counts) == total
        assert max(counts) <= total / n + zero.ALIGN


@needs_chainer
def test_partition_keeps_earlier_pieces():
    first = zero.partition([('a', 100, 'f'), ('b', 100, 'f')], 2)
    later = zero.partition([('a', 100, 'f'), ('b', 100, 'f'),
                            ('0new', 40, 'f')], 2, first)
    # a and b keep their pieces (their state lives there); the new one is
    # cut among the ranks on its own.
    assert later[:len(first)] == first
    assert later[len(first):] == [zero.Piece('0new', 0, 32, 0),
                                  zero.Piece('0new', 32, 40, 1)]


# ------------------------------------------------------------ collectives

@pytest.mark.parametrize('wire', [None, 'float16', 'bfloat16', 'float64'])
def test_reduce_scatter_mean_exact(comm_name, wire):
    comm = mnopt.create_communicator(comm_name, allreduce_grad_dtype=wire)
    try:
        size, rank = comm.size, comm.rank
        grads = _exact_grads(size, rank)
        named = [('g%d' % i, g) for i, g in enumerate(grads)]
        before = [g.copy() for g in grads]
        per = _per_rank(len(named), size)
        comm.reduce_scatter_mean(named, per)
        first = sum(per[:rank])
        mine = range(first, first + per[rank])
        # float32 gradients on a float32 wire are summed where they are
        # on flat and hierarchical: the other shares hold partial sums.
        in_place = comm.shard_parts and wire is None
        for i, (g, want, was) in enumerate(zip(grads, _exact_mean(size),
                                               before)):
            if i in mine or size == 1:
                numpy.testing.assert_array_equal(g, want, err_msg=str(i))
            elif not in_place:   # another rank's share: left alone
                numpy.testing.assert_array_equal(g, was, err_msg=str(i))
    finally:
        comm.finalize()


def _ring_order_mean(arrays_of_rank, size, counts, wire_dtype):
    """Chunk c summed as mnopt/transport/ring.py does: x[c+1] + x[c+2] +
    ... + x[c] (rank numbers mod N), in the wire dtype, after dividing by N."""
    flat = [numpy.concatenate([a.reshape(-1) for a in arrays_of_rank(r)])
            .astype(numpy.float32) for r in range(size)]
    packed = [numpy.divide(f, size, dtype=numpy.float32).astype(wire_dtype)
              for f in flat]
    out = numpy.empty_like(packed[0])
    lo = 0
    for c, n in enumerate(counts):
        acc = packed[(c + 1) % size][lo:lo + n].copy()
        for k in range(2, size + 1):
            acc = acc + packed[(c + k) % size][lo:lo + n]
        out[lo:lo + n] = acc
        lo += n
    return out


def test_flat_sums_each_share_in_the_rings_order():
    """Random float32 gradients (sums that round): this rank's share is
    the ring's fixed order, bit for bit, and the allreduce's mean where
    that order is the same (N <= 2: one a + b; rank N-1's share)."""
    comm = mnopt.create_communicator('flat')
    try:
        size, rank = comm.size, comm.rank
        shapes = [(300, 7), (1000,), (17, 3), (5,)]

        def grads_of(r):
            rng = numpy.random.RandomState(100 + r)
            return [rng.randn(*s).astype(numpy.float32) for s in shapes]

        named = [('g%d' % i, g) for i, g in enumerate(grads_of(rank))]
        reference = [('g%d' % i, g) for i, g in enumerate(grads_of(rank))]
        per = _per_rank(len(shapes), size)
        comm.reduce_scatter_mean(named, per)
        comm.mean_grads(reference)
        sizes = [int(numpy.prod(s)) for s in shapes]
        counts, k = [], 0
        for n in per:
            counts.append(sum(sizes[k:k + n]))
            k += n
        want = _ring_order_mean(grads_of, size, counts, numpy.float32)
        first = sum(per[:rank])
        lo = sum(counts[:rank])
        for i in range(first, first + per[rank]):
            got = named[i][1].reshape(-1)
            numpy.testing.assert_array_equal(got, want[lo:lo + got.size])
            if size <= 2 or rank == size - 1:
                numpy.testing.assert_array_equal(named[i][1],
                                                 reference[i][1])
            lo += got.size
    finally:
        comm.finalize()


def test_allgather_params_gives_every_rank_the_owners_bytes(comm_name):
    comm = mnopt.create_communicator(comm_name)
    try:
        size, rank = comm.size, comm.rank
        # Mixed dtypes and odd sizes: byte ranges that are not aligned.
        dtypes = [numpy.float16, numpy.float32, numpy.float64,
                  numpy.float16, numpy.float32, numpy.float32, numpy.float64]
        per = _per_rank(len(SHAPES), size)
        owner = [r for r in range(size) for _ in range(per[r])]

        def value(i, r):
            return (numpy.arange(int(numpy.prod(SHAPES[i])))
                    .reshape(SHAPES[i]) * 0.5 + 100 * r + i).astype(dtypes[i])

        arrays = [value(i, rank) for i in range(len(SHAPES))]
        comm.allgather_params([('p%d' % i, a) for i, a in enumerate(arrays)],
                              per)
        for i, a in enumerate(arrays):
            numpy.testing.assert_array_equal(a, value(i, owner[i]))
            assert a.dtype == dtypes[i]
    finally:
        comm.finalize()


@pytest.mark.parametrize('wire', [None, 'float16'])
def test_what_the_sharded_collectives_keep_besides_the_arrays(comm_name,
                                                              wire):
    """flat and hierarchical reduce float32 gradients on their own wire
    and gather the parameters where they are: no scratch.  A cast (16-bit
    wire) packs the gradients only; naive's MPI calls take one buffer, of
    the larger of the packed gradients and the parameters' bytes."""
    comm = mnopt.create_communicator(comm_name, allreduce_grad_dtype=wire)
    try:
        grads = _exact_grads(comm.size, comm.rank)
        per = _per_rank(len(grads), comm.size)
        comm.reduce_scatter_mean([('g%d' % i, g) for i, g in
                                  enumerate(grads)], per)
        params = [numpy.ones(s, numpy.float64) for s in SHAPES]
        comm.allgather_params([('p%d' % i, p) for i, p in
                               enumerate(params)], per)
        packed = sum(g.size for g in grads) * (2 if wire else 4)
        param_bytes = sum(p.nbytes for p in params)
        if comm.size == 1:
            want = 0   # nothing moves
        elif comm.name in ('flat', 'hierarchical'):
            assert comm.shard_parts
            want = packed if wire else 0
        else:
            want = max(packed, param_bytes)
        assert comm.shard_buffer_nbytes() == want
    finally:
        comm.finalize()


@pytest.mark.parametrize('wire', ['float16', 'bfloat16'])
def test_an_overflowing_share_is_an_error_on_every_rank(comm_name, wire):
    """on_overflow='error': a mean beyond the wire's range in any rank's
    share raises on every rank (each rank unpacks only its share); NaN
    already in a gradient is not an overflow."""
    from mnopt.codecs.overflow import GradientOverflowError
    comm = mnopt.create_communicator(comm_name, allreduce_grad_dtype=wire,
                                     on_overflow='error')
    try:
        # Each rank's big / N fits the wire; their sum does not (beyond
        # bfloat16's range, float32's, only float64 gradients go).
        big, dtype = (7e4, numpy.float32) if wire == 'float16' else \
            (5e38, numpy.float64)
        per = _per_rank(2, comm.size)
        nan = [('a', numpy.full(3, numpy.nan, dtype)),
               ('b', numpy.ones(3, dtype))]
        comm.reduce_scatter_mean(nan, per)   # passes through: no error
        named = [('a', numpy.ones(3, dtype)), ('b', numpy.full(3, big, dtype))]
        if comm.size == 1:
            comm.reduce_scatter_mean(named, per)   # nothing moves
            numpy.testing.assert_array_equal(named[1][1], dtype(big))
            return
        # (float64 beyond float32's range overflows as it is packed into
        # bfloat16: numpy warns about that cast.)
        with pytest.raises(GradientOverflowError, match="'b'"), \
                numpy.errstate(over='ignore'):
            comm.reduce_scatter_mean(named, per)
    finally:
        comm.finalize()


def test_collectives_are_stall_watched():
    comm = mnopt.create_communicator('flat')
    try:
        named = [('g0', numpy.ones(4, numpy.float32))]
        per = [1] + [0] * (comm.size - 1)
        comm.reduce_scatter_mean(named, per)
        comm.allgather_params(named, per)
        counts = comm._monitor._counts
        assert counts.get('reduce_scatter_mean') == 1
        assert counts.get('allgather_params') == 1
    finally:
        comm.finalize()


def test_ranks_with_different_arrays_get_the_same_error(comm_name):
    comm = mnopt.create_communicator(comm_name)
    try:
        shapes = [(4,), (3,)] if comm.rank != comm.size - 1 or \
            comm.size == 1 else [(4,), (5,)]
        named = [('g%d' % i, numpy.ones(s, numpy.float32))
                 for i, s in enumerate(shapes)]
        per = _per_rank(2, comm.size)
        if comm.size == 1:
            comm.reduce_scatter_mean(named, per)   # nothing to disagree on
            return
        with pytest.raises(LayoutMismatchError, match="'g1'"):
            comm.reduce_scatter_mean(named, per)
        with pytest.raises(LayoutMismatchError, match="'g1'"):
            comm.allgather_params(named, per)
        # The communicator still works after the error.
        good = [('g%d' % i, numpy.ones(s, numpy.float32))
                for i, s in enumerate([(4,), (3,)])]
        comm.reduce_scatter_mean(good, per)
    finally:
        comm.finalize()


def test_bad_arrays_per_rank_on_one_rank_is_an_error_everywhere():
    comm = mnopt.create_communicator('flat')
    try:
        named = [('g0', numpy.ones(4, numpy.float32))]
        per = [1] + [0] * (comm.size - 1)
        if comm.rank == comm.size - 1:
            per = per + [0]   # one count too many, on this rank only
        with pytest.raises(ValueError, match='rank %d: arrays_per_rank'
                           % (comm.size - 1)):
            comm.reduce_scatter_mean(named, per)
    finally:
        comm.finalize()


# ------------------------------------------------------------ the optimizer

def _model(seed=0):
    numpy.random.seed(seed)
    model = chainer.Sequential(chainer.links.Linear(6, 5),
                               chainer.links.Linear(5, 4),
                               chainer.links.Linear(4, 3))
    return model


OPTIMIZERS = {
    'SGD': lambda: chainer.optimizers.SGD(lr=0.05),
    'MomentumSGD': lambda: chainer.optimizers.MomentumSGD(lr=0.05),
    'Adam': lambda: chainer.optimizers.Adam(alpha=0.01),
    'AdaGrad': lambda: chainer.optimizers.AdaGrad(lr=0.05),
    'RMSprop': lambda: chainer.optimizers.RMSprop(lr=0.01),
}
HOOKS = {
    'none': lambda: [],
    'per-param': lambda: [chainer.optimizer_hooks.WeightDecay(1e-2),
                          chainer.optimizer_hooks.Lasso(1e-3),
                          chainer.optimizer_hooks.GradientHardClipping(
                              -0.5, 0.5)],
    'clipping': lambda: [chainer.optimizer_hooks.WeightDecay(1e-2),
                         chainer.optimizer_hooks.GradientClipping(0.3)],
}


def _train(comm, make_opt, hooks, shard, steps, exact):
    """Parameters after ``steps`` updates; ``exact``: gradients set so
    their means are exact (any summation order gives the same bits),
    else a real backward of rank-dependent data."""
    model = _model()
    opt = mnopt.create_multi_node_optimizer(make_opt(), comm,
                                            shard_state=shard).setup(model)
    for hook in hooks():
        opt.add_hook(hook)
    rng = numpy.random.RandomState(10 + comm.rank)
    for step in range(steps + 1):   # the first update broadcasts
        if exact:
            for k, (name, param) in enumerate(sorted(model.namedparams())):
                pattern = (numpy.arange(param.size) % 7 * 0.125 - 0.375
                           + 0.25 * k + 0.5 * step).reshape(param.shape)
                param.grad = ((pattern + comm.rank) * comm.size).astype(
                    param.dtype)
            opt.update()
        else:
            x = rng.rand(4, 6).astype(numpy.float32)
            opt.update(lambda: chainer.functions.sum(model(x) ** 2))
    return model, opt


def _params(model):
    return {n: p.array.copy() for n, p in model.namedparams()}


def assert_only_pieces_hold_state(comm, opt, stateful=True):
    """A rule holds state for its rank's piece only, of the piece's
    length (SGD has none at all); a parameter held whole keeps its (mean)
    gradient, every other one none."""
    mine = {p.name: p for p in opt.pieces if p.rank == comm.rank}
    for name, param in opt.target.namedparams():
        piece = mine.get(name)
        if piece is None:
            assert param.update_rule.state is None, name
            assert param.grad is None, name
            continue
        whole = piece.hi - piece.lo == param.size
        assert (param.grad is not None) == whole, name
        if stateful:
            assert param.update_rule.state, name
            for value in param.update_rule.state.values():
                assert value.size == piece.hi - piece.lo, name


@needs_chainer
@pytest.mark.parametrize('optimizer', sorted(OPTIMIZERS))
@pytest.mark.parametrize('hooks', sorted(HOOKS))
def test_sharded_updates_are_the_unsharded_bit_for_bit(comm_name, optimizer,
                                                       hooks):
    comm = mnopt.create_communicator(comm_name)
    try:
        plain, _ = _train(comm, OPTIMIZERS[optimizer], HOOKS[hooks], False,
                          3, exact=True)
        sharded, opt = _train(comm, OPTIMIZERS[optimizer], HOOKS[hooks],
                              True, 3, exact=True)
        a, b = _params(plain), _params(sharded)
        split = [n for n, ranks in opt.owners.items() if len(ranks) > 1]
        for name in a:
            if hooks == 'clipping' and split:
                # A parameter split between ranks: its squared norm is its
                # pieces' dots added, Chainer's one dot rounds otherwise.
                numpy.testing.assert_allclose(a[name], b[name], rtol=1e-6,
                                              atol=1e-7, err_msg=name)
            else:
                numpy.testing.assert_array_equal(a[name], b[name],
                                                 err_msg=name)
        # Every rank holds the same parameters.
        assert len(set(comm.allgather_obj(
            repr(sorted((n, v.tobytes()) for n, v in b.items()))))) == 1
        assert_only_pieces_hold_state(comm, opt, optimizer != 'SGD')
    finally:
        comm.finalize()


@needs_chainer
@pytest.mark.parametrize('optimizer', ['SGD', 'MomentumSGD', 'Adam'])
def test_sharded_training_on_real_gradients(comm_name, optimizer):
    """A real backward: gradients whose sums round.  Bit for bit where
    the reduce-scatter sums each element in the allreduce's order: one
    rank, two ranks (one a + b), and hierarchical (an MPI Reduce inside
    the node, then at most two node leaders).  flat and naive at three
    ranks sum some shares in another order than MPI's Allreduce (the
    ring starts chunk c at rank c + 1): within rounding."""
    comm = mnopt.create_communicator(comm_name)
    try:
        plain, _ = _train(comm, OPTIMIZERS[optimizer], HOOKS['clipping'],
                          False, 4, exact=False)
        sharded, _ = _train(comm, OPTIMIZERS[optimizer], HOOKS['clipping'],
                            True, 4, exact=False)
        a, b = _params(plain), _params(sharded)
        worst = max(float(abs(a[n] - b[n]).max()) for n in a)
        if comm.size <= 2 or comm_name == 'hierarchical':
            assert worst == 0.0
        else:
            # Measured 0 to a few 1e-8 (values of order 1e-1): the
            # rounding of a three-term sum, carried through 4 updates.
            assert worst < 1e-6
    finally:
        comm.finalize()


@needs_chainer
def test_state_is_one_share_per_rank():
    comm = mnopt.create_communicator('flat')
    try:
        _, plain = _train(comm, OPTIMIZERS['Adam'], HOOKS['none'], False, 1,
                          exact=True)
        _, sharded = _train(comm, OPTIMIZERS['Adam'], HOOKS['none'], True,
                            1, exact=True)
        assert_adam_state_is_one_share_per_rank(comm, plain, sharded)
    finally:
        comm.finalize()


def assert_adam_state_is_one_share_per_rank(comm, plain, sharded):
    """``sharded``'s Adam state, summed over the ranks, is ``plain``'s (an
    unsharded optimizer of the same model), and each rank's share is
    total/N within the alignment (Adam: two float32 arrays per
    element)."""
    total = sum(v.nbytes for p in plain.target.params()
                for v in p.update_rule.state.values())
    shares = comm.allgather_obj(sharded.state_nbytes())
    assert sum(shares) == total
    assert max(shares) <= total / comm.size + 2 * 4 * zero.ALIGN


@needs_chainer
def test_snapshot_resumes_bit_for_bit():
    comm = mnopt.create_communicator('flat')
    try:
        model, opt = _train(comm, OPTIMIZERS['Adam'], HOOKS['none'], True, 2,
                            exact=False)
        saved_model, saved_opt = {}, {}
        chainer.serializers.DictionarySerializer(saved_model).save(model)
        chainer.serializers.DictionarySerializer(saved_opt).save(opt)
        # The serializer keeps references: copy before training on.
        saved_model = {k: numpy.array(v) for k, v in saved_model.items()}
        saved_opt = {k: numpy.array(v) for k, v in saved_opt.items()}
        assert int(saved_opt['mnopt_shard/size']) == comm.size
        assert int(saved_opt['mnopt_shard/rank']) == comm.rank
        # Only this rank's share of the state is in the snapshot.
        mine = set(opt.owned_names())
        for name, _ in model.namedparams():
            key = name.lstrip('/') + '/m'
            assert (key in saved_opt) == (name in mine), key

        def more(model, opt):
            rng = numpy.random.RandomState(50 + comm.rank)
            for _ in range(3):
                x = rng.rand(4, 6).astype(numpy.float32)
                opt.update(lambda: chainer.functions.sum(model(x) ** 2))
            return _params(model)

        want = more(model, opt)
        model2 = _model(seed=1)
        opt2 = mnopt.create_multi_node_optimizer(
            OPTIMIZERS['Adam'](), comm, shard_state=True).setup(model2)
        chainer.serializers.NpzDeserializer(saved_model).load(model2)
        chainer.serializers.NpzDeserializer(saved_opt).load(opt2)
        got = more(model2, opt2)
        for name in want:
            numpy.testing.assert_array_equal(got[name], want[name], name)
        assert opt2.owners == opt.owners
    finally:
        comm.finalize()


def _saved_share(comm):
    model, opt = _train(comm, OPTIMIZERS['Adam'], HOOKS['none'], True, 1,
                        exact=True)
    saved = {}
    chainer.serializers.DictionarySerializer(saved).save(opt)
    return model, saved


@needs_chainer
def test_snapshot_of_another_number_of_ranks_is_an_error_everywhere():
    comm = mnopt.create_communicator('flat')
    try:
        model, saved = _saved_share(comm)
        if comm.rank == 0:   # rank 0's file says 'written on N+1 ranks'
            saved['mnopt_shard/size'] = numpy.array(comm.size + 1)
        opt = mnopt.create_multi_node_optimizer(
            OPTIMIZERS['Adam'](), comm, shard_state=True).setup(model)
        chainer.serializers.NpzDeserializer(saved).load(opt)
        with pytest.raises(ValueError, match='rank 0: the snapshot holds '
                           'rank 0\'s share of an optimizer sharded over %d '
                           'ranks' % (comm.size + 1)):
            opt.update()
    finally:
        comm.finalize()


@needs_chainer
def test_snapshot_loaded_on_some_ranks_only_is_an_error_everywhere():
    comm = mnopt.create_communicator('flat')
    try:
        model, saved = _saved_share(comm)
        opt = mnopt.create_multi_node_optimizer(
            OPTIMIZERS['Adam'](), comm, shard_state=True).setup(model)
        if comm.rank == 0:
            chainer.serializers.NpzDeserializer(saved).load(opt)
        if comm.size == 1:
            opt.update()   # one rank: it loaded its own share
            return
        with pytest.raises(RuntimeError, match='every rank must load its '
                           'own'):
            opt.update()
    finally:
        comm.finalize()


@needs_chainer
def test_an_unsharded_snapshot_loads_as_shares(comm_name):
    """Every rank loads the unsharded optimizer's snapshot and keeps its
    share: the run goes on as the unsharded one, bit for bit, and only the
    owners hold state."""
    comm = mnopt.create_communicator(comm_name)
    try:
        model, plain = _train(comm, OPTIMIZERS['Adam'], HOOKS['none'], False,
                              2, exact=True)
        saved = {}
        chainer.serializers.DictionarySerializer(saved).save(plain)
        saved = {k: numpy.array(v) for k, v in saved.items()}
        start = _params(model)

        def go_on(shard):
            model = _model()
            for name, param in model.namedparams():
                param.array[...] = start[name]
            opt = mnopt.create_multi_node_optimizer(
                OPTIMIZERS['Adam'](), comm, shard_state=shard).setup(model)
            # A copy: the loaded state arrays are the dict's own.
            chainer.serializers.NpzDeserializer(
                {k: numpy.array(v) for k, v in saved.items()}).load(opt)
            for step in range(3):
                for k, (name, param) in enumerate(
                        sorted(model.namedparams())):
                    param.grad = ((numpy.arange(param.size) % 5 * 0.25
                                   + k - step + comm.rank) * comm.size
                                  ).reshape(param.shape).astype(param.dtype)
                opt.update()
            return model, opt

        plain_model, _ = go_on(False)
        sharded_model, opt = go_on(True)
        a, b = _params(plain_model), _params(sharded_model)
        for name in a:
            numpy.testing.assert_array_equal(a[name], b[name], name)
        assert_only_pieces_hold_state(comm, opt)
    finally:
        comm.finalize()


def _old_format_shares(opt, old_size):
    """``opt``'s (an unsharded optimizer's) state as the shares of
    ``old_size`` ranks written before parameters were split (whole
    parameters per rank, ``mnopt_shard/owners``): each parameter's rule
    on rank k % old_size, k its place in name order."""
    full = {}
    chainer.serializers.DictionarySerializer(full).save(opt)
    names = sorted(n for n, _ in opt.target.namedparams())
    owners = [k % old_size for k in range(len(names))]
    shares = []
    for r in range(old_size):
        share = {'t': numpy.array(full['t']),
                 'epoch': numpy.array(full['epoch']),
                 'mnopt_shard/size': numpy.array(old_size),
                 'mnopt_shard/rank': numpy.array(r),
                 'mnopt_shard/names': numpy.array(names, dtype=str),
                 'mnopt_shard/owners': numpy.array(owners)}
        for name, owner in zip(names, owners):
            prefix = name.lstrip('/') + '/'
            if owner == r:
                share.update((k, numpy.array(v)) for k, v in full.items()
                             if k.startswith(prefix))
        shares.append(share)
    return shares


@needs_chainer
@pytest.mark.parametrize('old_size', [2, 3])
def test_a_snapshot_of_whole_parameter_ownership_still_loads(old_size):
    """Shares in the format of an earlier mnopt (whole parameters per
    rank), loaded at this number of ranks (the same or another) through
    load_shards: each rank's pieces of the state are the saved state's
    elements, and the training goes on as the unsharded optimizer's, bit
    for bit."""
    comm = mnopt.create_communicator('flat')
    try:
        model, plain = _train(comm, OPTIMIZERS['Adam'], HOOKS['none'], False,
                              2, exact=True)
        shares = _old_format_shares(plain, old_size)
        sharded_model = _model(seed=1)
        for name, param in sharded_model.namedparams():
            param.array[...] = dict(model.namedparams())[name].array
        opt = mnopt.create_multi_node_optimizer(
            OPTIMIZERS['Adam'](), comm, shard_state=True).setup(sharded_model)
        assert opt.load_shards(shares, path='') is None
        assert opt.actual_optimizer.t == plain.actual_optimizer.t
        for step in range(3):
            for m, o in ((model, plain), (sharded_model, opt)):
                for k, (name, param) in enumerate(sorted(m.namedparams())):
                    param.grad = ((numpy.arange(param.size) % 5 * 0.25
                                   + k - step + comm.rank) * comm.size
                                  ).reshape(param.shape).astype(param.dtype)
                o.update()
        a, b = _params(model), _params(sharded_model)
        for name in a:
            numpy.testing.assert_array_equal(a[name], b[name], name)
        assert_only_pieces_hold_state(comm, opt)
        for p in opt.pieces:
            if p.rank == comm.rank:
                rules = (dict(model.namedparams())[p.name].update_rule,
                         dict(sharded_model.namedparams())[p.name]
                         .update_rule)
                assert rules[0].t == rules[1].t
                for key, whole in rules[0].state.items():
                    numpy.testing.assert_array_equal(
                        rules[1].state[key], whole.reshape(-1)[p.lo:p.hi])
    finally:
        comm.finalize()


@needs_chainer
def test_ranks_with_different_parameter_sets_get_the_same_error():
    comm = mnopt.create_communicator('flat')
    try:
        if comm.size == 1:
            pytest.skip('needs two ranks')
        model = _model()
        if comm.rank == comm.size - 1:
            with model.init_scope():
                model.extra = chainer.Parameter(numpy.zeros(3, 'f'))
        opt = mnopt.create_multi_node_optimizer(
            OPTIMIZERS['Adam'](), comm, shard_state=True).setup(model)
        with pytest.raises(LayoutMismatchError):
            opt.update()   # the broadcast finds the sets differ
    finally:
        comm.finalize()


@needs_chainer
@pytest.mark.parametrize('kind, options, message', [
    ('reduction_server', {}, 'servers already hold the shards'),
    ('flat', {'compression': 'sign'}, "compression='sign'"),
])
def test_communicators_without_a_sharded_path_refuse(kind, options,
                                                     message):
    comm = mnopt.create_communicator(kind, **options)
    try:
        with pytest.raises(ValueError, match=message):
            mnopt.create_multi_node_optimizer(OPTIMIZERS['Adam'](), comm,
                                              shard_state=True)
    finally:
        comm.finalize()


@needs_chainer
def test_what_shard_state_does_not_combine_with(naive_comm):
    with pytest.raises(ValueError, match='double_buffering'):
        mnopt.create_multi_node_optimizer(
            OPTIMIZERS['Adam'](), naive_comm, double_buffering=True,
            shard_state=True)

    class WholeUpdate(chainer.optimizers.SGD):
        def update(self, lossfun=None, *args, **kwds):
            pass

    with pytest.raises(ValueError, match='per parameter'):
        mnopt.create_multi_node_optimizer(WholeUpdate(), naive_comm,
                                          shard_state=True)

    dynamic = OPTIMIZERS['Adam']()
    dynamic.loss_scaling()
    with pytest.raises(ValueError, match='dynamic loss scaling'):
        mnopt.create_multi_node_optimizer(dynamic, naive_comm,
                                          shard_state=True)


@needs_chainer
def test_a_hook_that_needs_every_gradient_is_an_error_everywhere(
        naive_comm):
    def global_hook(optimizer):
        pass

    model = _model()
    opt = mnopt.create_multi_node_optimizer(
        OPTIMIZERS['SGD'](), naive_comm, shard_state=True).setup(model)
    opt.add_hook(global_hook, name='global_hook')
    with pytest.raises(ValueError, match="rank 0: .*'global_hook'"):
        opt.update()


def test_pure_nccl_calls_exist():
    """No GPU here: the NCCL methods the sharded path calls exist in the
    installed CuPy (the core stack has it).  Unverified on a GPU."""
    nccl = pytest.importorskip('cupy.cuda.nccl')
    for method in ('reduceScatter', 'allGather'):
        assert hasattr(nccl.NcclCommunicator, method)
    assert nccl.NCCL_UINT8 == 1


@needs_chainer
@pytest.mark.parametrize('saver', ['default-sets', 'own-sets',
                                   'checkpointer'])
def test_trainer_resumes_from_per_rank_snapshots_bit_for_bit(saver):
    """multi_node_snapshot (with its default replica sets, which become
    one per rank for a sharded optimizer, or given so) with autoload, or
    the checkpointer: every rank writes its share, and the resumed run
    ends with the uninterrupted run's parameters and state, bit for
    bit."""
    import shutil
    import tempfile
    comm = mnopt.create_communicator('flat')
    out = comm.bcast_obj(tempfile.mkdtemp(prefix='mnopt-zero-')
                         if comm.rank == 0 else None)
    E = chainer.training.extensions

    def trainer(iterations, out_dir, autoload=False):
        model = chainer.links.Classifier(_model())
        rng = numpy.random.RandomState(comm.rank)
        x = rng.standard_normal((16, 6)).astype(numpy.float32)
        t = (x[:, 0] > 0).astype(numpy.int32)
        it = chainer.iterators.SerialIterator(
            chainer.datasets.TupleDataset(x, t), 4, shuffle=False)
        opt = mnopt.create_multi_node_optimizer(
            OPTIMIZERS['Adam'](), comm, shard_state=True).setup(model)
        tr = chainer.training.Trainer(
            chainer.training.StandardUpdater(it, opt),
            (iterations, 'iteration'), out=out_dir)
        if saver == 'checkpointer':
            ext = mnopt.extensions.create_multi_node_checkpointer(
                'zero', comm)
            if autoload:
                ext.maybe_load(tr, opt)
        else:
            ext = mnopt.extensions.multi_node_snapshot(
                comm, E.snapshot(autoload=autoload),
                None if saver == 'default-sets' else list(range(comm.size)))
        tr.extend(ext, trigger=(3, 'iteration'))
        return tr, ext, model

    def state(model):
        return {(n, k): v.copy() for n, p in sorted(model.namedparams())
                if p.update_rule.state for k, v in
                p.update_rule.state.items()}

    try:
        first, _, _ = trainer(6, out)
        first.run()
        comm.allgather_obj(None)
        import os
        names = os.listdir(out)
        if saver == 'checkpointer':
            assert all('cp-zero.6.rank%d.npz' % r in names
                       for r in range(comm.size))
        else:
            assert all('snapshot_iter_6.%d' % r in names
                       for r in range(comm.size))
        resumed, ext, model = trainer(10, out, autoload=True)
        if saver != 'checkpointer':
            ext.initialize(resumed)
        assert resumed.updater.iteration == 6
        resumed.run()
        whole, _, reference = trainer(10, out + '/whole')
        whole.run()
        for (name, a), (_, b) in zip(sorted(model.namedparams()),
                                     sorted(reference.namedparams())):
            numpy.testing.assert_array_equal(a.array, b.array, name)
        got, want = state(model), state(reference)
        assert sorted(got) == sorted(want) and got
        for key in want:
            numpy.testing.assert_array_equal(got[key], want[key], key)
    finally:
        comm.allgather_obj(None)
        if comm.rank == 0:
            shutil.rmtree(out, ignore_errors=True)
        comm.finalize()


@needs_chainer
def test_snapshot_sets_that_group_a_sharded_optimizers_ranks_are_refused():
    comm = mnopt.create_communicator('flat')
    try:
        model = chainer.links.Classifier(_model())
        opt = mnopt.create_multi_node_optimizer(
            OPTIMIZERS['Adam'](), comm, shard_state=True).setup(model)
        it = chainer.iterators.SerialIterator([(numpy.zeros(6, 'f'), 0)], 1)
        tr = chainer.training.Trainer(
            chainer.training.StandardUpdater(it, opt), (1, 'iteration'))
        ext = mnopt.extensions.multi_node_snapshot(
            comm, chainer.training.extensions.snapshot(),
            [list(range(comm.size))])
        if comm.size == 1:
            ext.initialize(tr)   # one rank: its own set
            return
        with pytest.raises(ValueError, match='group ranks, but the '
                                             'optimizer is sharded'):
            ext.initialize(tr)
    finally:
        comm.finalize()
