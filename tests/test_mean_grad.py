"""multi_node_mean_grad on every CPU communicator against the analytic mean.

Rank r's gradients are r + pattern, so the mean is (size - 1) / 2 + pattern.
"""

import numpy
import pytest

import mnopt
from conftest import (WORLD, chainer, expected_mean, make_model, needs_chainer,
                      rank_grads)

# Also under mpiexec -n 3: odd rank counts take other ring and node-split paths.
pytestmark = pytest.mark.many_ranks

PARAM_SETS = {
    'none': [],
    'one-element': [(1,)],
    'odd-sized': [(3,), (5, 7), (1,), (0,), (11, 13, 3), (2, 1, 1, 5), (17,)],
    # Above the in-place threshold for float32/float64 gradients.
    'large': [(40000,), (3,), (257, 129)],
}
EPS = {'float16': 2.0 ** -10, 'bfloat16': 2.0 ** -7,
       'float32': 2.0 ** -23, 'float64': 2.0 ** -52}


def tolerance(grad_dtype, wire, values):
    """Bound on |result - exact mean|: rounding the scaled inputs, each
    pairwise sum on the wire, and the final cast to the gradient dtype."""
    wire = wire or numpy.dtype(grad_dtype).name
    n = WORLD.size
    scale = numpy.abs(values) + (n - 1) / 2.0 + 2
    return scale * ((n + 2) * EPS[wire] + EPS[numpy.dtype(grad_dtype).name])


def _set_grads(model, grads):
    for i, ((_, p), g) in enumerate(zip(sorted(model.namedparams()), grads)):
        # Every third gradient is not C-contiguous.
        p.grad = numpy.asfortranarray(g) if i % 3 == 2 else g.copy()


@pytest.mark.parametrize('param_set', sorted(PARAM_SETS))
@pytest.mark.parametrize('wire', [None, 'float16', 'bfloat16', 'float32'])
@pytest.mark.parametrize('grad_dtype', ['float16', 'float32', 'float64'])
def test_mean_matches_analytic(comm_name, param_set, wire, grad_dtype):
    shapes = PARAM_SETS[param_set]
    comm = mnopt.create_communicator(  # many buckets, arrays straddling them
        comm_name, allreduce_grad_dtype=wire,
        bucket_bytes=50000 if param_set == 'large' else 40)
    model = make_model(shapes, grad_dtype)
    _set_grads(model, rank_grads(shapes, grad_dtype, comm.rank))
    comm.multi_node_mean_grad(model)
    for (name, p), want in zip(sorted(model.namedparams()),
                               expected_mean(shapes, comm.size)):
        assert p.grad.dtype == numpy.dtype(grad_dtype), name
        assert p.grad.shape == want.shape, name
        err = numpy.abs(p.grad.astype(numpy.float64) - want)
        assert (err <= tolerance(grad_dtype, wire, want)).all(), (
            name, float(err.max()))
    comm.finalize()


@pytest.mark.parametrize('wire', ['float32', 'float64'])
def test_mean_is_exact_when_the_arithmetic_is(comm_name, wire):
    """With a power-of-two world size, the pattern's values divided by N
    and summed are exact in float32: so must the result be."""
    if WORLD.size & (WORLD.size - 1):
        pytest.skip('N=%d: 1/N is not exact in binary' % WORLD.size)
    shapes = PARAM_SETS['odd-sized']
    comm = mnopt.create_communicator(comm_name, allreduce_grad_dtype=wire)
    model = make_model(shapes, numpy.float32)
    _set_grads(model, rank_grads(shapes, numpy.float32, comm.rank))
    comm.multi_node_mean_grad(model)
    for (_, p), want in zip(sorted(model.namedparams()),
                            expected_mean(shapes, comm.size)):
        numpy.testing.assert_array_equal(p.grad, want.astype(numpy.float32))


@pytest.mark.parametrize('wire', ['float16', 'bfloat16'])
def test_16_bit_wire_does_not_overflow(comm_name, wire):
    # 60000 per rank: ChainerMN's FP16 all-reduce returns inf at 2 ranks.
    comm = mnopt.create_communicator(comm_name, allreduce_grad_dtype=wire)
    model = make_model([(5,)])
    _set_grads(model, [numpy.full(5, 60000, numpy.float32)])
    comm.multi_node_mean_grad(model)
    assert numpy.isfinite(model.p000.grad).all()
    rel = numpy.abs(model.p000.grad / 60000.0 - 1)
    assert (rel <= 2 * EPS[wire]).all()


@pytest.mark.parametrize('zero_fill', [True, False])
def test_none_gradients(comm_name, zero_fill):
    shapes = [(4,), (3, 2), (5,)]
    comm = mnopt.create_communicator(comm_name)
    model = make_model(shapes)
    grads = rank_grads(shapes, numpy.float32, comm.rank)
    _set_grads(model, grads)
    model.p001.grad = None          # unused this iteration on every rank
    comm.multi_node_mean_grad(model, zero_fill=zero_fill)
    want = expected_mean(shapes, comm.size)
    if zero_fill:
        numpy.testing.assert_array_equal(model.p001.grad, numpy.zeros((3, 2)))
    else:
        assert model.p001.grad is None
    for i in (0, 2):
        numpy.testing.assert_allclose(getattr(model, 'p%03d' % i).grad,
                                      want[i], rtol=1e-6)


@needs_chainer
def test_uninitialized_parameters_are_skipped(comm_name):
    comm = mnopt.create_communicator(comm_name)
    model = make_model([(3,)])
    with model.init_scope():
        model.lazy = chainer.Parameter()  # no data yet
    model.p000.grad = numpy.full(3, comm.rank, numpy.float32)
    comm.multi_node_mean_grad(model, zero_fill=True)
    numpy.testing.assert_allclose(model.p000.grad, (comm.size - 1) / 2.0)
    assert model.lazy.array is None


def test_repeated_calls_and_changing_sets_reuse_nothing_stale(comm_name):
    comm = mnopt.create_communicator(comm_name, allreduce_grad_dtype='float16')
    for it, shapes in enumerate([[(3,), (4,)], [(3,), (4,)], [(6,)], [(3,)]]):
        model = make_model(shapes)
        _set_grads(model, [g + it for g in
                           rank_grads(shapes, numpy.float32, comm.rank)])
        comm.multi_node_mean_grad(model)
        for (_, p), want in zip(sorted(model.namedparams()),
                                expected_mean(shapes, comm.size)):
            numpy.testing.assert_allclose(p.grad, want + it, rtol=3e-3,
                                          atol=3e-3)


def test_mean_grads_async_matches_sync(comm_name):
    shapes = PARAM_SETS['odd-sized']
    comm = mnopt.create_communicator(comm_name)
    named = [('g%d' % i, g) for i, g in
             enumerate(rank_grads(shapes, numpy.float32, comm.rank))]
    handle = comm.mean_grads_async(named)
    handle.wait()
    assert handle.done()
    for (_, g), want in zip(named, expected_mean(shapes, comm.size)):
        numpy.testing.assert_allclose(g, want, rtol=1e-6)
    comm.finalize()


@pytest.mark.parametrize('wire', ['float16', 'bfloat16'])
@pytest.mark.parametrize('n', [1, 2, 5, 1000, 4099])
def test_16_bit_ring_is_exact_and_the_same_on_every_rank(wire, n):
    from mnopt.transport import allreduce
    from mnopt.codecs import grad_buffer as gb
    values = numpy.arange(n) % 8 * 0.25 + WORLD.rank   # exact sums
    want = numpy.arange(n) % 8 * 0.25 * WORLD.size \
        + WORLD.size * (WORLD.size - 1) / 2.0
    if wire == 'float16':
        a = values.astype(numpy.float16)
    else:
        a = gb.float32_to_bfloat16_bits(values.astype(numpy.float32))
    allreduce.allreduce_sum(WORLD, a, wire)
    got = a.astype(numpy.float64) if wire == 'float16' else \
        gb.bfloat16_bits_to_float32(a).astype(numpy.float64)
    numpy.testing.assert_array_equal(got, want)
    everyone = WORLD.allgather(a.view(numpy.uint16).tobytes())
    assert all(b == everyone[0] for b in everyone)



@pytest.mark.parametrize('wire', [None, 'float16'])
def test_naive_sums_each_array_on_its_own(monkeypatch, wire):
    # The reference: one collective per array, as ChainerMN's naive does
    # (flat puts every array in one ring or bucketed Allreduce).
    from mnopt.transport import allreduce
    sums = []
    real = allreduce.allreduce_sum_parts

    def recording(comm, parts, *args, **kwargs):
        sums.append([p.size for p in parts])
        return real(comm, parts, *args, **kwargs)

    monkeypatch.setattr(allreduce, 'allreduce_sum_parts', recording)
    monkeypatch.setenv('MNOPT_SINGLE_RANK_AVERAGING', '1')
    comm = mnopt.create_communicator('naive', allreduce_grad_dtype=wire)
    try:
        shapes = PARAM_SETS['odd-sized']
        grads = [('g%d' % i, g) for i, g in enumerate(
            rank_grads(shapes, numpy.float32, comm.rank))]
        comm.mean_grads(grads)
        sizes = [int(numpy.prod(s)) for s in shapes]
        assert sums == [[n] for n in sizes if n]
        for (_, got), want in zip(grads, expected_mean(shapes, comm.size)):
            numpy.testing.assert_allclose(got, want, rtol=1e-3)
    finally:
        comm.finalize()
