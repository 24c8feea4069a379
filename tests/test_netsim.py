"""The simulated cluster: set-up, a 2-node run, tear-down.

Runs where root and network namespaces are available (CI here); skips with
the reason elsewhere.  Only the nodes' own addresses are used.
"""

import os
import subprocess
import sys

import pytest

from conftest import REPO, slack
from mnopt import netsim

# Network namespaces and shaped links are the machine's, not a test's:
# these run in a pass of their own, alone on the machine (the Makefile).
pytestmark = [pytest.mark.spawn, pytest.mark.machine_wide]

try:
    netsim.check_environment()
    UNAVAILABLE = None
except netsim.NetsimError as e:
    UNAVAILABLE = str(e)
needs_netns = pytest.mark.skipif(UNAVAILABLE is not None,
                                 reason=UNAVAILABLE or '')

PROBE = '''
import socket, sys, time, numpy
from mpi4py import MPI
import mnopt
comm = mnopt.create_communicator('hierarchical')
x = numpy.ones(int(sys.argv[1]) // 4, numpy.float32)
w = MPI.COMM_WORLD
w.Barrier()
t0 = time.perf_counter()
w.Allreduce(MPI.IN_PLACE, x)
dt = time.perf_counter() - t0
info = w.gather((socket.gethostname(), comm.intra_size, comm.inter_size,
                 float(x[0]), dt))
if w.rank == 0:
    print('RESULT', info)
'''


def run_probe(tmp_path, nodes, ranks_per_node, nbytes):
    script = tmp_path / 'probe.py'
    script.write_text(PROBE)
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, '-m', 'mnopt.netsim', 'exec', '--nodes', str(nodes),
         '--ranks-per-node', str(ranks_per_node), '--', sys.executable,
         str(script), str(nbytes)],
        capture_output=True, text=True, timeout=slack(120), env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith('RESULT')][0]
    return eval(line[len('RESULT'):])


@needs_netns
def test_two_shaped_nodes(tmp_path):
    try:
        netsim.up(2, rate='100mbit')
        netsim.up(2, rate='100mbit')  # idempotent
        assert netsim.namespaces() == ['mnopt-n0', 'mnopt-n1', 'mnopt-sw']
        info = run_probe(tmp_path, 2, 2, 2_500_000)
    finally:
        netsim.down()
    assert netsim.namespaces() == []
    netsim.down()  # idempotent
    hosts = [i[0] for i in info]
    assert hosts == ['mnopt-n0', 'mnopt-n0', 'mnopt-n1', 'mnopt-n1']
    assert all(i[1:3] == (2, 2) for i in info)       # 2 nodes x 2 ranks
    assert all(i[3] == 4.0 for i in info)            # the sum is right
    # A ring over 2 nodes sends 2.5 MB per node across a 100 Mbit/s link:
    # at least 0.2 s (the time is far shorter without the shaping).
    slowest = max(i[4] for i in info)
    assert 0.16 < slowest < 5, slowest


@needs_netns
def test_exec_refuses_when_the_cluster_is_down():
    netsim.down()
    proc = subprocess.run(
        [sys.executable, '-m', 'mnopt.netsim', 'exec', '--nodes', '2', '--',
         'true'], capture_output=True, text=True, timeout=slack(60),
        env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 2
    assert 'the cluster is not up' in proc.stderr


def test_refuses_without_root(monkeypatch):
    monkeypatch.setattr(os, 'geteuid', lambda: 1000)
    with pytest.raises(netsim.NetsimError, match='needs root'):
        netsim.check_environment()


def test_refuses_without_iproute2(monkeypatch):
    monkeypatch.setattr(os, 'geteuid', lambda: 0)
    monkeypatch.setattr(netsim.shutil, 'which', lambda tool: None)
    with pytest.raises(netsim.NetsimError, match='iproute2'):
        netsim.check_environment()


def test_node_count_is_bounded():
    with pytest.raises(netsim.NetsimError, match='--nodes'):
        netsim.up(0)


PAIRS = '''
import time, numpy
from mpi4py import MPI
w = MPI.COMM_WORLD
x = numpy.ones(1_250_000, numpy.uint8)  # 10 Mbit
times = []
for a, b in ((0, 1), (1, 2), (0, 2)):
    w.Barrier()
    t0 = time.perf_counter()
    if w.rank == a:
        w.Send(x, b)
    elif w.rank == b:
        w.Recv(x, a)
    w.Barrier()
    times.append(time.perf_counter() - t0)
if w.rank == 0:
    print('RESULT', times)
'''


@needs_netns
def test_chain_with_one_slow_link(tmp_path):
    """Nodes 0 - 1 - 2 in a chain, link 1 (between nodes 1 and 2) slow:
    0 -> 1 is fast, 1 -> 2 and 0 -> 2 (forwarded by node 1) are slow."""
    script = tmp_path / 'pairs.py'
    script.write_text(PAIRS)
    try:
        netsim.up(3, rate='1gbit', topology='chain', link_rates={1: '50mbit'})
        assert netsim.namespaces() == ['mnopt-n0', 'mnopt-n1', 'mnopt-n2']
        proc = subprocess.run(
            [sys.executable, '-m', 'mnopt.netsim', 'exec', '--nodes', '3',
             '--', sys.executable, str(script)],
            capture_output=True, text=True, timeout=slack(120),
            env=dict(os.environ, PYTHONPATH=REPO))
    finally:
        netsim.down()
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith('RESULT')][0]
    fast, slow, across = eval(line[len('RESULT'):])
    # 10 Mbit: 0.2 s at 50 Mbit/s, 0.01 s at 1 Gbit/s.
    assert 0.16 < slow < 5 and 0.16 < across < 5, (slow, across)
    assert fast < slow / 4, (fast, slow)


def test_bad_topology_and_links_are_refused():
    with pytest.raises(netsim.NetsimError, match='unknown topology'):
        netsim.up(3, topology='ring')
    with pytest.raises(netsim.NetsimError, match='no link 2 in a chain'):
        netsim.up(2, topology='chain', link_rates={2: '1mbit'})
    with pytest.raises(netsim.NetsimError, match='K=RATE'):
        netsim.parse_links(['middle=1mbit'])
    assert netsim.parse_links(['3=200mbit', '0=1gbit']) == {
        3: '200mbit', 0: '1gbit'}
