"""Every GPU path, on a real GPU: the codec's kernels against the host
codec, pure_nccl through the optimizer, CuPy gradients through every CPU
communicator and sign compression, double buffering on CUDA streams,
overlap, and the ImageNet example.

Without a GPU these skip, saying what is missing; ``MNOPT_REQUIRE_GPU=1``
(set by benchmarks/gpu_check.sh, which runs this module on the GPU machine
serially and under ``mpiexec -n 2`` and ``-n 3``, the ranks sharing its one
GPU) turns the skip into a failure.  One GPU means NCCL runs at N=1 only:
NCCL refuses two ranks on one GPU.
"""

import os

import numpy
import pytest

import mnopt
from mnopt.codecs import grad_buffer
from mnopt.communicators import pure_nccl
from conftest import (REPO, WORLD, chainer, expected_mean, make_model,
                      needs_chainer, rank_grads, run_mpi,
                      snapshot_models_equal)
from gpu_spin import spin_kernel



GRAD_DTYPES = ('float16', 'float32', 'float64')
WIRES = (None, 'float16', 'bfloat16', 'float32', 'float64')
# Odd sizes, an empty array, one element, several launches' worth.
SHAPES = [(3,), (0,), (1,), (5, 7), (2, 3, 5), (1023,), (4099,), (70001,)]


def awkward_values(n, dtype, seed):
    """Normal values at many scales, with the ones codecs get wrong: signed
    zeros, float16's limits and subnormals, bfloat16 rounding ties, values
    that overflow float16 when cast, inf and NaN."""
    rng = numpy.random.RandomState(seed)
    x = rng.standard_normal(n) * 10.0 ** rng.randint(-9, 6, n)
    special = numpy.array([
        0.0, -0.0, 1.0, -1.5, 65504.0, 65519.0, 65520.0, -70000.0, 6e-8,
        3e-8, 1e-5, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.0e38,
        numpy.inf, -numpy.inf, numpy.nan])
    where = rng.rand(n) < 0.2
    x[where] = special[rng.randint(0, len(special), where.sum())]
    with numpy.errstate(over='ignore'):
        return x.astype(dtype)


def same_bits(a, b):
    """Bit-identical, where any NaN equals any NaN (payloads may differ)."""
    a, b = numpy.asarray(a), numpy.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind == 'f':
        nan = numpy.isnan(a)
        if (nan != numpy.isnan(b)).any():
            return False
        a, b = a[~nan], b[~nan]
    return a.tobytes() == b.tobytes()


def wire_values(buffer):
    """A buffer's wire as comparable numbers (bfloat16 bits as float32)."""
    host = buffer.wire if buffer.xp is numpy else buffer.wire.get()
    if buffer.layout.wire == 'bfloat16':
        return grad_buffer.bfloat16_bits_to_float32(host)
    return host


# ------------------------------------------------------------ no GPU needed

def test_pure_nccl_makes_no_nccl_communicator_until_the_first_sum(
        monkeypatch):
    """A script selects its GPU after creating the communicator (it needs
    intra_rank): NCCL must not be initialised in the constructor."""
    def no_nccl(*args):
        raise AssertionError('NCCL initialised in the constructor')
    monkeypatch.setattr(pure_nccl, 'require_gpu', lambda name: None)
    monkeypatch.setattr(pure_nccl, 'nccl_communicator', no_nccl)
    comm = mnopt.create_communicator('pure_nccl')
    assert comm._sync_group.state.nccl is None
    comm.finalize()


# ------------------------------------------------------------ the kernels

@pytest.mark.skipif(WORLD.size > 1, reason='one process checks the kernels')
@pytest.mark.parametrize('wire', WIRES)
@pytest.mark.parametrize('grad_dtype', GRAD_DTYPES)
def test_pack_and_unpack_are_bit_identical_to_the_host(cupy, grad_dtype,
                                                       wire):
    named = [('/p%d' % i, awkward_values(int(numpy.prod(s)), grad_dtype, i)
              .reshape(s)) for i, s in enumerate(SHAPES)]
    # Every third array not C-contiguous.
    named = [(n, numpy.asfortranarray(a) if i % 3 == 2 else a)
             for i, (n, a) in enumerate(named)]
    layout = grad_buffer.make_layout(named, wire)
    host = grad_buffer.GradBuffer(layout, numpy)       # nothing in place
    gpu = grad_buffer.GradBuffer(layout, cupy)
    for divisor in (1, 3, 4):
        host_arrays = [a.copy(order='K') for _, a in named]
        gpu_arrays = [cupy.array(a, order='K') for _, a in named]
        host.reset_counts()
        gpu.reset_counts()
        host.pack(host_arrays, divisor)
        gpu.pack(gpu_arrays, divisor)
        assert same_bits(wire_values(host), wire_values(gpu)), divisor
        # Unpack the packed values (a sum over one rank) into fresh arrays.
        host_out = [numpy.full_like(a, 7) for a in host_arrays]
        gpu_out = [cupy.full_like(a, 7) for a in gpu_arrays]
        host.unpack(host_out)
        gpu.unpack(gpu_out)
        gpu.take_counts()
        for k, (h, g) in enumerate(zip(host_out, gpu_out)):
            assert g.flags.c_contiguous == h.flags.c_contiguous
            assert same_bits(h, g.get()), (k, divisor)
        assert gpu.nonfinite_in == host.nonfinite_in
        assert gpu.nonfinite_out == host.nonfinite_out
        if wire in ('float16', 'bfloat16'):
            # the specials were counted
            assert sum(n or 0 for n in gpu.nonfinite_in) > 0


@pytest.mark.skipif(WORLD.size > 1, reason='one process checks the kernels')
def test_bfloat16_rounds_to_nearest_even_and_keeps_nan(cupy):
    x = numpy.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20,
                     -(1 + 2 ** -8), numpy.nan, -numpy.nan, numpy.inf,
                     0.0, 1.0], numpy.float32)
    # NaN payloads that rounding would carry into the exponent, and the tie
    # between bfloat16's largest value and inf.
    x[[4, 5, 7]] = numpy.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7F7F8000],
                               numpy.uint32).view(numpy.float32)
    layout = grad_buffer.make_layout([('/x', x)], 'bfloat16')
    gpu = grad_buffer.GradBuffer(layout, cupy)
    gpu.pack([cupy.asarray(x)], 1)
    bits = gpu.wire.get()
    assert bits[0] == 0x3F80    # tie: down to even
    assert bits[1] == 0x3F82    # tie: up to even
    assert bits[2] == 0x3F81    # above the tie: up
    assert bits[3] == 0xBF80
    assert bits[4] == bits[5] == 0x7FC0
    assert bits[6] == 0x7F80
    assert bits[7] == 0x7F80    # rounds past bfloat16's largest
    assert bits[8] == 0x3F80
    assert (bits == grad_buffer.float32_to_bfloat16_bits(x)).all()


@pytest.mark.skipif(WORLD.size > 1, reason='one process checks the kernels')
def test_pack_crosses_the_32_bit_index_boundary(cupy):
    """An array of more than 2**31 elements behind a small one: CuPy then
    indexes in 64 bits, and the table's offsets must too."""
    n = 2 ** 31 + 5
    free, _ = cupy.cuda.runtime.memGetInfo()
    if free < 24 << 30:
        pytest.skip('needs 24 GiB of free GPU memory')
    pattern = cupy.ElementwiseKernel(
        '', 'float32 y', 'y = (float)(i % 1024) * 0.5f', 'mnopt_t_pattern')
    check = cupy.ElementwiseKernel(
        'float32 y', 'bool ok', 'ok = (y == (float)(i % 1024) * 0.25f)',
        'mnopt_t_check')
    small = cupy.full(3, 2.0, cupy.float32)
    big = cupy.empty(n, cupy.float32)
    pattern(big)
    layout = grad_buffer.make_layout([('/a', small), ('/b', big)], 'float16')
    buf = grad_buffer.GradBuffer(layout, cupy)
    assert buf.wire.nbytes > 2 ** 32
    buf.pack([small, big], 2)
    buf.unpack([small, big])
    assert (small == 1.0).all()
    ok = check(big)
    assert bool(ok.all()), int(cupy.nonzero(~ok)[0][0])
    del ok, buf, big


# ------------------------------------------------------------ communicators

GPU_COMMUNICATORS = ('naive', 'flat', 'hierarchical', 'hierarchical-2-per-node',
                     'reduction_server')


@pytest.fixture(params=GPU_COMMUNICATORS)
def gpu_comm_name(request, monkeypatch):
    name = request.param
    if name == 'hierarchical-2-per-node':
        monkeypatch.setenv('MNOPT_RANKS_PER_NODE', '2')
        name = 'hierarchical'
    return name


# Below the in-place threshold: numpy and CuPy gradients then travel in the
# same buckets, so the sums see the same numbers in the same order.
COMM_SHAPES = [(3,), (5, 7), (1,), (0,), (11, 13, 3), (2000,), (4099,)]


@pytest.mark.parametrize('wire', [None, 'float16', 'bfloat16', 'float32'])
@pytest.mark.parametrize('grad_dtype', GRAD_DTYPES)
def test_cupy_gradients_average_exactly_as_numpy_ones(cupy, gpu_comm_name,
                                                      grad_dtype, wire):
    from test_mean_grad import tolerance
    comm = mnopt.create_communicator(gpu_comm_name, allreduce_grad_dtype=wire,
                                     bucket_bytes=4000)
    grads = rank_grads(COMM_SHAPES, grad_dtype, comm.rank)
    on_host = [('/p%d' % i, g.copy()) for i, g in enumerate(grads)]
    on_gpu = [('/p%d' % i, cupy.asarray(g)) for i, g in enumerate(grads)]
    comm.mean_grads(on_host)
    comm.mean_grads(on_gpu)
    for (name, h), (_, g), want in zip(on_host, on_gpu,
                                       expected_mean(COMM_SHAPES, comm.size)):
        assert isinstance(g, cupy.ndarray) and g.dtype == h.dtype
        assert same_bits(h, g.get()), name
        err = numpy.abs(h.astype(numpy.float64) - want)
        assert (err <= tolerance(grad_dtype, wire, want)).all(), name
    comm.finalize()


@pytest.mark.parametrize('wire', ['float16', 'bfloat16'])
def test_a_16_bit_wire_on_the_gpu_neither_overflows_nor_hides_it(
        cupy, gpu_comm_name, wire):
    comm = mnopt.create_communicator(gpu_comm_name, allreduce_grad_dtype=wire,
                                     on_overflow='error')
    comm.skip_single_rank = False
    # 60000 on every rank: the mean fits, the sum would not.
    g = [('/w', cupy.full(5, 60000, cupy.float32))]
    comm.mean_grads(g)
    assert (g[0][1] == (60000 if wire == 'float16' else 59904)).all()
    # A NaN already in a gradient passes through, unreported.
    g = [('/w', cupy.full(5, numpy.nan, cupy.float32))]
    comm.mean_grads(g)
    assert bool(cupy.isnan(g[0][1]).all())
    if wire == 'float16':    # a mean beyond 65504: every rank raises
        g = [('/big', cupy.full(3, 70000, cupy.float32))]
        with pytest.raises(mnopt.GradientOverflowError, match="'/big'"):
            comm.mean_grads(g)
    comm.finalize()


def test_sign_compression_votes_the_same_on_the_gpu(cupy, gpu_comm_name):
    comms = [mnopt.create_communicator(gpu_comm_name, compression='sign')
             for _ in range(2)]
    rng = numpy.random.RandomState(comms[0].rank)
    for step in range(3):   # error feedback carries residuals across steps
        grads = [rng.standard_normal(s).astype(numpy.float32)
                 for s in COMM_SHAPES]
        on_host = [('/p%d' % i, g.copy()) for i, g in enumerate(grads)]
        on_gpu = [('/p%d' % i, cupy.asarray(g)) for i, g in enumerate(grads)]
        comms[0].mean_grads(on_host)
        comms[1].mean_grads(on_gpu)
        for (name, h), (_, g) in zip(on_host, on_gpu):
            g = g.get()
            # The votes agree exactly; the scales are sums in another order.
            assert (numpy.sign(h) == numpy.sign(g)).all(), (step, name)
            numpy.testing.assert_allclose(g, h, rtol=1e-6, err_msg=name)
    for c in comms:
        c.finalize()


def test_powersgd_on_the_gpu_matches_the_host(cupy, gpu_comm_name):
    """PowerSGD with CuPy gradients (pure_nccl's NCCL sums included): the
    same bits on every rank, and the host's means up to the order of the
    local products (cuBLAS against the host BLAS)."""
    comms = [mnopt.create_communicator(gpu_comm_name, compression='powersgd',
                                       powersgd_rank=2) for _ in range(2)]
    shapes = [(16, 3, 3, 3), (40, 30), (30,)]
    rng = numpy.random.RandomState(comms[0].rank)
    for step in range(3):   # the warm Qs and residuals carry over
        grads = [rng.standard_normal(s).astype(numpy.float32)
                 for s in shapes]
        on_host = [('/p%d' % i, g.copy()) for i, g in enumerate(grads)]
        on_gpu = [('/p%d' % i, cupy.asarray(g)) for i, g in enumerate(grads)]
        comms[0].mean_grads(on_host)
        comms[1].mean_grads(on_gpu)
        mine = b''.join(g.get().tobytes() for _, g in on_gpu)
        assert all(o == mine for o in comms[1].allgather_obj(mine))
        for (name, h), (_, g) in zip(on_host, on_gpu):
            assert isinstance(g, cupy.ndarray)
            numpy.testing.assert_allclose(g.get(), h, rtol=1e-3, atol=1e-4,
                                          err_msg=(step, name))
    for c in comms:
        c.finalize()


GPU_WORKER = '''
import sys, numpy, cupy, mnopt
sys.path.insert(0, 'tests')
from param_models import rank_grads
wire = None if sys.argv[1] == 'None' else sys.argv[1]
comm = mnopt.create_communicator('reduction_server', allreduce_grad_dtype=wire,
                                 chunk_bytes=4000)   # many chunks
shapes = [(3,), (5, 7), (1,), (0,), (11, 13, 3), (2000,), (4099,)]
for grad_dtype in ('float16', 'float32', 'float64'):
    grads = rank_grads(shapes, grad_dtype, comm.rank)
    on_host = [('/p%d' % i, g.copy()) for i, g in enumerate(grads)]
    on_gpu = [('/p%d' % i, cupy.asarray(g)) for i, g in enumerate(grads)]
    comm.mean_grads(on_host)
    comm.mean_grads(on_gpu)
    for (name, h), (_, g) in zip(on_host, on_gpu):
        assert g.dtype == h.dtype and h.tobytes() == g.get().tobytes(), (
            grad_dtype, name)
print('OK gpu worker %d' % comm.rank)
'''


@pytest.mark.spawn
@pytest.mark.parametrize('wire', [None, 'float16', 'bfloat16'])
def test_reduction_server_with_servers_takes_cupy_gradients(cupy, wire):
    from test_reduction_server import run_job
    proc = run_job(2, 1, worker_code=GPU_WORKER, worker_args=[str(wire)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('OK gpu worker') == 2


# ------------------------------------------------------------ pure_nccl

def one_gpu_per_rank(cupy):
    """Skip unless each rank has a GPU of its own (NCCL refuses two ranks on
    one GPU)."""
    if cupy.cuda.runtime.getDeviceCount() < WORLD.size:
        pytest.skip('NCCL needs one GPU per rank; %d GPU(s) for %d ranks'
                    % (cupy.cuda.runtime.getDeviceCount(), WORLD.size))


def _set_grads(model, k, xp):
    for i, (_, p) in enumerate(sorted(model.namedparams())):
        g = rank_grads([p.shape], numpy.float32, WORLD.rank)[0] * (k + 1) \
            + i * 1e-3
        p.grad = xp.asarray(g.astype(numpy.float32))


@needs_chainer
@pytest.mark.parametrize('double_buffering', [False, True])
@pytest.mark.parametrize('wire', ['float16', 'bfloat16', 'float32'])
def test_pure_nccl_through_the_optimizer(cupy, wire, double_buffering):
    """pure_nccl with CuPy gradients ends bit-identical to flat with numpy
    ones, averaging at N=1 too (skip_single_rank off), plain and
    double-buffered; NCCL and the side stream live on the gradients' GPU."""
    one_gpu_per_rank(cupy)
    shapes = [(3,), (5, 7), (1,), (300, 20), (4099,)]
    runs = {}
    for name, xp in (('pure_nccl', cupy), ('flat', numpy)):
        comm = mnopt.create_communicator(name, allreduce_grad_dtype=wire)
        comm.skip_single_rank = False
        model = make_model(shapes)
        if xp is cupy:
            model.to_gpu()
        # SGD with lr=1 applies the means exactly (MomentumSGD's GPU
        # kernel fuses multiply-adds that numpy rounds twice).
        opt = mnopt.create_multi_node_optimizer(
            chainer.optimizers.SGD(lr=1.0), comm,
            double_buffering=double_buffering).setup(model)
        for k in range(5):
            _set_grads(model, k, xp)
            opt.update()
        if double_buffering:
            opt.wait()
        runs[name] = {n: chainer.backends.cuda.to_cpu(p.array)
                      for n, p in model.namedparams()}
        if name == 'pure_nccl':
            group = comm._async_group if double_buffering \
                else comm._sync_group
            device = cupy.cuda.Device().id
            assert group.state.nccl is not None
            assert group.state.nccl.device_id() == device
            if double_buffering:
                assert list(group.side_streams) == [device]
                stream = group.side_streams[device]
                assert getattr(stream, 'device_id', device) == device
        comm.finalize()
    for n in runs['flat']:
        assert same_bits(runs['flat'][n], runs['pure_nccl'][n]), n


def test_pure_nccl_averages_an_empty_set(cupy):
    """Overlap's last bucket is empty when backward sent every gradient:
    nothing to sum, not a "numpy gradients" TypeError (ResNet-50 with
    overlap=True failed so at its second step)."""
    one_gpu_per_rank(cupy)
    comm = mnopt.create_communicator('pure_nccl')
    comm.skip_single_rank = False
    comm.mean_grads([])
    comm.mean_grads_async([], queue=True).wait()
    g = [('/w', cupy.full(3, comm.rank + 1.0, cupy.float32))]
    comm.mean_grads(g)      # NCCL still averages after it
    assert (g[0][1] == (comm.size + 1) / 2.0).all()
    comm.finalize()


def train_mlp_on_the_gpu(cupy, comm, optimizer, steps, **options):
    """An MLP on the GPU, trained ``steps`` updates through
    ``create_multi_node_optimizer(optimizer, comm, **options)`` from
    rank-dependent batches; the model and the multi-node optimizer."""
    import chainer.functions as F
    import chainer.links as L
    numpy.random.seed(comm.rank)     # rank 0's initial values are broadcast
    model = chainer.Sequential(L.Linear(32, 64), F.relu, L.Linear(64, 64),
                               F.relu, L.Linear(64, 10))
    model.to_gpu()
    opt = mnopt.create_multi_node_optimizer(optimizer, comm,
                                            **options).setup(model)
    rng = numpy.random.RandomState(7 + comm.rank)
    for _ in range(steps):
        x = cupy.asarray(rng.standard_normal((8, 32)).astype(numpy.float32))
        t = cupy.asarray(rng.randint(0, 10, 8).astype(numpy.int32))
        opt.update(lambda: F.softmax_cross_entropy(model(x), t))
    return model, opt


def _train_on_the_gpu(cupy, name, wire, overlap):
    comm = mnopt.create_communicator(name, allreduce_grad_dtype=wire,
                                     bucket_bytes=4096)   # several buckets
    comm.skip_single_rank = False
    model, opt = train_mlp_on_the_gpu(
        cupy, comm, chainer.optimizers.MomentumSGD(lr=0.05), 10,
        overlap=overlap)
    stats = opt.overlap_stats if overlap else None
    params = {n: cupy.asnumpy(p.array) for n, p in model.namedparams()}
    comm.finalize()
    return params, stats


@needs_chainer
@pytest.mark.parametrize('name,wire', [
    ('flat', None), ('hierarchical', None), ('reduction_server', 'float16'),
    ('pure_nccl', 'float16')])
def test_overlap_with_cupy_gradients_is_bit_identical_to_synchronous(
        cupy, name, wire):
    """overlap=True on the GPU: the buckets leave during backward (copies
    queued on the caller's stream, averaged on the side stream) and the
    parameters end bit-identical to the synchronous optimizer's."""
    if name == 'pure_nccl':
        one_gpu_per_rank(cupy)
    sync, _ = _train_on_the_gpu(cupy, name, wire, False)
    overlapped, stats = _train_on_the_gpu(cupy, name, wire, True)
    assert stats['buckets'] > 1
    assert stats['during_backward'] == stats['buckets']
    for n in sync:
        assert same_bits(sync[n], overlapped[n]), n


# ------------------------------------------------------------ streams

@pytest.mark.parametrize('name', ['flat', 'pure_nccl'])
def test_background_averaging_runs_on_its_own_stream(cupy, name):
    """The averaging waits for the work queued before it on the caller's
    stream (here: a kernel that sleeps, then the gradients' values) and for
    nothing queued after it (a kernel that sleeps much longer): no
    device-wide synchronisation, no wait on the caller's stream."""
    if name == 'pure_nccl':
        one_gpu_per_rank(cupy)
    spin = spin_kernel()
    comm = mnopt.create_communicator(name)
    comm.skip_single_rank = False
    grads = [('/a', cupy.zeros(1000, cupy.float32)),
             ('/b', cupy.zeros((300, 7), cupy.float32))]
    comm.mean_grads_async(grads).wait()               # warm up: allocations
    caller = cupy.cuda.get_current_stream()
    spin((1,), (1,), (numpy.int64(200e6),))           # 0.2 s before
    for _, g in grads:
        g.fill(comm.rank + 1)
    handle = comm.mean_grads_async(grads)
    spin((1,), (1,), (numpy.int64(5e9),))             # 5 s after
    after = caller.record()
    handle.wait()
    assert not after.done, 'the averaging waited for later work'
    for _, g in grads:
        assert (g == (comm.size + 1) / 2.0).all()     # ... but not earlier
    after.synchronize()
    comm.finalize()


# ------------------------------------------------------------ the example

TRAIN = os.path.join(REPO, 'examples', 'imagenet', 'train_imagenet.py')


@pytest.fixture(scope='module')
def data_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp('embedded'))


def _train(n, out, cache, *flags):
    code = 'import runpy, sys\nrunpy.run_path(%r, run_name="__main__")\n' \
        % TRAIN
    return run_mpi(n, code, timeout=600, env={
        'MNOPT_SINGLE_RANK_AVERAGING': '1'}, args=[
        '--out', str(out), '--data-cache', cache, '--batchsize', '8',
        '--val-batchsize', '16', '--snapshot-interval', '3',
        # A constant rate: a linear one depends on --iteration, which the
        # two runs set differently (3 then 6, against 6).
        '--keep-snapshots', '5', '--lr-schedule', 'constant'] + list(flags))


@needs_chainer
@pytest.mark.spawn
@pytest.mark.parametrize('n,flags', [
    (1, ['--arch', 'resnet50', '--communicator', 'pure_nccl',
         '--allreduce-grad-dtype', 'float16', '--double-buffering']),
    (2, ['--communicator', 'flat']),
], ids=['resnet50-pure_nccl-fp16-double-buffering-N1', 'flat-N2'])
def test_the_example_trains_and_resumes_on_the_gpu(cupy, tmp_path, data_cache,
                                                   n, flags):
    pytest.importorskip('PIL', reason='the example needs mnopt[examples]')
    whole, part = tmp_path / 'whole', tmp_path / 'part'
    proc = _train(n, whole, data_cache, '--iteration', '6', *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'GPU' in proc.stdout and '%d ranks' % n in proc.stdout
    assert _train(n, part, data_cache, '--iteration', '3',
                  *flags).returncode == 0
    proc = _train(n, part, data_cache, '--iteration', '6', '--resume',
                  str(part / 'snapshot_iter_3.npz'), *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'resumed from' in proc.stdout
    snapshot_models_equal(whole / 'snapshot_iter_6.npz',
                          part / 'snapshot_iter_6.npz')
