"""Uneven inputs (``mnopt.join``, DDP's ``Join``; docs/uneven_inputs.md):
ranks holding 5, 4 and 3 batches train to the end, those that ran out
shadowing the others with zero gradients, the mean over the contributors
at each update; the replicas end bit for bit the same and equal a
reference computed here on one process.  ``uneven='error'`` is an error
on every rank naming each rank's batches; refused modes and misuse are
one clear error on every rank.

Run serially and under mpiexec -n 2 and -n 3 (rank r holds BATCHES[r])."""

import numpy
import pytest

chainer = pytest.importorskip(
    'chainer', reason='the Chainer layer (the numpy1 and numpy2 stacks run it)')
import chainer.functions as F   # noqa: E402
import chainer.links as L   # noqa: E402

import mnopt   # noqa: E402
from conftest import WORLD   # noqa: E402

pytestmark = pytest.mark.many_ranks

RANK, SIZE = WORLD.rank, WORLD.size
BATCH, LR = 4, 0.1


class MLP(chainer.Chain):
    def __init__(self):
        super(MLP, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, 8, initialW=_weights(8, 6, 1))
            self.l2 = L.Linear(8, 3, initialW=_weights(3, 8, 2))

    def __call__(self, x, t):
        return F.softmax_cross_entropy(self.l2(F.tanh(self.l1(x))), t)


def _weights(rows, cols, seed):
    return numpy.random.RandomState(seed).normal(
        0, 0.5, (rows, cols)).astype(numpy.float32)


def batch(step, rank):
    rng = numpy.random.RandomState(100 * step + rank)
    return (rng.normal(0, 1, (BATCH, 6)).astype(numpy.float32),
            rng.randint(0, 3, BATCH).astype(numpy.int32))


def params(model):
    return {name: p.array.copy() for name, p in sorted(model.namedparams())}


def train(comm, counts, uneven='shadow', **options):
    """This rank's model after its ``counts[RANK]`` updates inside
    mnopt.join, and the join (its ``batches``)."""
    model = MLP()
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(lr=LR), comm, **options)
    opt.setup(model)
    opt.update()   # the first update broadcasts rank 0's parameters
    with mnopt.join(opt, uneven=uneven) as joined:
        for step in range(counts[RANK]):
            opt.update(model, *batch(step, RANK))
    return model, joined


def reference(counts):
    """SGD on one process: at each step the mean of the gradients of the
    ranks that still have a batch."""
    model = MLP()
    for step in range(max(counts)):
        grads = []
        for rank in [r for r in range(len(counts)) if counts[r] > step]:
            model.cleargrads()
            model(*batch(step, rank)).backward()
            grads.append(params_grads(model))
        for name, p in sorted(model.namedparams()):
            mean = sum(g[name] for g in grads) / numpy.float32(len(grads))
            p.array -= numpy.float32(LR) * mean
    return params(model)


def params_grads(model):
    return {name: p.grad.copy() for name, p in sorted(model.namedparams())}


def assert_replicas_identical(model):
    mine = params(model)
    for name, theirs in zip(sorted(mine), zip(*[
            [a for _, a in sorted(p.items())] for p in WORLD.allgather(mine)])):
        for r, array in enumerate(theirs):
            assert array.tobytes() == mine[name].tobytes(), \
                '%s differs between rank %d and rank %d' % (name, RANK, r)


@pytest.mark.parametrize('counts', [(5, 4, 3), (3, 3, 3), (2, 0, 1)],
                         ids=['5-4-3', 'even', 'a-rank-without-data'])
def test_ranks_that_ran_out_shadow_the_mean_over_contributors(comm_name,
                                                              counts):
    counts = counts[:SIZE]
    comm = mnopt.create_communicator(comm_name)
    try:
        model, joined = train(comm, counts)
    finally:
        comm.finalize()
    assert joined.batches == list(counts)
    assert_replicas_identical(model)
    expected = reference(counts)
    for name, array in params(model).items():
        numpy.testing.assert_allclose(array, expected[name], rtol=1e-5,
                                      atol=1e-6, err_msg=name)


def test_a_float16_wire_gives_the_mean_over_contributors():
    """The wire divides before it sums; the rescale comes after."""
    counts = (5, 4, 3)[:SIZE]
    comm = mnopt.create_communicator('flat', allreduce_grad_dtype='float16')
    try:
        model, joined = train(comm, counts)
    finally:
        comm.finalize()
    assert joined.batches == list(counts)
    assert_replicas_identical(model)
    expected = reference(counts)
    for name, array in params(model).items():
        numpy.testing.assert_allclose(array, expected[name], rtol=1e-2,
                                      atol=1e-3, err_msg=name)


def test_even_inputs_under_join_are_the_plain_loop_bit_for_bit(naive_comm):
    counts = (3,) * SIZE
    joined_model, _ = train(naive_comm, counts)
    model = MLP()
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(lr=LR), naive_comm)
    opt.setup(model)
    opt.update()
    for step in range(3):
        opt.update(model, *batch(step, RANK))
    for name, array in params(model).items():
        assert params(joined_model)[name].tobytes() == array.tobytes()


def test_uneven_error_names_every_ranks_batches_on_every_rank(naive_comm):
    counts = (5, 4, 3)[:SIZE]
    if SIZE == 1:
        _, joined = train(naive_comm, counts, uneven='error')
        assert joined.batches == [5]
        return
    said = {2: r'the data ran out on rank 1 after 4 batches, while rank 0 '
               r'went on to batch 5 '
               r'\(batches per rank: rank 0: 5, rank 1: 4 \(done\)\)',
            3: r'the data ran out on rank 2 after 3 batches, while ranks 0 '
               r'and 1 went on to batch 4 \(batches per rank: rank 0: 4, '
               r'rank 1: 4, rank 2: 3 \(done\)\)'}[SIZE]
    with pytest.raises(mnopt.UnevenInputsError, match=said) as caught:
        train(naive_comm, counts, uneven='error')
    assert 'mnopt.join(optimizer)' in str(caught.value)
    assert 'force_equal_length=True' in str(caught.value)


def test_the_error_leaves_the_replicas_identical_and_the_optimizer_usable(
        naive_comm):
    counts = (2,) + (1,) * (SIZE - 1)
    model = MLP()
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(lr=LR), naive_comm)
    opt.setup(model)
    opt.update()
    try:
        with mnopt.join(opt, uneven='error'):
            for step in range(counts[RANK]):
                opt.update(model, *batch(step, RANK))
    except mnopt.UnevenInputsError:
        assert SIZE > 1
    assert_replicas_identical(model)
    opt.update(model, *batch(9, RANK))   # no join: averages as ever
    assert_replicas_identical(model)


@pytest.mark.skipif(SIZE == 1, reason='needs a rank outside the join')
def test_a_rank_outside_the_join_is_an_error_on_every_rank(naive_comm):
    model = MLP()
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(lr=LR), naive_comm)
    opt.setup(model)
    opt.update()
    with pytest.raises(mnopt.UnevenInputsError,
                       match=r'ranks \[1(, 2)?\] update inside mnopt\.join'
                             r'\(optimizer\) but ranks \[0\] do not'):
        if RANK == 0:
            opt.update(model, *batch(0, RANK))
        else:
            with mnopt.join(opt):
                opt.update(model, *batch(0, RANK))


@pytest.mark.skipif(SIZE == 1, reason='needs two ranks to differ')
def test_a_mode_that_differs_is_an_error_on_every_rank(naive_comm):
    modes = ['error'] + ['shadow'] * (SIZE - 1)
    with pytest.raises(ValueError, match=r"differs across ranks \(rank 0: "
                                         r"'error', rank 1: 'shadow'"):
        train(naive_comm, (1,) * SIZE, uneven=modes[RANK])


@pytest.mark.parametrize('options, said', [
    ({'double_buffering': True}, 'not with double_buffering=True'),
    ({'overlap': True}, 'not with overlap=True'),
    ({'shard_state': True}, 'not with shard_state=True'),
    ({'shard_state': True, 'overlap': True}, 'not with shard_state=True'),
    ({'accumulation_steps': 2}, 'accumulation_steps=2'),
])
def test_modes_it_cannot_serve_are_refused(naive_comm, options, said):
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(lr=LR), naive_comm, **options)
    opt.setup(MLP())
    with pytest.raises(ValueError, match='mnopt.join .*' + said):
        mnopt.join(opt)


@pytest.mark.parametrize('compression, said', [
    ('sign', "compression='sign'"), ('powersgd', "compression='powersgd'"),
    ('auto', "compression='auto'"), ('hook', 'a registered comm hook')])
def test_every_compression_and_a_comm_hook_are_refused(compression, said):
    """Each value of the combination matrix's compression factor that it
    never pairs with mnopt.join (tests/test_combinations.py filters
    them): the same error on every rank."""
    from mnopt.communicators import comm_hooks
    comm = mnopt.create_communicator(
        'flat', compression=None if compression == 'hook' else compression)
    try:
        if compression == 'hook':
            comm.register_comm_hook(None, comm_hooks.allreduce_hook)
        opt = mnopt.create_multi_node_optimizer(
            chainer.optimizers.SGD(lr=LR), comm)
        opt.setup(MLP())
        errors = []
        try:
            mnopt.join(opt)
        except ValueError as e:
            errors.append(str(e))
        said_by = WORLD.allgather(errors)
        assert all(e and said in e[0] for e in said_by), said_by
        assert len({e[0] for e in said_by}) == 1, said_by
    finally:
        comm.finalize()


def test_compression_and_bad_arguments_are_refused(naive_comm):
    comm = mnopt.create_communicator('flat', compression='sign')
    try:
        opt = mnopt.create_multi_node_optimizer(
            chainer.optimizers.SGD(lr=LR), comm)
        with pytest.raises(ValueError, match="compression='sign'"):
            mnopt.join(opt)
    finally:
        comm.finalize()
    opt = mnopt.create_multi_node_optimizer(chainer.optimizers.SGD(),
                                            naive_comm)
    with pytest.raises(ValueError, match=r"takes 'shadow' or 'error'; "
                                         r"got 'drop'"):
        mnopt.join(opt, uneven='drop')
    with pytest.raises(ValueError, match='takes the optimizer '
                                         'create_multi_node_optimizer '
                                         'returned; got a SGD object'):
        mnopt.join(chainer.optimizers.SGD())
    opt.setup(MLP())
    with mnopt.join(opt):
        with pytest.raises(RuntimeError, match='already inside'):
            with mnopt.join(opt):
                pass
