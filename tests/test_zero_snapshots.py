"""A sharded optimizer's snapshots at their edges (mnopt/optimizers/zero/
snapshots.py): one written before the first applied update, shares of
two writes, a share given to an optimizer without shard_state; and a
link first used after some updates.  The model's first weight is split
between the ranks at 2 and 3 ranks.  Runs serially and under mpiexec -n 2
and -n 3."""

import numpy
import pytest

import mnopt

from conftest import chainer, needs_chainer

pytestmark = pytest.mark.many_ranks

if chainer is not None:   # the sharded optimizer is of the Chainer layer
    import chainer.links as L


def _model():
    """A Linear whose W spans the ranks, and a float16 parameter."""
    model = chainer.Chain()
    with model.init_scope():
        model.l = L.Linear(20, 7, initialW=0.125)
        model.h = chainer.Parameter(
            numpy.linspace(-1, 1, 37).astype(numpy.float16))
    return model


def _optimizer(comm, shard, model):
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.Adam(alpha=0.01, eps=1e-4), comm,
        shard_state=shard).setup(model)
    opt.add_hook(chainer.optimizer_hooks.WeightDecay(0.125))
    return opt


def _train(comm, model, opt, first, last):
    """Updates ``first``..``last - 1`` (update 0 broadcasts), with
    gradients N times a dyadic number: their means are exact in any
    summation order, so the sharded run is the unsharded one bit for
    bit."""
    for step in range(first, last):
        for k, (name, param) in enumerate(sorted(model.namedparams())):
            pattern = (numpy.arange(param.size) % 7 * 0.125 - 0.375
                       + 0.25 * k + 0.5 * step).reshape(param.shape)
            param.grad = ((pattern + comm.rank) * comm.size).astype(
                param.dtype)
        opt.update()


def _saved(thing):
    out = {}
    chainer.serializers.DictionarySerializer(out).save(thing)
    return {k: numpy.array(v) for k, v in out.items()}   # copies


def _load(saved, thing):
    chainer.serializers.NpzDeserializer(
        {k: numpy.array(v) for k, v in saved.items()}).load(thing)


def _params(model):
    return {n: p.array.copy() for n, p in model.namedparams()}


def _trained(comm, shard, updates):
    model = _model()
    opt = _optimizer(comm, shard, model)
    _train(comm, model, opt, 0, updates)
    return model, opt


def _resumed(comm, model_state, opt_state, first, last):
    """A sharded optimizer that loads ``opt_state`` and trains on."""
    model = _model()
    _load(model_state, model)
    opt = _optimizer(comm, True, model)
    _load(opt_state, opt)
    _train(comm, model, opt, first, last)
    return model, opt


@pytest.fixture
def comm():
    c = mnopt.create_communicator('flat')
    yield c
    c.finalize()


@needs_chainer
@pytest.mark.parametrize('written_by', ['sharded', 'unsharded'])
def test_a_snapshot_written_before_the_first_update_loads(comm, written_by):
    """Update 0 only broadcasts: the snapshot holds ``t`` per rule and no
    Adam m, v.  It loads (each rank its own share, or the unsharded
    snapshot on every rank) and the run goes on as the unsharded one."""
    model, opt = _trained(comm, written_by == 'sharded', 1)
    if written_by == 'sharded':   # W is split between the ranks
        assert len(opt.owners['/l/W']) == comm.size
    assert all(p.update_rule.state is None for p in model.params())
    saved_model, saved_opt = _saved(model), _saved(opt)
    want, _ = _trained(comm, False, 4)
    got, opt = _resumed(comm, saved_model, saved_opt, 1, 1)
    # The partition is the loaded one before the next update.
    assert opt.pieces and opt.owners['/l/W'] == tuple(range(comm.size))
    _train(comm, got, opt, 1, 4)
    want, got = _params(want), _params(got)
    for name in want:
        numpy.testing.assert_array_equal(got[name], want[name], name)


def _two_writes(comm):
    """Every rank's share of a write after update 2, and of one after
    update 3 of the same run, on every rank, and the model of the first."""
    model, opt = _trained(comm, True, 3)
    first, model_state = _saved(opt), _saved(model)
    _train(comm, model, opt, 3, 4)
    later = _saved(opt)
    return (comm.allgather_obj(first), comm.allgather_obj(later),
            model_state)


@needs_chainer
def test_shares_of_two_writes_are_refused_on_every_rank(comm):
    """Each rank loads its own share, rank 1's of a later write: an error
    on every rank naming the ranks of each write."""
    if comm.size < 2:
        pytest.skip('two ranks\' shares are needed')
    first, later, model_state = _two_writes(comm)
    mine = (later if comm.rank == 1 else first)[comm.rank]
    model = _model()
    _load(model_state, model)
    opt = _optimizer(comm, True, model)
    _load(mine, opt)
    with pytest.raises(RuntimeError, match=r'2 different writes .*: rank 0'
                       r'.*: rank 1\): load every rank\'s share of one '
                       r'write'):
        _train(comm, model, opt, 3, 4)


@needs_chainer
def test_resharding_from_shares_of_two_writes_is_refused(comm):
    """load_shards given every rank's share, share 1 of a later write:
    what is wrong is said by load_shards and by the next update, on every
    rank; the shares of one write re-shard, also without write ids (an
    earlier mnopt's)."""
    if comm.size < 2:
        pytest.skip('two ranks\' shares are needed')
    first, later, model_state = _two_writes(comm)
    mixed = [first[0], later[1]] + first[2:]
    model = _model()
    _load(model_state, model)
    opt = _optimizer(comm, True, model)
    problem = opt.load_shards(mixed, path='')
    assert problem is not None and '2 different writes' in problem
    with pytest.raises(ValueError, match='different writes'):
        _train(comm, model, opt, 3, 4)

    without_ids = [{k: v for k, v in share.items()
                    if k != 'mnopt_shard/write'} for share in first]
    for shares in (first, without_ids):
        model = _model()
        _load(model_state, model)
        opt = _optimizer(comm, True, model)
        assert opt.load_shards(shares, path='') is None
        _train(comm, model, opt, 3, 4)


@needs_chainer
def test_a_share_loaded_without_shard_state_is_an_error_on_every_rank(comm):
    model, opt = _trained(comm, True, 3)
    share = _saved(opt)
    plain = _optimizer(comm, False, _model())
    with pytest.raises(ValueError, match=r'written with shard_state=True.*'
                       r'load it with create_multi_node_optimizer\(\.\.\., '
                       r'shard_state=True\)'):
        _load(share, plain)


class _LazyNet(chainer.Chain if chainer is not None else object):
    def __init__(self):
        super(_LazyNet, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(4, 3, initialW=0.5)
            self.late = L.Linear(None, 3, initialW=0.25)

    def __call__(self, x, step):
        y = chainer.functions.sum(self.l1(x) * 0.75)
        if step >= 3:   # first used at the fourth update
            y += chainer.functions.sum(self.late(x) * 0.75)
        return y


@needs_chainer
@pytest.mark.parametrize('overlap', [False, True])
def test_a_link_first_used_later_is_updated_as_chainer_does(comm, overlap):
    """Chainer's update counts every parameter's rule, also one without
    data yet: Adam's bias correction of the late link starts from there,
    sharded as unsharded."""
    def run(shard):
        model = _LazyNet()
        opt = mnopt.create_multi_node_optimizer(
            chainer.optimizers.Adam(alpha=0.01), comm, shard_state=shard,
            overlap=shard and overlap).setup(model)
        x = numpy.full((2, 4), 0.5, numpy.float32)
        for step in range(7):
            # N times a dyadic gradient: exact means in any order.
            opt.update(lambda: model(x, step) * comm.size)
        return model, opt

    (plain, _), (sharded, opt) = run(False), run(True)
    for name, param in sharded.namedparams():
        numpy.testing.assert_array_equal(
            param.array, dict(plain.namedparams())[name].array, name)
    # 7 updates: the first and the late link's first use broadcast.  (A
    # rank holding no piece of it keeps no state: its t is not used.)
    assert plain.late.W.update_rule.t == 5
    if comm.rank in opt.owners['/late/W']:
        assert sharded.late.W.update_rule.t == 5
