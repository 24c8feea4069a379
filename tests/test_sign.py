"""Sign compression (mnopt/codecs/sign.py): the vote on every communicator that
supports it, its bytes on the wire, error feedback, warm-up, Signum.

Runs serially (N=1) and under mpiexec -n 2 / -n 3; N=4 and 5 and the
reduction server run as spawned jobs."""

import math

import numpy
import pytest

import mnopt
from mnopt.codecs import grad_buffer, sign
from conftest import WORLD, chainer, make_model, needs_chainer, run_mpi

# Also under mpiexec -n 3: votes of an odd number of ranks never tie.
pytestmark = pytest.mark.many_ranks

# Odd sizes, an empty array, a size that is not a multiple of 8.
SHAPES = [(3,), (5, 7), (0,), (1,), (11, 13, 3), (2001,)]


def rank_grads(rank, seed=0):
    rng = numpy.random.RandomState(1000 * seed + rank)
    grads = [rng.standard_normal(s).astype(numpy.float32) for s in SHAPES]
    # Exact zeros (decided by the coin) and, across ranks, many ties.
    grads[-1][::7] = 0
    grads[-1][1::3] = numpy.where(rng.rand(grads[-1][1::3].size) < 0.5, 1, -1)
    return grads


def expected_vote(all_grads, step):
    """The definition, written out: per-array scale mean(|g|) on each
    worker, averaged over workers in rank order; per element the majority of
    the workers' signs, zeros and ties decided by the coin."""
    n = len(all_grads)
    flat = [numpy.concatenate([g.reshape(-1) for g in grads])
            for grads in all_grads]
    total = flat[0].size
    index = numpy.arange(total, dtype=numpy.uint64)
    votes = numpy.zeros(total, numpy.int64)
    for f in flat:
        positive = (f > 0).astype(numpy.uint8)
        zero = f == 0
        positive[zero] = sign.coin(index[zero], step)
        votes += positive
    majority = numpy.where(2 * votes > n, 1, -1).astype(numpy.float32)
    tie = 2 * votes == n
    majority[tie] = sign.coin(index[tie], step).astype(numpy.float32) * 2 - 1
    out, offset = [], 0
    for k, shape in enumerate(SHAPES):
        size = int(numpy.prod(shape))
        total_scale = numpy.zeros((), numpy.float64)
        for grads in all_grads:
            a = grads[k].reshape(-1)
            if a.size:
                total_scale += numpy.abs(a).sum(dtype=numpy.float64) / a.size
        scale = numpy.float32(total_scale / n)
        out.append((majority[offset:offset + size] * scale).reshape(shape))
        offset += size
    return out


def _vote_once(comm, seed=0):
    model = make_model(SHAPES)
    grads = rank_grads(comm.rank, seed)
    for (_, p), g in zip(sorted(model.namedparams()), grads):
        p.grad = g.copy()
    comm.multi_node_mean_grad(model)
    return [p.grad for _, p in sorted(model.namedparams())]


@pytest.mark.parametrize('vote', sign.VOTES)
def test_vote_is_the_exact_majority(comm_name, vote):
    comm = mnopt.create_communicator(comm_name, compression='sign',
                                     vote=vote)
    for step in range(3):
        got = _vote_once(comm, seed=step)
        everyone = [rank_grads(r, step) for r in range(comm.size)]
        if step == 0:  # no residual yet: the plain vote
            for g, w in zip(got, expected_vote(everyone, step)):
                numpy.testing.assert_array_equal(g, w)
        # The same bits on every rank, every step.
        gathered = comm.allgather_obj(got)
        for other in gathered:
            for a, b in zip(other, got):
                numpy.testing.assert_array_equal(a, b)


def test_ring_bytes_per_element_within_the_bound(comm_name):
    comm = mnopt.create_communicator(comm_name, compression='sign')
    n_elements = 80000
    model = make_model([(n_elements,)])
    model.p000.grad = numpy.random.RandomState(comm.rank).standard_normal(
        n_elements).astype(numpy.float32)
    comm.multi_node_mean_grad(model)
    sent = comm.vote_stats.get('bytes_sent', 0)
    n = comm.size
    if n == 1:
        assert sent == 0
        return
    bits_per_element = 8.0 * sent / n_elements
    # The counting ring: sum of ceil(log2(i+1)) for i = 1..N-1, then N-1
    # bits, each over 1/N of the elements.
    want = (sum(sign.count_bits(i) for i in range(1, n)) + n - 1) / n
    assert abs(bits_per_element - want) < 0.01, (bits_per_element, want)
    assert bits_per_element <= math.ceil(math.log2(n + 1)) + 1


def test_alltoall_bytes_per_element(comm_name):
    """1-bit Adam's all-to-all: (N-1)/N bits out, then the rank's
    majority segment to N-1 others: 2(N-1)/N bits per element."""
    comm = mnopt.create_communicator(comm_name, compression='sign',
                                     vote='alltoall')
    n_elements = 80000
    model = make_model([(n_elements,)])
    model.p000.grad = numpy.random.RandomState(comm.rank).standard_normal(
        n_elements).astype(numpy.float32)
    comm.multi_node_mean_grad(model)
    n = comm.size
    bits_per_element = 8.0 * comm.vote_stats.get('bytes_sent', 0) / n_elements
    assert abs(bits_per_element - 2.0 * (n - 1) / n) < 0.01


@pytest.fixture(params=['C', 'numpy'])
def codec_loops(request, monkeypatch):
    """The sign codec with its C loops (mnopt/codecs/_signbits.c) and with
    numpy's; both must give the same bits."""
    if request.param == 'C':
        if sign._signbits is None:
            pytest.skip('mnopt.codecs._signbits was not built (no C compiler)')
    else:
        monkeypatch.setattr(sign, '_signbits', None)
    return request.param


def test_vote_is_exact_with_either_codec(comm_name, codec_loops):
    comm = mnopt.create_communicator(comm_name, compression='sign')
    got = _vote_once(comm, seed=5)
    everyone = [rank_grads(r, 5) for r in range(comm.size)]
    for g, w in zip(got, expected_vote(everyone, 0)):
        numpy.testing.assert_array_equal(g, w)


def test_c_loops_match_numpy(monkeypatch):
    if sign._signbits is None:
        pytest.skip('mnopt.codecs._signbits was not built (no C compiler)')
    rng = numpy.random.RandomState(3)
    shapes = [(13,), (0,), (7, 9), (1,), (4000,)]
    layout = grad_buffer.make_layout(
        [('p%d' % i, numpy.zeros(s, numpy.float32))
         for i, s in enumerate(shapes)], 'float32')
    grads = [rng.standard_normal(s).astype(numpy.float32) for s in shapes]
    grads[-1][::5] = 0
    counts = rng.randint(0, 8, size=1001).astype(numpy.uint8)
    results = {}
    for loops in ('C', 'numpy'):
        if loops == 'numpy':
            monkeypatch.setattr(sign, '_signbits', None)
        codec = sign.SignCodec(layout)
        for step in range(3):  # residuals carried over
            bits, scales = codec.encode(grads, step)
        out = [numpy.empty_like(g) for g in grads]
        codec.decode(bits, scales.astype(numpy.float32), out)
        packed = sign.pack_counts(counts, 3)
        plus = sign.unpack_counts(packed, 3, 1001, numpy.uint8)
        sign.add_bits(plus, bits, 5)
        results[loops] = (bits.copy(), scales, codec.residual.copy(), out,
                          packed, plus)
    for a, b in zip(results['C'], results['numpy']):
        if isinstance(a, list):
            for x, y in zip(a, b):
                numpy.testing.assert_array_equal(x, y)
        else:
            numpy.testing.assert_array_equal(a, b)


class ArraysElsewhere(object):
    """An array module that is not numpy (so SignCodec takes its device
    path) but computes with numpy: the device path's numbers, on the
    host."""

    def __getattr__(self, name):
        return getattr(numpy, name)


@pytest.mark.parametrize('error_feedback', [True, False])
def test_device_path_brings_all_scales_to_the_host_at_once(
        monkeypatch, error_feedback):
    """The device path (CuPy arrays) fetches every array's scale in one
    copy, not one synchronisation per array, and gives the host path's
    bits, scales and residuals exactly (same sums, same order)."""
    rng = numpy.random.RandomState(4)
    shapes = [(13,), (0,), (7, 9), (1,), (4000,), (3, 5, 2)]
    layout = grad_buffer.make_layout(
        [('p%d' % i, numpy.zeros(s, numpy.float32))
         for i, s in enumerate(shapes)], 'float32')
    fetched = []
    real_to_host = sign.to_host

    def counting_to_host(array):
        fetched.append(array.size)
        return real_to_host(array)
    monkeypatch.setattr(sign, 'to_host', counting_to_host)
    on_host = sign.SignCodec(layout, error_feedback=error_feedback)
    elsewhere = sign.SignCodec(layout, ArraysElsewhere(),
                               error_feedback=error_feedback)
    for step in range(4):   # residuals carried over
        grads = [rng.standard_normal(s).astype(numpy.float32)
                 for s in shapes]
        grads[-2][::5] = 0   # exact zeros: the coin decides
        bits, scales = on_host.encode(grads, step)
        bits = bits.copy()
        del fetched[:]
        got_bits, got_scales = elsewhere.encode(grads, step)
        # One fetch, of the 5 non-empty arrays' sums.
        assert fetched == [5], step
        numpy.testing.assert_array_equal(got_bits, bits)
        assert got_scales.dtype == numpy.float64
        assert got_scales.tobytes() == scales.tobytes(), step
        if error_feedback:
            assert elsewhere.residual.tobytes() == \
                on_host.residual.tobytes(), step


def test_counts_survive_bit_packing():
    rng = numpy.random.RandomState(0)
    for bits in range(1, 9):
        counts = rng.randint(0, 2 ** bits, size=1001).astype(numpy.uint8)
        packed = sign.pack_counts(counts, bits)
        assert packed.size == bits * 126  # ceil(1001 / 8) bytes per plane
        numpy.testing.assert_array_equal(
            sign.unpack_counts(packed, bits, 1001, numpy.uint8), counts)


def test_coin_is_deterministic_and_fair():
    index = numpy.arange(100000, dtype=numpy.uint64)
    a, b = sign.coin(index, 7), sign.coin(index, 7)
    numpy.testing.assert_array_equal(a, b)
    assert 0.49 < a.mean() < 0.51
    assert 0.45 < (a != sign.coin(index, 8)).mean() < 0.55  # varies by step


def test_error_feedback_returns_what_the_signs_left_out():
    """One worker: sum of the applied updates + residual = sum of the
    gradients (exactly, up to float32 rounding)."""
    layout = grad_buffer.make_layout(
        [('w', numpy.zeros(1000, numpy.float32))], 'float32')
    codec = sign.SignCodec(layout)
    g = numpy.random.RandomState(0).standard_normal(1000).astype(
        numpy.float32)
    applied = numpy.zeros(1000, numpy.float64)
    for step in range(20):
        bits, scales = codec.encode([g], step)
        out = [numpy.empty_like(g)]
        codec.decode(bits, scales.astype(numpy.float32), out)
        applied += out[0]
    numpy.testing.assert_allclose(applied + codec.residual, 20.0 * g,
                                  atol=1e-4)
    # Without it the signs lose the magnitudes for good.
    plain = sign.SignCodec(layout, error_feedback=False)
    assert plain.residual is None


def test_warm_up_steps_are_plain_means(comm_name):
    comm = mnopt.create_communicator(comm_name, compression='sign',
                                     warmup_steps=2)
    for step in range(3):
        model = make_model([(5,)])
        model.p000.grad = numpy.full(5, comm.rank + 1.0, numpy.float32)
        model.p000.grad[0] = -1.0 - 10 * comm.rank
        comm.multi_node_mean_grad(model)
        mean = (comm.size + 1) / 2.0
        if step < 2:
            numpy.testing.assert_allclose(model.p000.grad[1:], mean)
        else:
            scale = numpy.mean([(1 + 10 * r + 4 * (r + 1)) / 5.0
                                for r in range(comm.size)])
            numpy.testing.assert_allclose(model.p000.grad[1:], scale,
                                          rtol=1e-6)
            numpy.testing.assert_allclose(model.p000.grad[0], -scale,
                                          rtol=1e-6)


@needs_chainer
def test_double_buffering_votes_too(comm_name):
    comm = mnopt.create_communicator(comm_name, compression='sign')
    model = make_model([(10,)])
    opt = mnopt.create_multi_node_optimizer(
        mnopt.Signum(lr=0.5, momentum=0.0), comm,
        double_buffering=True).setup(model)
    for k in range(3):
        model.p000.grad = numpy.full(10, 1.0 + comm.rank, numpy.float32)
        opt.update()
    opt.wait()
    # Every rank pushes +: each applied step moves by -lr.
    assert opt.t >= 1
    numpy.testing.assert_array_equal(model.p000.array,
                                     numpy.full(10, -0.5 * opt.t))


def test_bad_compression_is_refused():
    with pytest.raises(ValueError, match="unknown compression 'bogus'"):
        mnopt.create_communicator('flat', compression='bogus')
    with pytest.raises(ValueError, match='warmup_steps'):
        mnopt.create_communicator('flat', compression='sign', warmup_steps=-1)
    with pytest.raises(ValueError, match="unknown vote 'tree'"):
        mnopt.create_communicator('flat', compression='sign', vote='tree')
    with pytest.raises(ValueError, match="only applies with compression"):
        mnopt.create_communicator('flat', vote='alltoall')
    with pytest.raises(ValueError, match='counts votes on its servers'):
        mnopt.create_communicator('reduction_server', compression='sign',
                                  vote='ring')


def test_mismatched_layouts_fail_on_every_rank():
    if WORLD.size == 1:
        pytest.skip('needs two ranks')
    comm = mnopt.create_communicator('flat', compression='sign')
    model = make_model([(5 + comm.rank,)])
    model.p000.grad = numpy.ones(5 + comm.rank, numpy.float32)
    with pytest.raises(mnopt.LayoutMismatchError):
        comm.multi_node_mean_grad(model)


@needs_chainer
def test_signum_steps_by_the_sign_of_its_momentum():
    link = chainer.Link()
    with link.init_scope():
        link.w = chainer.Parameter(numpy.zeros(3, numpy.float32))
    opt = mnopt.Signum(lr=0.1, momentum=0.5)
    opt.setup(link)
    for g in ([1.0, -1.0, 1.0], [1.0, -1.0, -3.0]):
        link.w.grad = numpy.array(g, numpy.float32)
        opt.update()
    # m: [0.5, -0.5, 0.5] then [0.75, -0.75, -1.25]
    numpy.testing.assert_allclose(link.w.array, [-0.2, 0.2, 0.0], atol=1e-7)
    with pytest.raises(ValueError, match='momentum'):
        mnopt.Signum(momentum=1.0)


SPAWNED = r'''
import sys
sys.path.insert(0, 'tests')
import numpy, mnopt
import test_sign as t
# Each vote named after the communicator's name in turn (one job for all:
# a job's start-up is most of its time).
for vote in sys.argv[2:] or [None]:
    options = {'vote': vote} if vote else {}
    comm = mnopt.create_communicator(sys.argv[1], compression='sign',
                                     **options)
    for step in range(2):
        got = t._vote_once(comm, seed=step)
        if step == 0:
            everyone = [t.rank_grads(r, step) for r in range(comm.size)]
            for g, w in zip(got, t.expected_vote(everyone, step)):
                assert (g == w).all(), vote
        for other in comm.allgather_obj(got):
            assert all((a == b).all() for a, b in zip(other, got)), vote
    if sys.argv[1] == 'reduction_server':
        n = 1 + 2001 + 3 + 35 + 429  # elements: 1 bit each way per element
        assert comm.vote_stats['bytes_sent'] == (n + 7) // 8
    print('OK vote %s %d of %d' % (vote, comm.rank, comm.size))
    comm.finalize()
'''


@pytest.mark.spawn
@pytest.mark.parametrize('n', [4, 5])
def test_vote_is_exact_on_4_and_5_ranks(n):
    proc = run_mpi(n, SPAWNED, timeout=180, args=['flat'] + list(sign.VOTES))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for vote in sign.VOTES:
        assert proc.stdout.count('OK vote %s ' % vote) == n, vote


# Every worker count and server count, colocated (0), more servers than
# workers, and servers that do not divide the workers; the mean's whole
# grid is in test_reduction_server.py.
@pytest.mark.spawn
@pytest.mark.parametrize('workers, servers', [(1, 2), (2, 0), (3, 1),
                                              (3, 2)])
def test_reduction_server_vote_is_exact(workers, servers):
    from test_reduction_server import run_job
    proc = run_job(workers, servers, worker_code=SPAWNED, timeout=120,
                   worker_args=['reduction_server'])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('OK vote None ') == workers
