"""mnopt/transport/cpu_phases.py: the CPU of a thread's averagings, phase
by phase (check, pack, wire, divide, sum, unpack, wait, bookkeeping),
each without the phases inside it and without the waits' CPU, so that
the phases add up to no more than the thread's CPU; and an averaging on
the background thread fills every phase it goes through.

Runs serially (the whole averaging path of one rank,
MNOPT_SINGLE_RANK_AVERAGING=1) and under mpiexec -n 2, -n 3 (on the ring).
"""

import threading
import time

import numpy
import pytest

import mnopt
from mnopt.transport import cpu_phases
from mnopt.transport import wait_tallies
from conftest import WORLD

pytestmark = pytest.mark.many_ranks


def spin(seconds):
    """Spend about ``seconds`` of this thread's CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def run_on_a_thread(work):
    """(a copy of its Tally, its CPU seconds) of a new thread that ran
    ``work()``."""
    got = []

    def body():
        start = time.thread_time()
        work()
        got.append((wait_tallies.mine().copy(), time.thread_time() - start))
    t = threading.Thread(target=body)
    t.start()
    t.join()
    return got[0]


def test_nested_phases_count_their_own_cpu_only():
    def work():
        with cpu_phases.phase('bookkeeping'):
            spin(0.01)
            with cpu_phases.phase('wire'):
                spin(0.02)
                with cpu_phases.phase('sum'):
                    spin(0.01)
            with cpu_phases.phase('unpack'):
                spin(0.005)
    tally, cpu = run_on_a_thread(work)
    phases = tally.phases
    assert set(phases) == {'bookkeeping', 'wire', 'sum', 'unpack', 'wait'}
    assert phases['sum'] >= 0.01
    assert 0.02 <= phases['wire'] < 0.02 + 0.005
    assert 0.01 <= phases['bookkeeping'] < 0.01 + 0.005
    assert phases['unpack'] >= 0.005
    assert phases['wait'] == 0.0
    assert sum(phases.values()) <= cpu
    assert tally.open_phases == []


def test_the_waits_cpu_goes_to_wait_not_to_the_phase():
    def work():
        with cpu_phases.phase('bookkeeping'):
            with cpu_phases.phase('wire'):
                start = time.thread_time()
                spin(0.02)
                # As waiting.wait_some tallies its C loop's polls.
                wait_tallies.mine().cpu_s += time.thread_time() - start
    tally, cpu = run_on_a_thread(work)
    phases = tally.phases
    assert phases['wait'] >= 0.02
    assert phases['wire'] < 0.005
    assert phases['bookkeeping'] < 0.005
    assert sum(phases.values()) <= cpu


def test_a_phase_an_exception_leaves_is_counted_and_closed():
    def work():
        with pytest.raises(KeyError):
            with cpu_phases.phase('pack'):
                spin(0.005)
                raise KeyError('x')
    tally, _ = run_on_a_thread(work)
    assert tally.phases['pack'] >= 0.005
    assert tally.open_phases == []


def test_a_copy_keeps_the_figures_not_the_open_phases():
    with cpu_phases.phase('check'):
        copy = wait_tallies.mine().copy()
        assert wait_tallies.mine().open_phases
    assert copy.open_phases == []
    assert copy.phases is not wait_tallies.mine().phases


def test_ring_steps_are_timed_only_with_the_setting(monkeypatch):
    calls = []

    def fn(a):
        calls.append(a)
        return a + 1
    monkeypatch.delenv('MNOPT_PROFILE_THREADS', raising=False)
    assert cpu_phases.timed('sum', fn) is fn
    assert cpu_phases.timed('sum', None) is None
    monkeypatch.setenv('MNOPT_PROFILE_THREADS', '1')
    wrapped = cpu_phases.timed('sum', fn)
    assert wrapped is not fn

    def work():
        assert wrapped(1) == 2
    tally, _ = run_on_a_thread(work)
    assert calls == [1] and 'sum' in tally.phases
    monkeypatch.setenv('MNOPT_PROFILE_THREADS', 'yes')
    with pytest.raises(ValueError, match='MNOPT_PROFILE_THREADS'):
        cpu_phases.detailed()


@pytest.mark.parametrize('profile', ['0', '1'])
def test_a_background_averaging_fills_its_phases(monkeypatch, profile):
    """A few MB averaged on the background thread, on the ring (in place:
    float32 arrays of 64 KiB and more), and a small array packed: every
    phase it goes through has CPU, the phases add up to no more than the
    thread's CPU, and the bits are the synchronous averaging's."""
    monkeypatch.setenv('MNOPT_ALLREDUCE', 'ring')
    monkeypatch.setenv('MNOPT_SINGLE_RANK_AVERAGING', '1')
    monkeypatch.setenv('MNOPT_PROFILE_THREADS', profile)
    comm = mnopt.create_communicator('flat', bucket_bytes=1 << 20)
    try:
        rng = numpy.random.RandomState(WORLD.rank)
        sizes = [(1 << 20) // 4, 3 * (1 << 18), 100]   # ~4 MB, a small one

        def grads():
            return [('g%d' % i, rng.standard_normal(n).astype(numpy.float32))
                    for i, n in enumerate(sizes)]
        named = grads()
        expected = [(n, a.copy()) for n, a in named]
        comm.mean_grads(expected)
        background = comm._background()

        def figures():   # on the background thread
            return time.thread_time(), wait_tallies.mine().copy().phases
        cpu0, before = background.submit(figures).result()
        comm.mean_grads_async(named).wait()
        cpu, after = background.submit(figures).result()
        cpu -= cpu0
        tid = background.submit(threading.get_native_id).result()
        assert wait_tallies.everyone()[tid].phases == after
        got = {k: v - before.get(k, 0.0) for k, v in after.items()}
        must = {'check', 'pack', 'wire', 'unpack', 'bookkeeping'}
        if profile == '1':
            must.add('divide')
            if WORLD.size > 1:
                must.add('sum')
        else:
            assert got.get('divide', 0.0) == 0.0
            assert got.get('sum', 0.0) == 0.0
        assert set(got) <= set(cpu_phases.PHASES)
        assert {k for k in must if got.get(k, 0.0) <= 0.0} == set()
        assert got.get('wait', 0.0) >= 0.0
        assert sum(got.values()) <= cpu
        for (_, a), (_, b) in zip(named, expected):
            assert a.tobytes() == b.tobytes()
    finally:
        comm.finalize()
