"""create_multi_node_optimizer(..., overlap=True): gradients averaged during
backward, bucket by bucket, and parameters bit-identical to the synchronous
optimizer's.  Runs serially and under mpiexec -n 2 / -n 3."""

import numpy
import pytest

chainer = pytest.importorskip(
    'chainer', reason='the Chainer layer (the numpy1 and numpy2 stacks run it)')
import chainer.functions as F  # NOQA
import chainer.links as L  # NOQA

import mnopt  # NOQA
from conftest import WORLD  # NOQA

# Also under mpiexec -n 3: the 16-bit ring case runs only above 2 ranks.
pytestmark = pytest.mark.many_ranks

STEPS = 20


class Net(chainer.Chain):
    """Convolution, batch normalisation and a linear classifier; options
    for the cases backward order alone does not cover."""

    def __init__(self, share=False, direct=False, skip_every=0):
        super(Net, self).__init__()
        self.share, self.direct, self.skip_every = share, direct, skip_every
        self.calls = 0
        with self.init_scope():
            self.conv1 = L.Convolution2D(2, 4, 3, pad=1)
            self.bn1 = L.BatchNormalization(4)
            self.conv2 = L.Convolution2D(4, 4, 3, pad=1)
            self.extra = L.Linear(4 * 6 * 6, 4 * 6 * 6)
            self.fc = L.Linear(4 * 6 * 6, 5)

    def forward(self, x, t):
        self.calls += 1
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.conv2(h))
        if self.share:               # the same link twice: weight sharing
            h = F.relu(self.conv2(h))
        h = F.reshape(h, (h.shape[0], -1))
        if not (self.skip_every and self.calls % self.skip_every == 0):
            h = F.tanh(self.extra(h))  # sometimes unused: zero-filled
        loss = F.softmax_cross_entropy(self.fc(h), t)
        if self.direct:              # a parameter used outside its link
            loss = loss + 1e-3 * F.sum(self.fc.W * self.fc.W)
        return loss


def batches(rank):
    rng = numpy.random.RandomState(1234 + rank)
    return [(rng.standard_normal((6, 2, 6, 6)).astype(numpy.float32),
             rng.randint(0, 5, 6).astype(numpy.int32)) for _ in range(STEPS)]


def train(comm_name, wire=None, overlap=False, net_options=None,
          zero_fill=True, **comm_options):
    comm = mnopt.create_communicator(comm_name, allreduce_grad_dtype=wire,
                                     bucket_bytes=600,   # many buckets
                                     **comm_options)
    numpy.random.seed(comm.rank)       # differing initial values: rank 0's
    model = Net(**(net_options or {}))   # are broadcast
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(lr=0.05), comm, overlap=overlap,
        zero_fill=zero_fill).setup(model)
    stats = []
    for x, t in batches(comm.rank):
        opt.update(model, x, t)
        if overlap:
            stats.append(opt.overlap_stats)
    params = {n: p.array.copy() for n, p in model.namedparams()}
    comm.finalize()
    return params, stats


def assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        numpy.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize('comm_name,wire', [
    ('naive', None), ('flat', None), ('hierarchical', None),
    ('reduction_server', None),
    ('hierarchical-2-per-node', None), ('reduction_server', 'float16'),
    ('reduction_server', 'bfloat16'), ('flat', 'float16')])
def test_overlap_is_bit_identical_to_synchronous(comm_name, wire,
                                                 monkeypatch):
    if comm_name == 'hierarchical-2-per-node':
        monkeypatch.setenv('MNOPT_RANKS_PER_NODE', '2')
        comm_name = 'hierarchical'
    sync, _ = train(comm_name, wire)
    overlapped, stats = train(comm_name, wire, overlap=True)
    if comm_name == 'flat' and wire and WORLD.size > 2:
        # Known limit (docs/limits.md): the 16-bit ring sums a segment
        # starting at the rank after it, rounding each partial sum to 16
        # bits; which segment an element falls in depends on its bucket,
        # so from 3 ranks on its rounding can differ.
        for name in sync:
            numpy.testing.assert_allclose(overlapped[name], sync[name],
                                          rtol=2e-2, atol=1e-3)
    else:
        assert_same(sync, overlapped)
    # From the third update on (the first broadcasts, the second makes the
    # plan), every bucket is handed over during backward.
    assert stats[5]['buckets'] > 3
    assert stats[5]['during_backward'] == stats[5]['buckets']


def test_a_bucket_closes_once_it_holds_bucket_bytes():
    # Three links of an 8x8 weight (256 bytes) and a bias (32): in backward
    # order b3 W3 | b2 W2 | b1 W1, each bias riding with its weight rather
    # than going alone (which would make 6 buckets).
    comm = mnopt.create_communicator('flat', bucket_bytes=256)
    model = chainer.Sequential(L.Linear(8, 8), F.relu, L.Linear(8, 8),
                               F.relu, L.Linear(8, 8))
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(), comm, overlap=True).setup(model)
    x = numpy.ones((2, 8), numpy.float32)
    for _ in range(3):
        opt.update(lambda: F.sum(model(x)))
    assert opt.overlap_stats == {'buckets': 3, 'during_backward': 3}
    comm.finalize()


@pytest.mark.parametrize('options', [
    {'share': True}, {'direct': True}, {'skip_every': 3}],
    ids=['weight-sharing', 'used-outside-its-link', 'sometimes-unused'])
def test_what_backward_order_cannot_vouch_for_still_averages_exactly(
        options):
    sync, _ = train('flat', net_options=options)
    overlapped, stats = train('flat', overlap=True, net_options=options)
    assert_same(sync, overlapped)
    assert stats[-1]['buckets'] > 0


def test_a_graph_differing_between_ranks_is_an_error_on_every_rank():
    if WORLD.size == 1:
        pytest.skip('needs two ranks')
    # Rank 1 skips a link that rank 0 uses: with zero_fill=False the
    # bucket holding it differs, and every rank is told.
    options = {'skip_every': 4} if WORLD.rank == 1 else {}
    with pytest.raises(mnopt.LayoutMismatchError):
        train('flat', overlap=True, net_options=options, zero_fill=False)


def test_plans_that_differ_between_ranks_are_an_error_on_every_rank():
    if WORLD.size == 1:
        pytest.skip('needs two ranks')
    options = {'share': True} if WORLD.rank == 1 else {}
    with pytest.raises(RuntimeError, match='forward passes differ'):
        train('flat', overlap=True, net_options=options)


def test_overlap_and_double_buffering_exclude_each_other():
    comm = mnopt.create_communicator('flat')
    with pytest.raises(ValueError, match='exclude each other'):
        mnopt.create_multi_node_optimizer(
            chainer.optimizers.SGD(), comm, double_buffering=True,
            overlap=True)
    comm.finalize()


def test_parameters_are_put_back_when_the_forward_pass_raises():
    comm = mnopt.create_communicator('flat')
    model = Net()
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(), comm, overlap=True).setup(model)
    x, t = batches(comm.rank)[0]
    opt.update(model, x, t)
    opt.update(model, x, t)

    def broken(x, t):
        model.conv1(x)
        raise KeyError('boom')
    with pytest.raises(KeyError):
        opt.update(broken, x, t)
    assert isinstance(model.conv1.W, chainer.Parameter)
    comm.finalize()


@pytest.mark.parametrize('comm_name', ['flat', 'reduction_server'])
def test_sign_compression_overlapped_keeps_ranks_identical(comm_name):
    """Each bucket votes on its own (its own residuals and coin), so the
    result is not the synchronous vote's; every rank still applies the
    same update."""
    params, stats = train(comm_name, overlap=True, compression='sign')
    assert stats[5]['during_backward'] == stats[5]['buckets'] > 3
    everyone = WORLD.allgather(params)
    for other in everyone[1:]:
        assert_same(everyone[0], other)
    assert all(numpy.isfinite(a).all() for a in params.values())


@pytest.mark.parametrize('wire', ['float16', 'bfloat16', 'float32'])
def test_a_ring_over_several_parts_gives_each_its_own_bits(wire):
    # The synchronous optimizer sums every bucket of its buffer in one
    # ring; the overlapped one sums bucket by bucket: an element must be
    # summed in the same order either way, whatever comes before its part.
    from mnopt.codecs import grad_buffer
    from mnopt.transport import ring
    dtype = grad_buffer.storage_dtype(wire)
    rng = numpy.random.RandomState(7 + WORLD.rank)
    sizes = [1, 7, 1000, 33, 4097]
    values = [rng.standard_normal(n).astype(numpy.float32) for n in sizes]
    parts = values if wire == 'float32' else [_to_wire(v, wire)
                                              for v in values]
    together = [p.copy() for p in parts]
    ring.allreduce_sum_parts(WORLD, together, wire)
    for part, summed in zip(parts, together):
        alone = part.copy()
        ring.allreduce_sum(WORLD, alone, wire)
        assert alone.dtype == dtype
        numpy.testing.assert_array_equal(summed, alone)


def _to_wire(values, wire):
    from mnopt.codecs import grad_buffer
    if wire == 'float16':
        return values.astype(numpy.float16)
    return grad_buffer.float32_to_bfloat16_bits(values)


def test_no_empty_gradient_set_is_averaged():
    """From the third update on every gradient is in a bucket: nothing is
    left for after backward, and no empty set is averaged (a collective
    and a layout check a step), timed by compression='auto''s guard or
    kept in its snapshot."""
    comm = mnopt.create_communicator('flat', bucket_bytes=600,
                                     compression='auto')
    model = Net()
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(lr=0.05), comm, overlap=True
    ).setup(model)
    averaged, average = [], comm.mean_grads_async

    def recorded(named, *args, **kwds):
        named = list(named)
        averaged.append([n for n, _ in named])
        return average(named, *args, **kwds)
    comm.mean_grads_async = recorded
    for x, t in batches(comm.rank)[:10]:
        opt.update(model, x, t)
    buckets = opt.overlap_stats['buckets']
    assert buckets > 3
    # The first two updates: everything after backward; then the buckets.
    assert len(averaged) == 2 + 8 * buckets
    assert [] not in averaged
    guard = comm.averaging.low_rank.guard
    sets = set(guard.choices) | set(guard.trials)
    assert len(guard.choices) == buckets   # each timed and decided
    assert all(names for _, names in sets), sets
    state = {}
    opt.serialize(chainer.serializers.DictionarySerializer(state))
    kept = [v for k, v in state.items() if 'choice_names' in k]
    assert len(kept) == len(guard.choices)
    assert all(len(names) for names in kept)
    comm.finalize()
