"""The training modes added since the first GPU run, with CuPy arrays on a
real GPU: sharded optimizer state (ZeRO stages 1 and 2) on every
communicator with a sharded path, mnopt's pipelined ring, and the
timeline of a GPU step.

Run as tests/test_gpu.py is (benchmarks/gpu_check.sh: serially and under
``mpiexec -n 2``/``-n 3``, the ranks sharing one GPU; without one they
skip, and ``MNOPT_REQUIRE_GPU=1`` turns the skip into a failure).
``pure_nccl`` runs at one rank only: NCCL refuses two ranks on one GPU.
"""

import numpy
import pytest

import mnopt
from conftest import WORLD, chainer, expected_mean, needs_chainer, rank_grads
from test_gpu import one_gpu_per_rank, same_bits, train_mlp_on_the_gpu
from test_zero import assert_adam_state_is_one_share_per_rank

SHARDED_COMMUNICATORS = ('naive', 'flat', 'hierarchical',
                         'hierarchical-2-per-node', 'pure_nccl')


@pytest.fixture(params=SHARDED_COMMUNICATORS)
def sharded_comm_name(request, monkeypatch, cupy):
    name = request.param
    if name == 'hierarchical-2-per-node':
        monkeypatch.setenv('MNOPT_RANKS_PER_NODE', '2')
        name = 'hierarchical'
    if name == 'pure_nccl':
        one_gpu_per_rank(cupy)
    return name


STEPS = 6


def _train(cupy, name, shard, overlap, steps=STEPS):
    """A GPU model trained with Adam from rank-dependent batches; its
    parameters (host copies), the optimizer and the communicator."""
    comm = mnopt.create_communicator(name, bucket_bytes=4096)  # buckets
    comm.skip_single_rank = False
    model, opt = train_mlp_on_the_gpu(
        cupy, comm, chainer.optimizers.Adam(alpha=0.01), steps,
        shard_state=shard, overlap=overlap)
    for _, p in model.namedparams():
        assert isinstance(p.array, cupy.ndarray)
    params = {n: cupy.asnumpy(p.array) for n, p in model.namedparams()}
    return params, opt, comm


@needs_chainer
def test_stage_1_on_the_gpu_is_the_unsharded_optimizer(cupy,
                                                       sharded_comm_name):
    """Bit for bit where every element's sum has one order (two ranks,
    hierarchical's node Reduce, one rank); within rounding for flat and
    naive at three ranks, as on the host (docs/zero.md, Exact)."""
    plain, _, comm = _train(cupy, sharded_comm_name, False, False)
    comm.finalize()
    sharded, opt, comm = _train(cupy, sharded_comm_name, True, False)
    try:
        worst = max(float(abs(plain[n] - sharded[n]).max()) for n in plain)
        if comm.size <= 2 or sharded_comm_name == 'hierarchical':
            assert worst == 0.0
        else:
            assert worst < 1e-6
        # Every rank holds the same bits; owners alone keep state.
        mine = repr(sorted((n, v.tobytes()) for n, v in sharded.items()))
        assert len(set(comm.allgather_obj(mine))) == 1
        for name, param in opt.target.namedparams():
            if comm.rank in opt.owners.get(name, ()):
                assert all(isinstance(v, cupy.ndarray)
                           for v in param.update_rule.state.values()), name
            else:
                assert param.update_rule.state is None, name
    finally:
        comm.finalize()


@needs_chainer
def test_stage_2_on_the_gpu_is_stage_1(cupy, sharded_comm_name):
    """overlap=True with shard_state=True: the buckets are reduce-scattered
    during backward, and the parameters end as stage 1's (bit for bit but
    on naive at three ranks, whose MPI Reduce_scatter picks its order by
    the size of the call)."""
    stage1, _, comm = _train(cupy, sharded_comm_name, True, False)
    comm.finalize()
    stage2, opt, comm = _train(cupy, sharded_comm_name, True, True)
    try:
        stats = opt.overlap_stats
        assert stats['buckets'] > 1
        assert stats['during_backward'] > 0
        worst = max(float(abs(stage1[n] - stage2[n]).max()) for n in stage1)
        if sharded_comm_name == 'naive' and comm.size >= 3:
            # MPI's Reduce_scatter picks each element's order by the call's
            # size: Adam's steps may differ by up to their size (as
            # tests/test_zero_stage2.py allows on the host).
            assert worst <= 0.01 * (STEPS - 1)
        else:
            for n in stage1:
                assert same_bits(stage1[n], stage2[n]), n
    finally:
        comm.finalize()


@needs_chainer
def test_the_state_on_the_gpu_is_one_share_per_rank(cupy):
    _, plain, plain_comm = _train(cupy, 'flat', False, False, steps=2)
    _, sharded, comm = _train(cupy, 'flat', True, False, steps=2)
    try:
        assert_adam_state_is_one_share_per_rank(comm, plain, sharded)
    finally:
        plain_comm.finalize()
        comm.finalize()


# Above the in-place threshold and the ring's 1 MiB: the pipelined ring
# carries the host staging buffer in many segments.
RING_SHAPES = [(300007,), (257, 1031), (5,)]


@pytest.mark.parametrize('wire', [None, 'float16', 'bfloat16'])
def test_the_pipelined_ring_takes_cupy_gradients(cupy, monkeypatch, wire):
    from test_mean_grad import tolerance
    monkeypatch.setenv('MNOPT_ALLREDUCE', 'ring')
    comm = mnopt.create_communicator('flat', allreduce_grad_dtype=wire,
                                     segment_bytes=16384)
    comm.skip_single_rank = False
    try:
        grads = [('/p%d' % i, cupy.asarray(g)) for i, g in
                 enumerate(rank_grads(RING_SHAPES, numpy.float32, comm.rank))]
        comm.mean_grads(grads)
        mine = b''.join(g.get().tobytes() for _, g in grads)
        assert len(set(comm.allgather_obj(mine))) == 1
        for (name, g), want in zip(grads, expected_mean(RING_SHAPES,
                                                        comm.size)):
            assert isinstance(g, cupy.ndarray) and g.dtype == numpy.float32
            err = numpy.abs(g.get().astype(numpy.float64) - want)
            assert (err <= tolerance('float32', wire, want)).all(), name
    finally:
        comm.finalize()


TIMELINE_PHASES = {'step', 'forward', 'backward', 'update', 'wire'}


@needs_chainer
@pytest.mark.parametrize('name', ['flat', 'pure_nccl'])
@pytest.mark.parametrize('mode', ['sync', 'double_buffering', 'overlap'])
def test_a_gpu_step_is_in_the_timeline(cupy, tmp_path, monkeypatch, name,
                                       mode):
    from mnopt.timeline import recorder as timeline
    if name == 'pure_nccl':
        one_gpu_per_rank(cupy)
    monkeypatch.setenv('MNOPT_SINGLE_RANK_AVERAGING', '1')
    template = str(tmp_path / 'trace.json')
    comm = mnopt.create_communicator(name, timeline=template)
    _, opt = train_mlp_on_the_gpu(   # the first update broadcasts
        cupy, comm, chainer.optimizers.SGD(lr=0.1), 4,
        double_buffering=(mode == 'double_buffering'),
        overlap=(mode == 'overlap'))
    if mode == 'double_buffering':
        opt.wait()
    comm.finalize()
    events = timeline.load(timeline.trace_path(template, WORLD.rank))
    spans = [e for e in events if e['ph'] == 'X']
    names = {e['name'] for e in spans}
    assert TIMELINE_PHASES <= names, sorted(names)
    assert len([e for e in spans if e['name'] == 'step']) == 4
    assert sum(e['args']['bytes'] for e in spans if e['name'] == 'wire') > 0
