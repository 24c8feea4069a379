"""mnopt/transport/ring.py: the pipelined ring's reduce-scatter, all-gather
and allreduce, against the exact order the module promises (chunk c summed as
x[c+1] + x[c+2] + ... + x[c]), a float64 reference, and every rank's bits.

Runs serially and under mpiexec -n 2, -n 3 (and -n 4).
"""

import os
import time

import numpy
import pytest
from mpi4py import MPI

import mnopt
from mnopt.transport import allreduce
from mnopt.transport import buffers
from mnopt.codecs import grad_buffer as gb
from mnopt.transport import ring
from conftest import WORLD, run_mpi, slack

# Also under mpiexec -n 3: ring segments and neighbours differ at 3 ranks.
pytestmark = pytest.mark.many_ranks

N = WORLD.size
WIRES = ['float32', 'float64', 'float16', 'bfloat16']
EPS = {'float16': 2.0 ** -10, 'bfloat16': 2.0 ** -7,
       'float32': 2.0 ** -23, 'float64': 2.0 ** -52}
# 0, 1, fewer than N, not divisible by N (nor, with tiny segments, by the
# segment size), and several segments per chunk with default segments.
SIZES = [0, 1, 2, 7, 1001, 100003]


@pytest.fixture(params=['default', 'tiny'])
def segments(request, monkeypatch):
    """Default segments, or tiny ones (3 elements of 2 or 4 bytes, window
    of 2): many segments per chunk, a last one shorter, the window full."""
    if request.param == 'tiny':
        monkeypatch.setattr(ring, 'SEGMENT_BYTES', 12)
        monkeypatch.setattr(ring, 'MIN_SEGMENT_BYTES', 12)
        monkeypatch.setattr(ring, 'WINDOW', 2)
    return request.param


def rank_values(n, rank, seed=0):
    rng = numpy.random.RandomState(1000 * seed + rank)
    return rng.standard_normal(n) * 4


def to_wire(values, wire):
    if wire == 'bfloat16':
        return gb.float32_to_bfloat16_bits(values.astype(numpy.float32))
    return values.astype(wire)


def from_wire(array, wire):
    if wire == 'bfloat16':
        return gb.bfloat16_bits_to_float32(array).astype(numpy.float64)
    return array.astype(numpy.float64)


def even_counts(n, size=N):
    return [n * (c + 1) // size - n * c // size for c in range(size)]


def ring_order_sum(inputs, wire, counts):
    """What every rank must hold: chunk c summed in the ring's order,
    x[c+1] + x[c+2] + ... + x[c], each pairwise sum in the wire dtype."""
    add = ring._adder(wire)
    out = inputs[0].copy()
    start = 0
    for c, count in enumerate(counts):
        piece = slice(start, start + count)
        total = inputs[(c + 1) % N][piece].copy()
        for j in range(2, N + 1):
            into = inputs[(c + j) % N][piece].copy()
            add(total, into)   # into = total + into, as the ring sums
            total = into
        out[piece] = total
        start += count
    return out


def everyone_has_the_same_bits(array):
    everyone = WORLD.allgather(array.tobytes())
    return all(b == everyone[0] for b in everyone)


def tolerance(wire, inputs):
    """|sum - exact| bound: rounding each input to the wire and each of
    the N-1 pairwise sums."""
    scale = sum(numpy.abs(from_wire(x, wire)) for x in inputs) + 1e-300
    return scale * (N + 1) * EPS[wire]


@pytest.mark.parametrize('wire', WIRES)
@pytest.mark.parametrize('n', SIZES)
def test_allreduce_sums_in_the_ring_order_on_every_rank(wire, n, segments):
    if segments == 'tiny' and n > 10000:
        pytest.skip('tens of thousands of messages: slow, and no new case')
    mine = to_wire(rank_values(n, WORLD.rank), wire)
    inputs = WORLD.allgather(mine)
    a = mine.copy()
    ring.allreduce_sum(WORLD, a, wire)
    assert everyone_has_the_same_bits(a)
    want = ring_order_sum(inputs, wire, even_counts(n))
    assert a.tobytes() == want.tobytes()
    exact = sum(rank_values(n, r) for r in range(N))
    err = numpy.abs(from_wire(a, wire) - exact)
    assert (err <= tolerance(wire, inputs) + EPS[wire] * numpy.abs(exact)
            ).all()


@pytest.mark.parametrize('wire', ['float32', 'float64'])
@pytest.mark.parametrize('n', [1, 7, 100003])
def test_the_same_bits_as_mpi_allreduce_at_two_ranks(wire, n, segments):
    if N != 2:
        pytest.skip('at two ranks every algorithm computes one a + b')
    mine = rank_values(n, WORLD.rank).astype(wire)
    by_ring, by_mpi = mine.copy(), mine.copy()
    ring.allreduce_sum(WORLD, by_ring, wire)
    WORLD.Allreduce(MPI.IN_PLACE, by_mpi, op=MPI.SUM)
    assert by_ring.tobytes() == by_mpi.tobytes()


@pytest.mark.parametrize('wire', ['float16', 'bfloat16'])
def test_16_bit_sums_at_two_ranks_round_once(wire):
    # At two ranks each element is wire(float32(a) + float32(b)): what
    # the previous (unpipelined) ring and MPI's user op computed.
    mine = to_wire(rank_values(4099, WORLD.rank), wire)
    inputs = WORLD.allgather(mine)
    a = mine.copy()
    ring.allreduce_sum(WORLD, a, wire)
    if N == 2:
        want = to_wire(from_wire(inputs[0], wire).astype(numpy.float32)
                       + from_wire(inputs[1], wire).astype(numpy.float32),
                       wire)
        assert a.tobytes() == want.tobytes()
    elif N == 1:
        assert a.tobytes() == mine.tobytes()


COUNT_SETS = {
    'even': lambda size: even_counts(1003, size),
    'uneven': lambda size: [5 + 97 * r for r in range(size)],
    'zeros': lambda size: [0 if r % 2 else 301 + r for r in range(size)],
    'all on the last': lambda size: [0] * (size - 1) + [1234],
    'none': lambda size: [0] * size,
}


@pytest.mark.parametrize('wire', WIRES)
@pytest.mark.parametrize('layout', sorted(COUNT_SETS))
def test_reduce_scatter_returns_this_ranks_chunk_summed(wire, layout,
                                                        segments):
    counts = COUNT_SETS[layout](N)
    n = sum(counts)
    mine = to_wire(rank_values(n, WORLD.rank, seed=1), wire)
    inputs = WORLD.allgather(mine)
    a = mine.copy()
    own = ring.reduce_scatter_sum(WORLD, a, wire, counts)
    start = sum(counts[:WORLD.rank])
    assert own.size == counts[WORLD.rank]
    assert numpy.shares_memory(own, a) or own.size == 0
    want = ring_order_sum(inputs, wire, counts)[start:start + own.size]
    assert own.tobytes() == want.tobytes()


@pytest.mark.parametrize('dtype', ['float32', 'int8', 'complex128',
                                   'uint16'])
@pytest.mark.parametrize('layout', sorted(COUNT_SETS))
def test_allgather_fills_every_chunk(dtype, layout, segments):
    counts = COUNT_SETS[layout](N)
    full = (numpy.arange(sum(counts)) % 101).astype(dtype)
    a = numpy.zeros_like(full)
    start = sum(counts[:WORLD.rank])
    a[start:start + counts[WORLD.rank]] = \
        full[start:start + counts[WORLD.rank]]
    assert ring.allgather_into(WORLD, a, counts) is a
    assert a.tobytes() == full.tobytes()


@pytest.mark.parametrize('wire', WIRES)
def test_reduce_scatter_then_allgather_is_the_allreduce(wire, segments):
    # ZeRO's pair: the sharded sum, then everyone's shard to everyone.
    counts = COUNT_SETS['uneven'](N)
    mine = to_wire(rank_values(sum(counts), WORLD.rank, seed=2), wire)
    inputs = WORLD.allgather(mine)
    a = mine.copy()
    ring.reduce_scatter_sum(WORLD, a, wire, counts)
    ring.allgather_into(WORLD, a, counts)
    assert a.tobytes() == ring_order_sum(inputs, wire, counts).tobytes()
    assert everyone_has_the_same_bits(a)


@pytest.mark.parametrize('wire', ['float32', 'bfloat16'])
def test_parts_in_one_ring_are_each_summed_as_alone(wire, segments):
    # One ring for all parts (one latency), but each part chunked on its
    # own: the bits of an allreduce of that part alone (the overlapped
    # optimizer sums bucket by bucket what the synchronous one sums at once).
    sizes = [3, 0, 1, 70001 if segments == 'default' else 701, 5, 4096, 2]
    mine = [to_wire(rank_values(s, WORLD.rank, seed=3 + i), wire)
            for i, s in enumerate(sizes)]
    parts = [m.copy() for m in mine]
    ring.allreduce_sum_parts(WORLD, parts, wire)
    for part, summed in zip(mine, parts):
        inputs = WORLD.allgather(part)
        want = ring_order_sum(inputs, wire, even_counts(part.size))
        assert summed.tobytes() == want.tobytes()


def _cut(array, cuts):
    """``array`` as parts cut at ``cuts`` (fractions of its size; empty
    parts where two cuts meet)."""
    at = [0] + [int(array.size * f) for f in cuts] + [array.size]
    return [array[a:b] for a, b in zip(at, at[1:])]


# Parts that split chunks, chunks that span parts, empty parts, one part.
CUTS = {'one': [], 'many': [0.0, 0.1, 0.1, 0.33, 0.5, 0.51, 0.9, 1.0],
        'small first': [0.001, 0.002]}


@pytest.mark.parametrize('wire', WIRES)
@pytest.mark.parametrize('layout', ['uneven', 'zeros', 'all on the last'])
@pytest.mark.parametrize('cuts', sorted(CUTS))
def test_reduce_scatter_of_parts_is_that_of_their_concatenation(
        wire, layout, cuts, segments):
    # The sharded optimizer sums the gradients where they are: each
    # element of this rank's chunk gets the bits of the packed
    # reduce-scatter, wherever the parts are cut.
    counts = COUNT_SETS[layout](N)
    mine = to_wire(rank_values(sum(counts), WORLD.rank, seed=5), wire)
    whole = mine.copy()
    own = ring.reduce_scatter_sum(WORLD, whole, wire, counts)
    a = mine.copy()
    parts = _cut(a, CUTS[cuts])
    assert ring.reduce_scatter_sum_parts(WORLD, parts, wire, counts) is None
    start = sum(counts[:WORLD.rank])
    assert a[start:start + own.size].tobytes() == own.tobytes()
    assert all(numpy.shares_memory(p, a) for p in parts if p.size)


@pytest.mark.parametrize('layout', ['uneven', 'zeros', 'all on the last'])
@pytest.mark.parametrize('cuts', sorted(CUTS))
def test_allgather_of_parts_fills_every_chunk_where_it_is(layout, cuts,
                                                          segments):
    # Parts of different dtypes (parameters of mixed precision): bytes.
    counts = COUNT_SETS[layout](N)
    full = (numpy.arange(sum(counts)) % 251).astype(numpy.uint8)
    a = numpy.zeros_like(full)
    start = sum(counts[:WORLD.rank])
    a[start:start + counts[WORLD.rank]] = \
        full[start:start + counts[WORLD.rank]]
    parts = _cut(a, CUTS[cuts])
    # Reinterpret the parts whose byte size allows it as wider dtypes.
    typed = [p.view(numpy.float32) if p.size % 4 == 0 and p.size
             and p.ctypes.data % 4 == 0 else p for p in parts]
    ring.allgather_parts(WORLD, typed, counts)
    assert a.tobytes() == full.tobytes()


def test_parts_of_mismatched_sizes_are_an_error_on_every_rank():
    if N == 1:
        pytest.skip('needs two ranks')
    # The same number of parts, one a different size on the last rank.
    sizes = [5, 7, 9 + (WORLD.rank == N - 1)]
    parts = [numpy.ones(s, numpy.float32) for s in sizes]
    counts = even_counts(21, N)
    with pytest.raises(ValueError, match='add up to 21 but the parts hold '
                       '22' if WORLD.rank == N - 1 else
                       'bad arguments on rank %d: counts add up' % (N - 1)):
        ring.reduce_scatter_sum_parts(WORLD, parts, 'float32', counts)
    # Counts that match each rank's own parts, but not the others'.
    counts = even_counts(sum(sizes), N)
    with pytest.raises(ValueError, match='disagree on the buffer'):
        ring.reduce_scatter_sum_parts(WORLD, parts, 'float32', counts)
    with pytest.raises(ValueError, match='disagree on the buffer'):
        ring.allgather_parts(WORLD, parts, [4 * c for c in counts])
    # A part of another dtype than the wire: named, on every rank.
    bad = [numpy.ones(5, numpy.float32), numpy.ones(
        5, numpy.float64 if WORLD.rank == 0 else numpy.float32)]
    with pytest.raises(ValueError, match='part 1: .*float64' if
                       WORLD.rank == 0 else 'bad arguments on rank 0'):
        ring.reduce_scatter_sum_parts(WORLD, bad, 'float32', even_counts(10))
    # Still in step afterwards.
    d = [numpy.ones(3, numpy.float32), numpy.ones(4, numpy.float32)]
    ring.reduce_scatter_sum_parts(WORLD, d, 'float32', even_counts(7))
    start = sum(even_counts(7)[:WORLD.rank])
    assert (numpy.concatenate(d)[start:start + even_counts(7)[WORLD.rank]]
            == N).all()


# ------------------------------------------------------------------ errors

def test_mismatched_sizes_are_an_error_on_every_rank():
    if N == 1:
        pytest.skip('needs two ranks')
    a = numpy.ones(10 + WORLD.rank, numpy.float32)
    with pytest.raises(ValueError, match='disagree on the buffer'):
        ring.allreduce_sum(WORLD, a, 'float32')
    counts = even_counts(a.size)
    with pytest.raises(ValueError, match='disagree on the buffer'):
        ring.reduce_scatter_sum(WORLD, a, 'float32', counts)
    with pytest.raises(ValueError, match='disagree on the buffer'):
        ring.allgather_into(WORLD, a, counts)
    # The same size, different counts.
    b = numpy.ones(20, numpy.float32)
    counts = [20 - 0] + [0] * (N - 1) if WORLD.rank == 0 else \
        [0] * (N - 1) + [20]
    with pytest.raises(ValueError, match='different counts'):
        ring.reduce_scatter_sum(WORLD, b, 'float32', counts)
    # The same size, different wires.
    wire = 'float16' if WORLD.rank == 0 else 'bfloat16'
    c = numpy.ones(20, gb.storage_dtype(wire))
    with pytest.raises(ValueError, match='disagree on the buffer'):
        ring.allreduce_sum(WORLD, c, wire)


def test_bad_arguments_on_one_rank_are_an_error_on_every_rank():
    a = numpy.ones(12, numpy.float32)
    counts = even_counts(12)
    bad_rank = N - 1
    if WORLD.rank == bad_rank:
        counts = counts[:-1] + [counts[-1] + 1]    # adds up to 13
    # The rank at fault says what is wrong; the others, who and what.
    with pytest.raises(ValueError, match='add up to 13'):
        ring.reduce_scatter_sum(WORLD, a, 'float32', counts)
    b = numpy.ones(12, numpy.float64 if WORLD.rank == bad_rank
                   else numpy.float32)
    with pytest.raises(ValueError, match='float32' if WORLD.rank == bad_rank
                       else 'bad arguments on rank %d: .*float32' % bad_rank):
        ring.allreduce_sum(WORLD, b, 'float32')
    with pytest.raises(ValueError, match='one size >= 0 per rank'):
        ring.allgather_into(WORLD, a, [12] + [0] * (
            N - 1 + (WORLD.rank == bad_rank)))
    with pytest.raises(ValueError, match='unknown wire'):
        ring.allreduce_sum(WORLD, a, 'float8')
    # Still in step afterwards.
    d = numpy.ones(5, numpy.float32)
    ring.allreduce_sum(WORLD, d, 'float32')
    assert (d == N).all()


def test_a_strided_array_is_refused():
    a = numpy.ones(20, numpy.float32)[::2]
    with pytest.raises(ValueError, match='contiguous'):
        ring.allreduce_sum(WORLD, a, 'float32')


# ------------------------------------------------- selection in allreduce_sum

@pytest.mark.parametrize('algorithm', ['ring', 'mpi', 'auto'])
@pytest.mark.parametrize('wire', WIRES)
def test_allreduce_sum_agrees_with_itself_across_algorithms(algorithm, wire):
    mine = to_wire(rank_values(30011, WORLD.rank, seed=5), wire)
    a, b = mine.copy(), mine.copy()
    allreduce.allreduce_sum(WORLD, a, wire, algorithm)
    ring.allreduce_sum(WORLD, b, wire)
    assert everyone_has_the_same_bits(a)
    if N <= 2 or allreduce.uses_ring(WORLD, wire, a.nbytes, algorithm):
        assert a.tobytes() == b.tobytes()
    else:
        inputs = WORLD.allgather(mine)
        exact = sum(from_wire(x, wire) for x in inputs)
        assert (numpy.abs(from_wire(a, wire) - exact)
                <= tolerance(wire, inputs)).all()


def test_auto_keeps_mpi_inside_one_node_and_for_small_sums():
    if buffers.nodes_of(WORLD) != 1:
        pytest.skip('a test for one shared-memory node')
    big = allreduce.RING_MIN_BYTES * 16
    assert not allreduce.uses_ring(WORLD, 'float32', big, 'auto')
    assert not allreduce.uses_ring(WORLD, 'float32', 4, 'auto')
    assert allreduce.uses_ring(WORLD, 'float16', 4, 'auto') == (N > 1)
    assert allreduce.uses_ring(WORLD, 'float32', 4, 'ring') == (N > 1)
    assert not allreduce.uses_ring(WORLD, 'bfloat16', big, 'mpi')


def test_the_setting_is_read_and_checked(monkeypatch):
    monkeypatch.setenv('MNOPT_ALLREDUCE', 'ring')
    assert allreduce.allreduce_algorithm() == 'ring'
    monkeypatch.setenv('MNOPT_ALLREDUCE', '')
    assert allreduce.allreduce_algorithm() == 'auto'
    monkeypatch.setenv('MNOPT_ALLREDUCE', 'nccl')
    with pytest.raises(ValueError, match="MNOPT_ALLREDUCE='nccl'"):
        allreduce.allreduce_algorithm()


@pytest.mark.parametrize('name', ['flat', 'hierarchical', 'naive'])
def test_a_bad_setting_on_one_rank_fails_create_communicator_everywhere(
        name, monkeypatch):
    bad_rank = N - 1
    if WORLD.rank == bad_rank:
        monkeypatch.setenv('MNOPT_ALLREDUCE', 'Ring')
    with pytest.raises((ValueError, RuntimeError),
                       match='MNOPT_ALLREDUCE'):
        mnopt.create_communicator(name)


@pytest.mark.parametrize('name', ['flat', 'hierarchical',
                                  'hierarchical-1-per-node'])
@pytest.mark.parametrize('wire', ['float32', 'float16'])
def test_communicators_average_alike_on_the_ring_and_on_mpi(
        name, wire, monkeypatch):
    if name == 'hierarchical-1-per-node':
        # Every rank its own node: the leaders' allreduce spans all ranks.
        monkeypatch.setenv('MNOPT_RANKS_PER_NODE', '1')
        name = 'hierarchical'
    shapes = [(3,), (300, 257), (5, 7), (40000,), (1,)]
    rng = numpy.random.RandomState(WORLD.rank)
    grads = [rng.standard_normal(s).astype(numpy.float32) for s in shapes]
    results = {}
    for algorithm in ('ring', 'mpi'):
        monkeypatch.setenv('MNOPT_ALLREDUCE', algorithm)
        comm = mnopt.create_communicator(name, allreduce_grad_dtype=wire)
        assert comm.allreduce_algorithm == algorithm
        named = [('g%d' % i, g.copy()) for i, g in enumerate(grads)]
        comm.mean_grads(named)
        comm.finalize()
        results[algorithm] = numpy.concatenate([g.ravel() for _, g in named])
        assert everyone_has_the_same_bits(results[algorithm])
    everyone = WORLD.allgather(numpy.concatenate([g.ravel() for g in grads]))
    exact = sum(x.astype(numpy.float64) for x in everyone) / N
    for got in results.values():
        numpy.testing.assert_allclose(got, exact, rtol=0,
                                      atol=(N + 2) * 8 * EPS[wire])
    if N <= 2 and wire == 'float32':
        assert results['ring'].tobytes() == results['mpi'].tobytes()


STALLED_RING = r'''
import sys, time, numpy, mnopt
comm = mnopt.create_communicator('flat', allreduce_grad_dtype='float16',
                                 stall_warning=1, timeout=4)
grads = [('w', numpy.ones(300000, numpy.float32))]
comm.mean_grads(grads)
if comm.rank == 2:
    if sys.argv[1] == 'exit':
        sys.exit(0)
    time.sleep(60)
start = time.monotonic()
comm.mean_grads(grads)
print('finished without rank 2')
'''


@pytest.mark.spawn
@pytest.mark.parametrize('how', ['exit', 'sleep'])
def test_a_rank_missing_from_the_ring_is_reported_not_waited_for(how):
    # The ring's waits poll: the watchdog reports the missing rank and
    # ends the job (at once when it exited, at the timeout when it sleeps).
    start = time.monotonic()
    proc = run_mpi(3, STALLED_RING, timeout=50, args=[how],
                   module_runner=False)
    took = time.monotonic() - start
    assert proc.returncode != 0
    assert 'finished without rank 2' not in proc.stdout
    if how == 'exit':
        assert 'rank 2 exited without entering it' in proc.stderr
    else:
        assert 'not arrived: rank 2' in proc.stderr
        assert 'Timeout (4 s, MNOPT_TIMEOUT)' in proc.stderr
    assert took < 40


@pytest.mark.parametrize('wire', ['float32', 'float16'])
def test_a_thread_that_yields_sums_the_same_bits(wire, segments):
    """mnopt's background thread waits by yielding the core
    (ring.yield_while_waiting): the same sum, and its waits still end."""
    import threading
    mine = to_wire(rank_values(3001, WORLD.rank), wire)
    napped, yielded = mine.copy(), mine.copy()
    ring.allreduce_sum(WORLD, napped, wire)
    seen = []

    def on_a_thread():
        ring.yield_while_waiting()
        seen.append(ring.waits_by_yielding())
        ring.allreduce_sum(WORLD, yielded, wire)
    t = threading.Thread(target=on_a_thread)
    t.start()
    t.join(slack(120))
    assert not t.is_alive()
    assert seen == [hasattr(os, 'sched_yield')]
    assert not ring.waits_by_yielding()   # only that thread's
    assert yielded.tobytes() == napped.tobytes()


def test_the_background_thread_yields_where_it_got_a_short_slice():
    from mnopt.common import _sched
    comm = mnopt.create_communicator('flat')
    background = comm._background()
    slice_ns = background.submit(_sched.thread_slice_ns).result()
    granted = slice_ns == 1000 * _sched.slice_us() and _sched.slice_us() > 0
    assert background.submit(ring.waits_by_yielding).result() == granted
    assert not ring.waits_by_yielding()
    comm.finalize()


@pytest.mark.parametrize('wire', ['float32', 'float64'])
def test_dividing_at_first_use_gives_the_bits_of_dividing_first(wire,
                                                                segments):
    """``allreduce_sum_parts(divide=, divided=)`` divides each segment of
    the parts not yet divided just before the ring first uses it (as
    ``flat`` does with the gradients it sums in place): the bits of
    dividing every part first, each element divided once."""
    sizes, divisor = [5, 3001, 1, 40, 700], 3.0

    def parts():
        return [rank_values(n, WORLD.rank + k).astype(wire)
                for k, n in enumerate(sizes)]
    first = parts()
    for p in first:
        numpy.divide(p, divisor, out=p)
    ring.allreduce_sum_parts(WORLD, first, wire)
    divided = [k % 2 == 1 for k in range(len(sizes))]
    lazy, calls = parts(), []
    for p, done in zip(lazy, divided):
        if done:
            numpy.divide(p, divisor, out=p)

    def divide(view):
        calls.append(view.size)
        numpy.divide(view, divisor, out=view)
    ring.allreduce_sum_parts(WORLD, lazy, wire, divide=divide,
                             divided=divided)
    assert [p.tobytes() for p in lazy] == [p.tobytes() for p in first]
    assert sum(calls) == sum(n for n, done in zip(sizes, divided)
                             if not done)
