"""PowerSGD's core (mnopt/codecs/powersgd.py): the plan, Gram-Schmidt, the
step's arithmetic, error feedback, the same bits on every rank, the state's
round trip and the bytes on the wire.

Runs serially (N=1) and under mpiexec -n 2 / -n 3: the all-reduction is a
real mpi4py Allreduce over the ranks of the job."""


import numpy
import pytest
from mpi4py import MPI

from mnopt.codecs import powersgd
from mnopt.benchmark.workloads import resnet50_grad_shapes
from conftest import WORLD

# Also under mpiexec -n 3: a sum over an odd number of ranks.
pytestmark = pytest.mark.many_ranks

# A conv kernel, plain matrices (one wide, one tall), a vector, an empty
# array, a 1 x m matrix.
SHAPES = [(6, 3, 2, 2), (7, 20), (30, 5), (9,), (0, 4), (1, 12)]


def mpi_sum(arrays, calls=None):
    """The callback: each array's sum over the ranks (float16 summed as
    float32, which MPI has)."""
    if calls is not None:
        calls.append(len(arrays))
    out = []
    for a in arrays:
        host = numpy.ascontiguousarray(a, dtype=numpy.float32
                                       if a.dtype == numpy.float16 else None)
        total = numpy.empty_like(host)
        WORLD.Allreduce(host, total, op=MPI.SUM)
        out.append(total.astype(a.dtype, copy=False))
    return out


def grads_of(step, dtype=numpy.float64, shapes=SHAPES):
    rng = numpy.random.RandomState(1000 * step + 17 * WORLD.rank + 1)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def exact_mean(grads):
    return [t / WORLD.size for t in
            mpi_sum([g.astype(numpy.float64) for g in grads])]


def same_on_every_rank(arrays):
    mine = b''.join(numpy.ascontiguousarray(a).tobytes() for a in arrays)
    return all(other == mine for other in WORLD.allgather(mine))


# -- the plan -------------------------------------------------------------

def test_plan_skips_vectors_and_matrices_below_the_rate():
    entries = powersgd.plan([(10,), (), (0, 5), (8, 8), (9, 9),
                             (64, 3, 7, 7), (1000, 2048), (3, 100),
                             (30, 100)],
                            rank=2, min_compression_rate=2)
    assert [e.index for e in entries] == list(range(9))
    matrices = [e.matrix for e in entries]
    # (8 + 8) * 2 * 2 = 64 is not below 64; (9 + 9) * 2 * 2 = 72 < 81;
    # (3 + 100) * 2 * 2 = 412 is not below 300.
    assert matrices == [None, None, None, None, (9, 9), (64, 147),
                        (1000, 2048), None, (30, 100)]
    assert [e.rank for e in entries] == [0, 0, 0, 0, 2, 2, 2, 0, 2]
    # The rank is at most min(n, m); rate 0 compresses every 2-D array.
    clipped = powersgd.plan([(3, 100), (2, 2), (0, 3)], rank=4,
                            min_compression_rate=0)
    assert [(e.matrix, e.rank) for e in clipped] == [
        ((3, 100), 3), ((2, 2), 2), (None, 0)]
    with pytest.raises(ValueError):
        powersgd.plan([(4, 4)], rank=0)


def test_resnet50_at_rank_4_sends_10x_fewer_bytes_than_float32():
    shapes = resnet50_grad_shapes()
    entries = powersgd.plan(shapes, rank=4, min_compression_rate=2)
    full_bytes = 4 * sum(int(numpy.prod(s)) for s in shapes)
    wire_bytes = 4 * powersgd.wire_elements(entries)
    assert wire_bytes * 10 <= full_bytes, (wire_bytes, full_bytes)
    assert powersgd.compression_rate(entries) == full_bytes / wire_bytes
    # Every convolution and the classifier compressed, no vector.
    assert all((e.matrix is not None) == (len(e.shape) > 1)
               for e in entries)


# -- Gram-Schmidt -----------------------------------------------------------

@pytest.mark.parametrize('dtype,tol', [(numpy.float64, 1e-12),
                                       (numpy.float32, 1e-5)])
def test_orthogonalize_gives_orthonormal_columns(dtype, tol):
    a = numpy.random.RandomState(3).standard_normal((50, 4)).astype(dtype)
    q = powersgd.orthogonalize(a)
    assert q.dtype == dtype and q.shape == a.shape
    numpy.testing.assert_allclose(q.T @ q, numpy.eye(4), atol=tol)
    # The same span as a (a = Q R), and QR's Q up to column signs.
    numpy.testing.assert_allclose(q @ (q.T @ a), a, atol=50 * tol)
    reference = numpy.linalg.qr(a.astype(numpy.float64))[0]
    numpy.testing.assert_allclose(numpy.abs(q), numpy.abs(reference),
                                  atol=10 * tol)
    # Identical input, identical bits; the input untouched.
    again = powersgd.orthogonalize(a.copy())
    assert again.tobytes() == q.tobytes()
    assert not numpy.shares_memory(q, a)


def test_orthogonalize_keeps_zero_columns_zero_and_takes_epsilon():
    a = numpy.random.RandomState(4).standard_normal((20, 3))
    a[:, 1] = 0
    q = powersgd.orthogonalize(a)
    assert numpy.isfinite(q).all() and not q[:, 1].any()
    assert powersgd.orthogonalize(numpy.zeros((5, 2))).tolist() == [
        [0, 0]] * 5
    q = powersgd.orthogonalize(a, epsilon=1e-3)
    assert numpy.linalg.norm(q[:, 0]) < 1
    numpy.testing.assert_allclose(numpy.linalg.norm(q[:, 0]), 1, rtol=1e-3)


# -- the step ---------------------------------------------------------------

def test_full_rank_gives_the_exact_mean():
    state = powersgd.PowerSGDState(SHAPES, rank=30, start_iter=0,
                                   min_compression_rate=0)
    assert [e.matrix is not None for e in state.plan] == [
        True, True, True, False, False, True]
    for t in range(3):   # a fresh Q, then warm ones
        grads = grads_of(t)
        mean = powersgd.step(state, grads, mpi_sum, WORLD.size)
        for got, want, g in zip(mean, exact_mean(grads), grads):
            assert got.shape == g.shape and got.dtype == g.dtype
            numpy.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
        # What is left over, summed over the ranks, is rounding.
        for index, total in zip(sorted(state.errors),
                                mpi_sum([state.errors[i]
                                         for i in sorted(state.errors)])):
            assert numpy.abs(total).max() < 1e-10, index


@pytest.mark.parametrize('feedback', [True, False])
def test_error_feedback_accumulates_what_was_not_sent(feedback):
    """Sum over the steps of the means, plus the ranks' mean residual, is
    the mean of the sum of the gradients: nothing is lost, only late."""
    state = powersgd.PowerSGDState(SHAPES, rank=1, start_iter=0,
                                   min_compression_rate=0,
                                   use_error_feedback=feedback)
    sent = [numpy.zeros(s) for s in SHAPES]
    given = [numpy.zeros(s) for s in SHAPES]
    for t in range(6):
        grads = grads_of(t)
        for a, b, g in zip(sent, powersgd.step(state, grads, mpi_sum,
                                               WORLD.size), grads):
            a += b
        for a, g in zip(given, exact_mean(grads)):
            a += g
    if not feedback:
        assert state.errors == {}
        # Rank 1 loses much: the sums differ.
        assert numpy.abs(sent[1] - given[1]).max() > 0.1
        return
    residual = {i: s for i, s in zip(sorted(state.errors), mpi_sum(
        [state.errors[i] for i in sorted(state.errors)]))}
    for index, (a, b) in enumerate(zip(sent, given)):
        late = residual.get(index)
        if late is not None:
            a = a + late.reshape(a.shape) / WORLD.size
            if min(late.shape) > 1:   # rank 1 held some back
                assert numpy.abs(late).max() > 0.1
        numpy.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-10)


def test_plain_averaging_before_start_iter():
    state = powersgd.PowerSGDState(SHAPES, rank=1, start_iter=2,
                                   min_compression_rate=0)
    calls = []
    for t in range(4):
        grads = grads_of(t)
        mean = powersgd.step(state, grads,
                             lambda a: mpi_sum(a, calls), WORLD.size)
        if t < 2:
            for got, want in zip(mean, exact_mean(grads)):
                numpy.testing.assert_allclose(got, want, rtol=1e-12)
    # One all-reduction of everything, then the Ps (with the vector and
    # the empty array) and the Qs.
    assert calls == [6, 6, 6, 4, 6, 4]
    assert state.iteration == 4


def test_every_rank_ends_with_the_same_bits():
    state = powersgd.PowerSGDState(SHAPES, rank=2, start_iter=1,
                                   min_compression_rate=0)
    for t in range(4):
        mean = powersgd.step(state, grads_of(t, numpy.float32), mpi_sum,
                             WORLD.size)
        assert same_on_every_rank(mean)
        assert same_on_every_rank([state.qs[i] for i in sorted(state.qs)])
    # The residuals are each rank's own.
    if WORLD.size > 1:
        assert not same_on_every_rank([state.errors[0]])


def test_a_zero_gradient_does_not_freeze_the_warm_q():
    state = powersgd.PowerSGDState([(5, 8)], rank=5, start_iter=0,
                                   min_compression_rate=0)
    zero = [numpy.zeros((5, 8))]
    assert not powersgd.step(state, zero, mpi_sum, WORLD.size)[0].any()
    assert numpy.abs(state.qs[0]).min() > 0   # redrawn, not zero
    grads = grads_of(1, shapes=[(5, 8)])
    mean = powersgd.step(state, grads, mpi_sum, WORLD.size)
    numpy.testing.assert_allclose(mean[0], exact_mean(grads)[0], rtol=1e-9)


def test_float16_gradients_are_computed_in_float32():
    state = powersgd.PowerSGDState(SHAPES, rank=2, start_iter=0,
                                   min_compression_rate=0)
    grads = grads_of(0, numpy.float16)
    mean = powersgd.step(state, grads, mpi_sum, WORLD.size)
    assert [m.dtype for m in mean] == [numpy.float16] * len(SHAPES)
    assert {e.dtype for e in state.errors.values()} == {
        numpy.dtype(numpy.float32)}
    assert {q.dtype for q in state.qs.values()} == {
        numpy.dtype(numpy.float32)}


# -- the state --------------------------------------------------------------

def test_a_fresh_state_draws_the_same_q_everywhere():
    entry = powersgd.plan([(4, 6)], rank=2, min_compression_rate=0)[0]
    state = powersgd.PowerSGDState([(4, 6)], rank=2)
    q = state.q_for(entry, numpy.float32, numpy)
    assert q.shape == (6, 2) and same_on_every_rank([q])
    assert q.tobytes() == powersgd.random_q(0, 0, 6, 2,
                                            numpy.float32).tobytes()
    other = powersgd.PowerSGDState([(4, 6)], rank=2, seed=1)
    assert other.q_for(entry, numpy.float32, numpy).tobytes() != q.tobytes()


# -- on the GPU ---------------------------------------------------------------

def test_on_the_gpu(cupy):
    """The same functions on CuPy arrays: the exact mean at full rank,
    means close to the CPU's."""
    def gpu_sum(arrays):
        return [cupy.asarray(s) for s in mpi_sum([a.get() for a in arrays])]

    settings = dict(rank=30, start_iter=0, min_compression_rate=0)
    gpu = powersgd.PowerSGDState(SHAPES, **settings)
    cpu = powersgd.PowerSGDState(SHAPES, **settings)
    for t in range(2):
        grads = grads_of(t)
        mean = powersgd.step(gpu, [cupy.asarray(g) for g in grads], gpu_sum,
                             WORLD.size)
        assert all(isinstance(m, cupy.ndarray) for m in mean)
        on_cpu = powersgd.step(cpu, grads, mpi_sum, WORLD.size)
        for got, want, other in zip(mean, exact_mean(grads), on_cpu):
            numpy.testing.assert_allclose(got.get(), want, rtol=1e-9,
                                          atol=1e-12)
            numpy.testing.assert_allclose(got.get(), other, rtol=1e-9,
                                          atol=1e-12)
        assert same_on_every_rank([m.get() for m in mean])
    q = powersgd.orthogonalize(cupy.asarray(numpy.random.RandomState(
        3).standard_normal((50, 4))))
    numpy.testing.assert_allclose((q.T @ q).get(), numpy.eye(4), atol=1e-12)
