"""mnopt/transport/ring_pace.py: how long the ring's waits nap, from the
rate its last ring over the same communicator measured; and a ring that
waits at a measured pace still sums to the same bits.

Runs serially and under mpiexec -n 2, -n 3."""

import numpy
import pytest
from mpi4py import MPI

from mnopt.transport import ring
from mnopt.transport import ring_pace
from mnopt.transport import waiting
from conftest import WORLD

pytestmark = pytest.mark.many_ranks


@pytest.fixture(autouse=True)
def fresh():
    ring_pace.forget()
    yield
    ring_pace.forget()


def test_before_any_ring_the_pace_is_prompts():
    assert ring_pace.seconds_per_byte(WORLD) is None
    assert ring_pace.pace(None, 1 << 20) == waiting.PROMPT


def test_naps_are_half_the_time_the_bytes_in_flight_take():
    # 1 Gbit/s: 8 ns a byte; 2 MiB in flight take 16.8 ms, half is
    # beyond LONGEST; 64 KiB take 0.52 ms, half 0.26 ms; as the ring
    # drains, its last bytes bring the naps down to SHORTEST.
    ring_pace.measured(WORLD, 125 << 20, 1.05)
    per_byte = ring_pace.seconds_per_byte(WORLD)
    assert per_byte == pytest.approx(1.05 / (125 << 20))
    nap, busy = ring_pace.pace(per_byte, 2 << 20)
    assert nap == ring_pace.LONGEST and busy is None
    nap, busy = ring_pace.pace(per_byte, 64 << 10)
    assert nap == pytest.approx(0.5 * (64 << 10) * per_byte)
    assert busy is None
    assert ring_pace.pace(per_byte, 1024)[0] == ring_pace.SHORTEST


def test_a_fast_link_keeps_the_naps_short():
    ring_pace.measured(WORLD, 1 << 30, 0.01)   # 100 GB/s
    per_byte = ring_pace.seconds_per_byte(WORLD)
    assert ring_pace.pace(per_byte, 2 << 20)[0] == ring_pace.SHORTEST


def test_a_small_ring_says_nothing_about_the_rate():
    ring_pace.measured(WORLD, ring_pace.MIN_BYTES - 1, 10.0)
    ring_pace.measured(WORLD, 1 << 20, 0.0)
    assert ring_pace.seconds_per_byte(WORLD) is None


def test_each_communicator_keeps_its_own_rate():
    other = WORLD.Dup()
    try:
        ring_pace.measured(WORLD, 1 << 20, 1.0)
        assert ring_pace.seconds_per_byte(other) is None
        assert ring_pace.seconds_per_byte(WORLD) == 1.0 / (1 << 20)
    finally:
        other.Free()


def test_each_thread_keeps_its_own_rate():
    import threading
    ring_pace.measured(WORLD, 1 << 20, 1.0)
    seen = []
    t = threading.Thread(target=lambda: seen.append(
        ring_pace.seconds_per_byte(WORLD)))
    t.start()
    t.join()
    assert seen == [None]


def test_the_larger_direction_in_flight_sets_the_naps(monkeypatch):
    calls = []
    monkeypatch.setattr(ring_pace.waiting, 'wait_some',
                        lambda reqs, stats, **kw: calls.append((reqs, kw)))
    per_byte = 1e-8
    ring_pace.wait_some(per_byte, [('r1', 's1', 1000), ('r2', 's2', 3000)],
                        [('r3', 's3', 5000)])
    (reqs, kw), = calls
    assert reqs == ['r1', 'r2', 'r3']
    assert kw['max_nap'] == ring_pace.pace(per_byte, 5000)[0]
    assert kw['busy_poll'] is None
    ring_pace.wait_some(per_byte, [], [])      # nothing in flight
    assert len(calls) == 1


def test_a_ring_measures_its_rate_and_sums_the_same_at_any_pace():
    comm = WORLD.Dup()
    try:
        n, rank = comm.size, comm.rank
        parts = [numpy.arange(300000, dtype=numpy.float32) * (rank + 1),
                 numpy.full(7, rank + 1, numpy.float32)]
        want = [numpy.arange(300000, dtype=numpy.float32) * sum(
            range(1, n + 1)), numpy.full(7, sum(range(1, n + 1)),
                                          numpy.float32)]
        first = [p.copy() for p in parts]
        ring.allreduce_sum_parts(comm, first, 'float32')
        if n > 1:   # the ring moved 1.2 MB: a rate is known
            assert ring_pace.seconds_per_byte(comm) is not None
        # The slowest pace there is: naps of LONGEST throughout.
        ring_pace.measured(comm, 1 << 20, 100.0)
        second = [p.copy() for p in parts]
        ring.allreduce_sum_parts(comm, second, 'float32')
        for a, b, w in zip(first, second, want):
            assert a.tobytes() == b.tobytes()
            numpy.testing.assert_array_equal(a, w)
    finally:
        comm.Free()


def test_a_freed_communicators_rate_is_not_a_new_ones():
    other = WORLD.Dup()
    ring_pace.measured(other, 1 << 20, 1.0)
    other.Free()
    del other
    again = WORLD.Dup()     # MPI may hand out the same handle again
    try:
        assert ring_pace.seconds_per_byte(again) is None
    finally:
        again.Free()


def test_one_slow_ring_slows_the_rate_by_at_most_half():
    ring_pace.measured(WORLD, 1 << 20, 0.001)
    ring_pace.measured(WORLD, 1 << 20, 1.0)     # 1000x slower
    assert ring_pace.seconds_per_byte(WORLD) == pytest.approx(
        ring_pace.MOST_SLOWER * 0.001 / (1 << 20))
    ring_pace.measured(WORLD, 1 << 20, 0.0001)  # faster: taken at once
    assert ring_pace.seconds_per_byte(WORLD) == pytest.approx(
        0.0001 / (1 << 20))


def test_the_rate_is_the_median_time_between_messages():
    # 10 messages of 1 MiB, 1 ms apart, then one 1 s pause.
    arrived = [(0.001 * k, 1 << 20) for k in range(10)]
    arrived.append((arrived[-1][0] + 1.0, 1 << 20))
    ring_pace.measured_arrivals(WORLD, arrived)
    assert ring_pace.seconds_per_byte(WORLD) == pytest.approx(
        0.001 / (1 << 20))
    ring_pace.forget()
    ring_pace.measured_arrivals(WORLD, arrived[:1])   # one message: no rate
    assert ring_pace.seconds_per_byte(WORLD) is None


def _parts(comm):
    return [numpy.arange(300000, dtype=numpy.float32) * (comm.rank + 1)]


def test_the_ring_naps_at_the_measured_pace(monkeypatch):
    if WORLD.size == 1:
        pytest.skip('needs two ranks: one rank runs no ring')
    comm = WORLD.Dup()
    naps = []
    real = waiting.wait_some

    def recorded(requests, statuses=None, **kw):
        naps.append((kw['max_nap'], kw['busy_poll']))
        return real(requests, statuses, **kw)

    monkeypatch.setattr(waiting, 'wait_some', recorded)
    late = comm.rank == comm.size - 1
    try:
        ring_pace.measured(comm, 1 << 20, 1.0)   # a slow link: 1 MB/s
        if late:   # so that the others wait for it
            import time
            time.sleep(0.2)
        ring.allreduce_sum_parts(comm, _parts(comm), 'float32', check=False)
    finally:
        comm.Free()
    # Every wait of the ring at the measured pace, none at PROMPT's; with
    # 150 kB or more in flight at 1 MB/s the naps are the longest.
    assert all(busy is None for _, busy in naps)
    if not late:
        assert naps and max(nap for nap, _ in naps) == ring_pace.LONGEST


def test_a_late_peer_is_not_taken_for_a_slow_link():
    if WORLD.size == 1:
        pytest.skip('needs two ranks: one rank runs no ring')
    import time
    comm = WORLD.Dup()
    try:
        if comm.rank == comm.size - 1:
            time.sleep(0.5)
        ring.allreduce_sum_parts(comm, _parts(comm), 'float32', check=False)
        per_byte = ring_pace.seconds_per_byte(comm)
    finally:
        comm.Free()
    # The ring received about 1.2 MB * (N-1)/N * 2: at the median time
    # between its messages, far less than the 0.5 s the last rank was
    # late (on every rank: at 3 ranks the middle one waits mid-ring).
    received = 2 * 4 * 300000 * (WORLD.size - 1) // WORLD.size
    assert per_byte is not None and per_byte * received < 0.25
