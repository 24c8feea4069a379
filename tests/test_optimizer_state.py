"""The multi-node optimizer's state across snapshots, with a real model
(convolution, batch normalisation, linear) on every kind of optimizer:
plain, double-buffered and overlapped.  Runs serially and under mpiexec
-n 2 / -n 3.

- Replicas cannot diverge after a load: a snapshot loaded on every rank
  resumes bit for bit; one loaded (model, optimizer or both) on rank 0
  alone reaches every rank.
- A snapshot of one kind of optimizer (or of ChainerMN's, which is the
  wrapped optimizer's alone) loads into another; a double-buffered
  optimizer's gradients are never None after an update.
- With ``overlap=True``, sign compression's ``warmup_steps`` counts
  iterations, not buckets.
"""

import inspect
import io

import numpy
import pytest

chainer = pytest.importorskip(
    'chainer', reason='the Chainer layer (the numpy1 and numpy2 stacks run it)')
import chainer.functions as F  # NOQA
import chainer.links as L  # NOQA

import mnopt  # NOQA

KINDS = ('plain', 'double_buffering', 'overlap')


class Net(chainer.Chain):
    """Convolution, batch normalisation and a linear classifier."""

    def __init__(self):
        super(Net, self).__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(2, 4, 3, pad=1)
            self.bn = L.BatchNormalization(4)
            self.fc = L.Linear(4 * 6 * 6, 5)

    def forward(self, x, t):
        h = F.relu(self.bn(self.conv(x)))
        return F.softmax_cross_entropy(self.fc(h), t)


def batches(rank, n=6):
    rng = numpy.random.RandomState(1234 + rank)
    return [(rng.standard_normal((6, 2, 6, 6)).astype(numpy.float32),
             rng.randint(0, 5, 6).astype(numpy.int32)) for _ in range(n)]


def make(comm, kind, seed):
    """A model initialised from ``seed`` (per rank: replicas start out
    different) and its multi-node optimizer of ``kind``."""
    numpy.random.seed(seed)
    model = Net()
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(lr=0.05), comm,
        double_buffering=kind == 'double_buffering',
        overlap=kind == 'overlap').setup(model)
    return model, opt


def train(opt, model, data):
    for x, t in data:
        opt.update(model, x, t)


def to_npz(obj):
    """``obj`` saved as Chainer's updater saves it: an npz file's bytes."""
    f = io.BytesIO()
    chainer.serializers.save_npz(f, obj)
    return f.getvalue()


def load(npz, obj):
    chainer.serializers.load_npz(io.BytesIO(npz), obj)


def params(model):
    return {n: p.array.copy() for n, p in model.namedparams()}


def state(opt):
    saved = {}
    opt.serialize(chainer.serializers.DictionarySerializer(saved))
    return saved


def assert_same(a, b, what):
    assert sorted(a) == sorted(b), what
    for name in a:
        numpy.testing.assert_array_equal(a[name], b[name],
                                         err_msg='%s %s' % (what, name))


def assert_replicas_agree(comm, model, opt):
    """Every rank holds rank 0's parameters and optimizer state."""
    for r, (p, s) in enumerate(comm.allgather_obj((params(model),
                                                   state(opt)))):
        assert_same(p, params(model), 'parameters of rank %d vs %d'
                    % (r, comm.rank))
        assert_same(s, state(opt), 'optimizer state of rank %d vs %d'
                    % (r, comm.rank))


def interrupted(comm, kind, data):
    """Three updates from per-rank initial values, then a snapshot of the
    optimizer and of the model; and the optimizer's t then."""
    model, opt = make(comm, kind, comm.rank)
    train(opt, model, data[:3])
    return to_npz(opt), to_npz(model), opt.t


# ------------------------------------------------------------ item 2

@pytest.mark.parametrize('kind', KINDS)
def test_resume_on_every_rank_continues_bit_for_bit(kind):
    comm = mnopt.create_communicator('flat')
    data = batches(comm.rank)
    whole, opt = make(comm, kind, comm.rank)
    train(opt, whole, data)
    saved_opt, saved_model, _ = interrupted(comm, kind, data)
    resumed, opt = make(comm, kind, 100 + comm.rank)
    load(saved_opt, opt)          # in the order Chainer's updater uses
    load(saved_model, resumed)
    train(opt, resumed, data[3:])
    assert_same(params(whole), params(resumed), 'resumed vs uninterrupted')
    assert_replicas_agree(comm, resumed, opt)
    comm.finalize()


@pytest.mark.parametrize('kind', KINDS)
def test_weights_loaded_on_rank_0_alone_reach_every_rank(kind):
    """Every rank loads the optimizer, only rank 0 the model: the others'
    own initial weights must not survive (at 9df2620 they did, silently,
    for ever)."""
    comm = mnopt.create_communicator('flat')
    data = batches(comm.rank)
    saved_opt, saved_model, t = interrupted(comm, kind, data)
    resumed, opt = make(comm, kind, 100 + comm.rank)
    load(saved_opt, opt)
    if comm.rank == 0:
        load(saved_model, resumed)
    train(opt, resumed, data[3:])
    assert_replicas_agree(comm, resumed, opt)
    # At more than one rank the weights differed: the first update after
    # the load broadcast them and applied nothing, as any broadcast does.
    assert opt.t == t + (3 if comm.size == 1 else 2)
    comm.finalize()


@pytest.mark.parametrize('kind', KINDS)
def test_a_snapshot_loaded_on_rank_0_alone_reaches_every_rank(kind):
    """Only rank 0 loads anything (the others start afresh, with other
    weights and no optimizer state): every rank ends with rank 0's
    parameters and optimizer state (9df2620: an error at -n 2)."""
    comm = mnopt.create_communicator('flat')
    data = batches(comm.rank)
    saved_opt, saved_model, t = interrupted(comm, kind, data)
    resumed, opt = make(comm, kind, 100 + comm.rank)
    if comm.rank == 0:
        load(saved_opt, opt)
        load(saved_model, resumed)
    train(opt, resumed, data[3:])
    assert_replicas_agree(comm, resumed, opt)
    assert opt.t == t + (3 if comm.size == 1 else 2)
    comm.finalize()


@pytest.mark.parametrize('kind', KINDS)
def test_optimizer_state_loaded_on_rank_0_alone_resumes_bit_for_bit(kind):
    """The model everywhere, the optimizer on rank 0 alone: the weights
    agree, so rank 0's optimizer state (momentum, t, pending means) is
    given to the others and the run continues as if never interrupted."""
    comm = mnopt.create_communicator('flat')
    data = batches(comm.rank)
    whole, opt = make(comm, kind, comm.rank)
    train(opt, whole, data)
    saved_opt, saved_model, _ = interrupted(comm, kind, data)
    resumed, opt = make(comm, kind, 100 + comm.rank)
    if comm.rank == 0:
        load(saved_opt, opt)
    load(saved_model, resumed)
    train(opt, resumed, data[3:])
    assert_same(params(whole), params(resumed), 'resumed vs uninterrupted')
    assert_replicas_agree(comm, resumed, opt)
    comm.finalize()


# ------------------------------------------------------------ item 9

@pytest.mark.parametrize('writer,reader', [
    ('plain', 'double_buffering'), ('chainermn', 'double_buffering'),
    ('overlap', 'double_buffering'), ('double_buffering', 'plain'),
    ('double_buffering', 'overlap')])
def test_a_snapshot_loads_into_another_kind(writer, reader):
    """A snapshot without the double-buffered optimizer's keys (a plain
    one's, or ChainerMN's: the wrapped optimizer's alone) loads into a
    double-buffered optimizer with nothing pending: ``needs_update``
    False, ``communicated_target`` empty, so its next update averages and
    applies nothing.  A plain or overlapped optimizer ignores those keys
    and applies every update."""
    comm = mnopt.create_communicator('flat')
    data = batches(comm.rank)
    model, opt = make(comm, 'plain' if writer == 'chainermn' else writer,
                      comm.rank)
    train(opt, model, data[:3])
    saved_opt = to_npz(opt.actual_optimizer if writer == 'chainermn'
                       else opt)
    saved_model = to_npz(model)
    resumed, opt = make(comm, reader, 100 + comm.rank)
    load(saved_opt, opt)
    load(saved_model, resumed)
    t = opt.t
    if reader == 'double_buffering':
        assert opt.needs_update is False
        assert opt.communicated_target == {}
    train(opt, resumed, data[3:])
    assert opt.t == t + (2 if reader == 'double_buffering' else 3)
    assert_replicas_agree(comm, resumed, opt)
    comm.finalize()


def test_double_buffered_gradients_are_never_none():
    """After each update a parameter's gradient is the mean that update
    applied: zeros while the pipeline fills (9df2620: None), then the
    previous iteration's mean.  (ChainerMN leaves the broadcast
    iteration's local gradients there.)"""
    comm = mnopt.create_communicator('flat')
    model, opt = make(comm, 'double_buffering', comm.rank)
    for k, (x, t) in enumerate(batches(comm.rank)):
        opt.update(model, x, t)
        for name, p in model.namedparams():
            assert p.grad is not None, '%s after update %d' % (name, k)
            if k == 1:     # averaging started, nothing applied
                numpy.testing.assert_array_equal(p.grad, 0, err_msg=name)
        if k >= 2:
            opt.wait()
    comm.finalize()


# ------------------------------------------------------------ item 11

WARMUP = 3


def train_with_history(kind, **comm_options):
    comm = mnopt.create_communicator('flat', bucket_bytes=1,  # 6 buckets
                                     **comm_options)
    model, opt = make(comm, kind, comm.rank)
    history = []
    for x, t in batches(comm.rank, WARMUP + 2):
        opt.update(model, x, t)
        history.append(params(model))
    buckets = opt.overlap_stats['buckets'] if kind == 'overlap' else None
    comm.finalize()
    return history, buckets


def test_overlap_warm_up_counts_iterations_not_buckets():
    """``warmup_steps=3``: the first 3 applied updates are exact means
    under overlap=True as without it, however many buckets an update
    averages; the 4th is sign-compressed."""
    exact, _ = train_with_history('plain')
    signs = dict(compression='sign', warmup_steps=WARMUP)
    synchronous, _ = train_with_history('plain', **signs)
    overlapped, buckets = train_with_history('overlap', **signs)
    assert buckets > 2
    # Update 0 broadcasts; updates 1..WARMUP apply exact means.
    for k in range(WARMUP + 1):
        assert_same(exact[k], synchronous[k], 'synchronous, update %d' % k)
    comm = mnopt.create_communicator('flat')
    takes_iteration = 'iteration' in inspect.signature(
        comm.mean_grads_async).parameters
    comm.finalize()
    assert takes_iteration, (
        'mnopt/communicators/base.py: mean_grads_async(..., iteration=) '
        'is what lets overlap count warm-up by iteration (the change the '
        'issue 21 item 11 report asks of base.py)')
    for k in range(WARMUP + 1):
        assert_same(exact[k], overlapped[k], 'overlapped, update %d' % k)
    last = WARMUP + 1   # compressed, with overlap as without
    for history in (synchronous, overlapped):
        assert any(not numpy.array_equal(history[last][n], exact[last][n])
                   for n in exact[last])
