"""Colocated reduction servers (every worker serves a shard on two
threads): their requests are counted per channel, and a communicator
dropped without finalize() stops its threads.  Serially and under
mpiexec -n 2 / -n 3."""

import gc
import threading
import time

import numpy
import pytest

import mnopt
from conftest import WORLD

# Also under mpiexec -n 3: server shares split unevenly over 3 processes.
pytestmark = pytest.mark.many_ranks


def test_requests_are_counted_per_channel():
    """The sync and async server threads share the communicator's
    monitor: counted apart, a stall report's '#k' is the same on every
    rank whichever thread counts first."""
    if WORLD.size == 1:
        pytest.skip('one rank moves nothing')
    comm = mnopt.create_communicator('reduction_server')
    grads = [('w', numpy.ones(100, numpy.float32))]
    for _ in range(3):
        comm.mean_grads(grads)
        comm.mean_grads_async(grads).wait()
    comm.mean_grads(grads)
    counts = comm._monitor._counts
    assert (counts.get('serve.sync'), counts.get('serve.async')) == (4, 3)
    assert 'serve' not in counts
    comm.finalize()


def _server_threads():
    return [t for t in threading.enumerate()
            if t.name == 'mnopt-colocated-server']


def test_a_dropped_communicator_stops_its_server_threads():
    before = len(_server_threads())
    for k in range(30):
        comm = mnopt.create_communicator('reduction_server')
        grads = [('w', numpy.full(10, comm.rank, numpy.float32))]
        comm.mean_grads(grads)
        assert (grads[0][1] == (comm.size - 1) / 2.0).all()
        del comm   # every rank at the same point; no finalize()
    gc.collect()
    # Each thread ends once every worker's goodbye is in (the other ranks
    # drop theirs at the same point, a little earlier or later).
    deadline = time.monotonic() + 60
    while len(_server_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_server_threads()) <= before
    WORLD.Barrier()


def test_a_goodbye_under_way_keeps_its_channels(monkeypatch):
    """A collected communicator's goodbye is said on the janitor thread
    while the main thread may be making the next communicator, which frees
    the channels of the colocated servers that ended.  This rank's server
    threads end as soon as every worker's goodbye reached them, which can
    be before this rank's own goodbye has left for the other ranks'
    servers: its channels must stay until it has (seen under load at
    -n 2: the janitor's Send on a freed channel)."""
    if WORLD.size == 1:
        pytest.skip('one rank says goodbye to itself only')
    from mnopt.server import job as server_job
    comm = mnopt.create_communicator('reduction_server')
    servers = comm._colocated
    go, errors = threading.Event(), []
    if comm.rank == 0:
        say_goodbye = server_job.say_goodbye

        def held_back(channels, workers):
            # All but the async channel's goodbyes to the other ranks'
            # servers; those once the main thread has made the next one.
            workers = list(workers)
            say_goodbye(channels[:1], workers)
            say_goodbye(channels[1:], workers[:1])   # this rank's own
            assert go.wait(120), 'the test never let the goodbye go on'
            say_goodbye(channels[1:], workers[1:])
        monkeypatch.setattr(server_job, 'say_goodbye', held_back)

        def close():
            try:
                servers.close(False)
            except Exception as e:   # NOQA: reported by the assertion
                errors.append(e)
        closing = threading.Thread(target=close)
        closing.start()
        # Every goodbye reached this rank's servers: their threads end.
        deadline = time.monotonic() + 60
        while any(t.is_alive() for t in servers.threads):
            assert time.monotonic() < deadline, 'the server threads ran on'
            time.sleep(0.01)
    else:
        servers.close(False)
    following = mnopt.create_communicator('reduction_server')
    go.set()
    if comm.rank == 0:
        closing.join(120)
        assert not closing.is_alive()
    assert errors == []
    grads = [('w', numpy.full(10, comm.rank, numpy.float32))]
    following.mean_grads(grads)
    assert (grads[0][1] == (comm.size - 1) / 2.0).all()
    following.finalize()
    comm.finalize()


def _wakeups(thread):
    """How often a thread has given up its core so far (sleeps, waits):
    Linux's voluntary context switches, /proc/self/task/TID/status."""
    with open('/proc/self/task/%d/status' % thread.native_id) as f:
        for line in f:
            if line.startswith('voluntary_ctxt_switches:'):
                return int(line.split()[1])
    raise AssertionError('no voluntary_ctxt_switches in /proc')


def test_idle_server_threads_sleep_between_averagings():
    """Between averagings a colocated server thread sleeps until its own
    worker starts the next exchange (or 50 ms pass): polling MPI with
    naps of up to 1 ms cost the CPU the training needs.  Counted in
    wake-ups, which load does not change: about 20 in an idle second
    (polling: hundreds to a thousand)."""
    import os
    if not os.path.exists('/proc/self/task'):
        pytest.skip('needs Linux /proc')
    comm = mnopt.create_communicator('reduction_server')
    grads = [('w', numpy.full(1000, comm.rank, numpy.float32))]
    comm.mean_grads(grads)
    comm.mean_grads_async(grads).wait()
    threads = comm._colocated.threads
    before = [_wakeups(t) for t in threads]
    time.sleep(1.0)
    woke = [_wakeups(t) - b for t, b in zip(threads, before)]
    # Every rank's counts, so that every rank passes or fails alike.
    everyone = comm.mpi_comm.allgather(woke)
    assert max(max(w) for w in everyone) < 150, everyone
    # Woken at the next exchange, on each channel.
    grads = [('w', numpy.full(1000, comm.rank, numpy.float32))]
    comm.mean_grads(grads)
    assert (grads[0][1] == (comm.size - 1) / 2.0).all()
    grads = [('w', numpy.full(1000, comm.rank, numpy.float32))]
    comm.mean_grads_async(grads).wait()
    assert (grads[0][1] == (comm.size - 1) / 2.0).all()
    comm.finalize()
