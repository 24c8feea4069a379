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
