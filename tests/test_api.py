"""ChainerMN's data-parallel API: ranks, collectives, objects, datasets,
the evaluator and the multi-node optimizer."""

import numpy
import pytest

import mnopt
from mnopt.transport import objects
from conftest import WORLD, chainer, make_model, needs_chainer

# Also under mpiexec -n 3: uneven fake nodes, split() into parts of 2 and 1.
pytestmark = pytest.mark.many_ranks


@pytest.fixture
def comm(comm_name):
    c = mnopt.create_communicator(comm_name)
    yield c
    c.finalize()


def test_ranks(comm):
    assert (comm.rank, comm.size) == (WORLD.rank, WORLD.size)
    # (node, rank in node) identifies a rank; sizes agree with the layout.
    ids = comm.allgather_obj((comm.inter_rank, comm.intra_rank,
                              comm.inter_size, comm.intra_size))
    assert len({i[:2] for i in ids}) == comm.size
    assert {i[2] for i in ids} == {len({i[0] for i in ids})}
    for node, _, _, intra_size in ids:
        assert intra_size == sum(1 for i in ids if i[0] == node)
    assert comm.mpi_comm is WORLD


def test_fake_nodes_from_environment(monkeypatch):
    monkeypatch.setenv('MNOPT_RANKS_PER_NODE', '2')
    c = mnopt.create_communicator('hierarchical')
    assert c.intra_rank == c.rank % 2
    assert c.inter_rank == c.rank // 2
    assert c.inter_size == (c.size + 1) // 2
    assert c.intra_size == min(2, c.size - c.rank // 2 * 2)


def test_bad_ranks_per_node(monkeypatch):
    monkeypatch.setenv('MNOPT_RANKS_PER_NODE', 'two')
    with pytest.raises(ValueError, match='MNOPT_RANKS_PER_NODE'):
        mnopt.create_communicator('flat')


@pytest.mark.parametrize('dtype', ['float16', 'float32', 'int32', 'float64'])
def test_array_collectives(comm, dtype):
    r, n = comm.rank, comm.size
    x = numpy.arange(6, dtype=dtype).reshape(2, 3) + r
    numpy.testing.assert_array_equal(
        comm.allreduce(x), numpy.arange(6).reshape(2, 3) * n + n * (n - 1) // 2)
    assert comm.allreduce(x).dtype == numpy.dtype(dtype)
    got = comm.bcast(x if r == 0 else None, root=0)
    numpy.testing.assert_array_equal(got, numpy.arange(6).reshape(2, 3))
    gathered = comm.gather(x, root=n - 1)
    if r == n - 1:
        for k, g in enumerate(gathered):
            numpy.testing.assert_array_equal(g, x - r + k)
    else:
        assert gathered is None
    for k, g in enumerate(comm.allgather(numpy.full(k + 1, r, dtype) if False
                                         else numpy.full(r + 1, r, dtype))):
        numpy.testing.assert_array_equal(g, numpy.full(k + 1, k, dtype))
    ys = comm.alltoall(tuple(numpy.full(k + 1, 10 * r + k, dtype)
                             for k in range(n)))
    for k, y in enumerate(ys):
        numpy.testing.assert_array_equal(y, numpy.full(r + 1, 10 * k + r, dtype))
    mine = comm.scatter([numpy.full(3, k, dtype) for k in range(n)]
                        if r == 0 else None)
    numpy.testing.assert_array_equal(mine, numpy.full(3, r, dtype))


def test_send_recv_ring(comm):
    r, n = comm.rank, comm.size
    if n == 1:
        pytest.skip('a ring needs two ranks')
    nxt, prv = (r + 1) % n, (r - 1) % n
    payload = (numpy.full((2, 2), r, numpy.float16), numpy.arange(r + 1))
    if r % 2 == 0:
        comm.send(payload, nxt, tag=7)
        got = comm.recv(prv, tag=7)
    else:
        got = comm.recv(prv, tag=7)
        comm.send(payload, nxt, tag=7)
    assert isinstance(got, tuple)
    numpy.testing.assert_array_equal(got[0], numpy.full((2, 2), prv))
    assert got[0].dtype == numpy.float16
    numpy.testing.assert_array_equal(got[1], numpy.arange(prv + 1))


def test_object_collectives_in_chunks(comm, monkeypatch):
    # Tiny chunks: the chunking that lets objects exceed 2 GiB is exercised.
    monkeypatch.setattr(objects, 'OBJ_CHUNK_BYTES', 7)
    r, n = comm.rank, comm.size
    obj = {'rank': r, 'blob': 'x' * (100 + r), 'arr': numpy.arange(r + 5)}
    got = comm.bcast_obj(obj if r == 0 else None)
    assert got['blob'] == 'x' * 100
    gathered = comm.gather_obj(obj)
    if r == 0:
        assert [g['rank'] for g in gathered] == list(range(n))
        assert [len(g['blob']) for g in gathered] == [100 + k for k in range(n)]
    assert [g['rank'] for g in comm.allgather_obj(obj)] == list(range(n))
    assert comm.allreduce_obj(r + 1) == n * (n + 1) // 2
    assert comm.scatter_obj(list(range(10, 10 + n)) if r == 0 else None) \
        == 10 + r
    if n > 1:
        if r == 0:
            comm.send_obj(obj, dest=1, tag=3)
        elif r == 1:
            back = comm.recv_obj(0, tag=3)
            numpy.testing.assert_array_equal(back['arr'], numpy.arange(5))


def test_split(comm):
    sub = comm.split(comm.rank % 2, comm.rank)
    assert type(sub) is type(comm)
    assert sub.size == len(range(comm.rank % 2, comm.size, 2))
    model = make_model([(3,)])
    model.p000.grad = numpy.full(3, comm.rank, numpy.float32)
    sub.multi_node_mean_grad(model)
    members = list(range(comm.rank % 2, comm.size, 2))
    numpy.testing.assert_allclose(model.p000.grad, numpy.mean(members))
    sub.finalize()


def test_bcast_data(comm):
    model = make_model([(2, 3), (4,)])
    for _, p in model.namedparams():
        p.array[...] = comm.rank + 1
    comm.bcast_data(model)
    for _, p in model.namedparams():
        numpy.testing.assert_array_equal(p.array, 1)


@needs_chainer
def test_scatter_dataset(comm):
    data = list(range(11)) if comm.rank == 0 else None
    mine = mnopt.scatter_dataset(data, comm, shuffle=True, seed=3)
    shards = comm.allgather_obj(list(mine))
    assert len({len(s) for s in shards}) == 1      # equal lengths
    assert set(sum(shards, [])) == set(range(11))  # nothing lost
    assert len(mine) == -(-11 // comm.size)


@needs_chainer
def test_scatter_dataset_without_padding(comm):
    data = list(range(10)) if comm.rank == 0 else None
    mine = mnopt.scatter_dataset(data, comm, force_equal_length=False)
    shards = comm.allgather_obj(list(mine))
    assert sum(shards, []) == list(range(10))


def test_multi_node_evaluator(comm):
    class Local(object):
        def evaluate(self):
            return {'main/loss': float(comm.rank), 'main/acc': 1.0}
    ev = mnopt.create_multi_node_evaluator(Local(), comm)
    assert ev.evaluate() == {'main/loss': (comm.size - 1) / 2.0,
                             'main/acc': 1.0}


def chainermn_mean(comm, value):
    """ChainerMN's create_multi_node_evaluator on one value: allreduce_obj,
    then divided by the number of ranks."""
    return comm.allreduce_obj(value) / comm.size


def evaluator_of(comm, results):
    class Local(object):
        def evaluate(self):
            return dict(results)
    return mnopt.create_multi_node_evaluator(Local(), comm)


def test_multi_node_evaluator_averages_as_chainermn(comm):
    """Scalars of every kind and arrays, each averaged as ChainerMN does
    (9df2620: float() of an array raised TypeError)."""
    k = comm.rank
    local = {'main/loss': numpy.float32(k) + numpy.float32(0.25),
             'main/per_class': numpy.arange(3, dtype=numpy.float32) * (k + 1),
             'main/matrix': numpy.full((2, 2), k, numpy.float64),
             'main/count': k, 'main/score': 0.5 * k}
    got = evaluator_of(comm, local).evaluate()
    assert sorted(got) == sorted(local)
    for key in sorted(local):
        expected = chainermn_mean(comm, local[key])
        assert type(got[key]) is type(expected), key
        numpy.testing.assert_array_equal(got[key], expected, err_msg=key)
    numpy.testing.assert_allclose(
        got['main/per_class'], numpy.arange(3) * (comm.size + 1) / 2.0)
    rank0 = comm.bcast_obj(got)             # the same on every rank
    for key in sorted(got):
        numpy.testing.assert_array_equal(got[key], rank0[key], err_msg=key)


@needs_chainer
def test_multi_node_evaluator_averages_variables(comm):
    local = {'main/loss': chainer.Variable(
        numpy.full((2,), comm.rank, numpy.float32))}
    got = evaluator_of(comm, local).evaluate()['main/loss']
    assert isinstance(got, chainer.Variable)
    numpy.testing.assert_array_equal(
        got.array, chainermn_mean(comm, local['main/loss']).array)
    numpy.testing.assert_allclose(got.array, (comm.size - 1) / 2.0)


def test_multi_node_evaluator_mismatch_raises_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip('a mismatch needs two ranks')
    keys = evaluator_of(comm, {'main/loss': 1.0,
                               'main/acc' if comm.rank else 'main/a': 1.0})
    with pytest.raises(ValueError, match='different keys'):
        keys.evaluate()
    # (1,) would broadcast against (3,): a wrong mean, not an error
    shapes = evaluator_of(comm, {'main/per_class': numpy.zeros(
        1 if comm.rank == 1 else 3)})
    with pytest.raises(ValueError, match=r"'main/per_class' with different "
                                         r"shapes: rank 0 \(3,\), rank 1 "
                                         r"\(1,\)"):
        shapes.evaluate()


@needs_chainer
def test_multi_node_optimizer(comm):
    """First update broadcasts rank 0's parameters; later ones apply the
    mean gradient (plain SGD, lr=1, so the step is exactly the mean)."""
    model = make_model([(3,), (2, 2)])
    for _, p in model.namedparams():
        p.array[...] = 10 * (comm.rank + 1)
    opt = mnopt.create_multi_node_optimizer(chainer.optimizers.SGD(lr=1.0),
                                            comm).setup(model)
    for _, p in model.namedparams():
        p.grad = numpy.full(p.shape, comm.rank, numpy.float32)
    opt.update()
    assert opt.t == 0
    for _, p in model.namedparams():
        numpy.testing.assert_array_equal(p.array, 10)  # rank 0's values
    for _, p in model.namedparams():
        p.grad = numpy.full(p.shape, 2 * comm.rank, numpy.float32)
    opt.update()
    assert opt.t == 1
    for _, p in model.namedparams():
        numpy.testing.assert_allclose(p.array, 10 - (comm.size - 1))
    opt.lr = 0.5           # attributes reach the wrapped optimizer
    assert opt.actual_optimizer.lr == 0.5


@needs_chainer
def test_multi_node_optimizer_with_lossfun(comm):
    model = chainer.links.Linear(3, 2)
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(lr=0.1), comm).setup(model)
    x = numpy.full((4, 3), comm.rank, numpy.float32)

    def loss():
        return chainer.functions.sum(model(x))
    opt.update(loss)        # broadcast
    opt.update(loss)        # mean gradient applied
    ws = comm.allgather(model.W.array)
    for w in ws:
        numpy.testing.assert_array_equal(w, ws[0])
    assert opt.t == 1


def test_unknown_communicator_lists_choices():
    with pytest.raises(ValueError, match='naive, flat, hierarchical, '
                                         'pure_nccl, reduction_server, auto'):
        mnopt.create_communicator('ring')


def test_unknown_dtype_lists_choices():
    with pytest.raises(ValueError, match='float16, bfloat16, float32'):
        mnopt.create_communicator('flat', allreduce_grad_dtype='int8')


def test_unknown_option_is_refused():
    with pytest.raises(TypeError):
        mnopt.create_communicator('flat', bucket_size=3)


def test_pure_nccl_says_what_is_missing():
    from mnopt.gpu import diagnosis
    if diagnosis.gpu_available():
        c = mnopt.create_communicator('pure_nccl')
        assert c.name == 'pure_nccl'
        assert mnopt.create_communicator().name == 'pure_nccl'
    else:
        with pytest.raises(RuntimeError, match="needs CuPy with NCCL and a "
                                               "GPU.*use 'flat'"):
            mnopt.create_communicator('pure_nccl')
        assert mnopt.create_communicator().name == 'flat'


def test_layout_mismatch_raises_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip('a mismatch needs two ranks (also run spawned below)')
    shapes = [(3,), (4,)] if comm.rank != 1 else [(3,), (5,)]
    model = make_model(shapes)
    for _, p in model.namedparams():
        p.grad = numpy.zeros(p.shape, numpy.float32)
    with pytest.raises(mnopt.LayoutMismatchError,
                       match=r"rank 0 vs rank 1\): gradient #1 is '/p001' "
                             r"\(4,\) float32 vs '/p001' \(5,\) float32"):
        comm.multi_node_mean_grad(model)
    with pytest.raises(mnopt.LayoutMismatchError, match='parameters'):
        comm.bcast_data(model)
    # The communicator is still usable after the error.
    ok = make_model([(2,)])
    ok.p000.grad = numpy.ones(2, numpy.float32)
    comm.multi_node_mean_grad(ok)
    numpy.testing.assert_array_equal(ok.p000.grad, 1)


def test_wire_dtype_mismatch_raises_on_every_rank():
    if WORLD.size == 1:
        pytest.skip('a mismatch needs two ranks (also run spawned below)')
    # Set apart after creation: create_communicator refuses different
    # wires itself (tests/test_settings_agreement.py).
    c = mnopt.create_communicator('flat')
    c.set_config('allreduce_grad_dtype',
                 'float16' if WORLD.rank else 'float32')
    model = make_model([(3,)])
    model.p000.grad = numpy.zeros(3, numpy.float32)
    with pytest.raises(mnopt.LayoutMismatchError, match='wire dtype'):
        c.multi_node_mean_grad(model)
