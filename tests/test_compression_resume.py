"""Compression's state in a snapshot: a run stopped and resumed from the
multi-node optimizer's snapshot (each rank its own file) continues bit for
bit like the uninterrupted run: each rank's error-feedback residuals, the
communicator's averaging counter (warm-up, the votes' coin), PowerSGD's
warm Qs and the choices of compression='auto' travel with it.  Sign
votes, PowerSGD and 'auto'; plain, double-buffered and overlapped
optimizers.

Runs serially and under mpiexec -n 2 / -n 3."""


import numpy
import pytest

import mnopt
from conftest import WORLD, chainer, mnopt_records, needs_chainer

pytestmark = needs_chainer

MODES = {'plain': {}, 'double_buffering': {'double_buffering': True},
         'overlap': {'overlap': True}}
STOP, MORE = 4, 4   # updates before the snapshot, and after it
#: Updates before the snapshot of 'auto': after its choices (each
#: gradient set's four timed averagings; double buffering's lag one
#: update behind), which a resume before them would make anew.
AUTO_STOP = STOP + 2
COMPRESSIONS = ['sign', 'powersgd', 'auto']
#: How each names the residuals it restarts at zero.
RESIDUALS = {'sign': 'sign compression', 'powersgd': 'PowerSGD'}


class _Holder(object):
    """The model and the optimizer in one snapshot file."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def serialize(self, serializer):
        self.model.serialize(serializer['model'])
        self.optimizer.serialize(serializer['optimizer'])


def _setup(mode, compression, **comm_options):
    import chainer.links as L
    comm = mnopt.create_communicator('flat', compression=compression,
                                     bucket_bytes=64, **comm_options)
    numpy.random.seed(7 + WORLD.rank)   # replicas differ until broadcast
    model = chainer.Sequential(L.Linear(5, 9), chainer.functions.relu,
                               L.Linear(9, 3))
    optimizer = mnopt.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(lr=0.05), comm, **MODES[mode])
    optimizer.setup(model)
    return comm, model, optimizer


def _train(model, optimizer, first, count):
    F = chainer.functions
    for i in range(first, first + count):
        rng = numpy.random.RandomState(1000 * i + WORLD.rank)
        x = rng.standard_normal((6, 5)).astype(numpy.float32)
        t = rng.randint(0, 3, 6).astype(numpy.int32)
        optimizer.update(lambda x, t: F.softmax_cross_entropy(model(x), t),
                         x, t)


def _params(model):
    return [(n, p.array.copy()) for n, p in sorted(model.namedparams())]


def _snapshot_path(tmp_path, name):
    # tmp_path differs per rank (one process each): broadcast rank 0's.
    base = WORLD.bcast(str(tmp_path) if WORLD.rank == 0 else None, root=0)
    return '%s/%s-rank%d.npz' % (base, name, WORLD.rank)


def _run(mode, tmp_path, edit=None, compression='sign', **comm_options):
    """(uninterrupted run's parameters, resumed run's)."""
    stop = AUTO_STOP if compression == 'auto' else STOP
    comm, model, optimizer = _setup(mode, compression, **comm_options)
    _train(model, optimizer, 0, stop)
    path = _snapshot_path(tmp_path, mode)
    chainer.serializers.save_npz(path, _Holder(model, optimizer))
    if compression == 'auto':   # the choices this test is about
        assert comm.averaging.low_rank.guard.choices
    _train(model, optimizer, stop, MORE)
    if hasattr(optimizer, 'wait'):
        optimizer.wait()
    straight = _params(model)
    comm.finalize()

    if edit is not None:
        edit(path)
    comm, model, optimizer = _setup(mode, compression, **comm_options)
    chainer.serializers.load_npz(path, _Holder(model, optimizer))
    _train(model, optimizer, stop, MORE)
    if hasattr(optimizer, 'wait'):
        optimizer.wait()
    resumed = _params(model)
    comm.finalize()
    return straight, resumed


def _differing(straight, resumed):
    assert [n for n, _ in straight] == [n for n, _ in resumed]
    return [n for (n, a), (_, b) in zip(straight, resumed)
            if a.tobytes() != b.tobytes()]


@pytest.mark.parametrize('compression', COMPRESSIONS)
@pytest.mark.parametrize('mode', sorted(MODES))
def test_resume_is_bit_identical(mode, compression, tmp_path):
    straight, resumed = _run(mode, tmp_path, compression=compression)
    assert _differing(straight, resumed) == []


@pytest.mark.parametrize('compression', ['sign', 'powersgd'])
@pytest.mark.parametrize('mode', ['plain'])
def test_resume_with_warmup_is_bit_identical(mode, compression, tmp_path):
    # The snapshot falls inside the warm-up: the counter decides when
    # compression starts.
    straight, resumed = _run(mode, tmp_path, compression=compression,
                             warmup_steps=STOP + 1)
    assert _differing(straight, resumed) == []


def test_old_snapshot_without_compression_state_loads(tmp_path):
    """A snapshot without the compression state (older mnopt, ChainerMN)
    still loads strictly; the residuals start at zero, as before."""
    def strip(path):
        with numpy.load(path) as npz:
            kept = {k: npz[k] for k in npz.files
                    if 'mnopt_compression' not in k}
        assert len(kept) < len(numpy.load(path).files)
        numpy.savez(path, **kept)

    straight, resumed = _run('plain', tmp_path, edit=strip)
    for _, a in resumed:
        assert numpy.isfinite(a).all()


@pytest.mark.parametrize('compression', sorted(RESIDUALS))
@pytest.mark.parametrize('mode', sorted(MODES))
def test_one_replica_set_resumes_with_rank_0s_file(mode, compression,
                                                   tmp_path):
    """Every rank loads rank 0's file (one replica set): residuals are
    rank-local, so only rank 0 takes its own; the others start theirs at
    zero.  The run goes on, the replicas agreeing."""
    def rank_0s(path):
        mine = path.replace('-rank%d.npz' % WORLD.rank, '-rank0.npz')
        WORLD.Barrier()
        if WORLD.rank != 0:
            with open(mine, 'rb') as f, open(path, 'wb') as out:
                out.write(f.read())
        WORLD.Barrier()

    with mnopt_records() as records:
        straight, resumed = _run(mode, tmp_path, edit=rank_0s,
                                 compression=compression)
    said = [r.getMessage() for r in records
            if 'residuals restart at zero' in r.getMessage()]
    # Every rank but 0 is told its residuals were not in the file it read.
    assert said == ([] if WORLD.rank == 0 else [
        'mnopt: warning: rank %d loaded the snapshot of rank 0 of %d: its '
        '%s residuals restart at zero, so the resumed run is not the '
        'uninterrupted one bit for bit (give each rank a replica set of its '
        'own for an exact resume)' % (WORLD.rank, WORLD.size,
                                      RESIDUALS[compression])]), said
    everyone = WORLD.allgather([a.tobytes() for _, a in resumed])
    assert all(r == everyone[0] for r in everyone)
    if WORLD.size == 1:
        assert _differing(straight, resumed) == []


@pytest.mark.parametrize('compression', sorted(RESIDUALS))
def test_a_snapshot_of_another_rank_count_says_so(compression, tmp_path):
    """Every rank's residuals restart at zero on another number of ranks
    (the files say one more rank wrote them): the warning says that the
    number changed, not to give each rank a replica set of its own."""
    def one_more_rank(path):
        with numpy.load(path) as npz:
            saved = {k: npz[k] for k in npz.files}
        sizes = [k for k in saved if 'mnopt_compression' in k and
                 k.endswith('/size')]
        assert sizes
        for k in sizes:
            saved[k] = saved[k] + 1
        numpy.savez(path, **saved)

    with mnopt_records() as records:
        _run('plain', tmp_path, edit=one_more_rank, compression=compression)
    said = [r.getMessage() for r in records
            if 'residuals restart at zero' in r.getMessage()]
    assert said == [
        'mnopt: warning: rank %d loaded the snapshot of rank %d of %d: its '
        '%s residuals restart at zero, so the resumed run is not the '
        "uninterrupted one bit for bit (the snapshot's job had %d ranks, "
        "this one %d: the residuals are each rank's own, not split anew "
        'over another number of ranks)' % (
            WORLD.rank, WORLD.rank, WORLD.size + 1, RESIDUALS[compression],
            WORLD.size + 1, WORLD.size)], said


def test_communicator_state_round_trip():
    """serialize_compression alone: the counter and this rank's residuals
    come back; residuals are kept until their layout's codec is built."""
    import chainer.links as L
    comm = mnopt.create_communicator('flat', compression='sign')
    model = L.Linear(3, 4)
    rng = numpy.random.RandomState(WORLD.rank)
    for _, p in model.namedparams():
        p.grad = rng.standard_normal(p.array.shape).astype(numpy.float32)
    comm.multi_node_mean_grad(model)
    state = {}
    comm.serialize_compression(
        chainer.serializers.DictionarySerializer(state))
    assert int(state['steps']) == 1

    other = mnopt.create_communicator('flat', compression='sign')
    other.serialize_compression(chainer.serializers.NpzDeserializer(state))
    assert other.steps == 1
    again = {}
    other.serialize_compression(
        chainer.serializers.DictionarySerializer(again))   # not yet built
    assert sorted(again) == sorted(state)
    for key in state:
        assert numpy.array_equal(state[key], again[key]), key
    comm.finalize()
    other.finalize()
