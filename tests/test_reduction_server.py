"""The reduction-server communicator, as whole MPMD jobs:
``mpiexec -n W python worker.py : -n S python -m mnopt.server``."""

import os
import sys

import pytest

from conftest import REPO, mpiexec, python_path, run_job as run_launcher
from mnopt.server.protocol import PROTOCOL_VERSION

pytestmark = pytest.mark.spawn

WORKER = r'''
import sys, numpy, mnopt
sys.path.insert(0, 'tests')
from param_models import make_model
from mnopt.codecs import grad_buffer as gb

wire = sys.argv[1]
comm = mnopt.create_communicator('reduction_server', allreduce_grad_dtype=wire,
                                 chunk_bytes=24)  # many chunks
codec = gb.HostCodec(wire)
for shapes in ([(3,), (5, 7), (1,), (0,), (11, 13, 3), (2000,)], [], [(1,)]):
    for it in range(3):
        model = make_model(shapes)
        rng = numpy.random.RandomState(100 * comm.rank + it)
        grads = [rng.standard_normal(s).astype(numpy.float32) * 100
                 for s in shapes]
        for (_, p), g in zip(sorted(model.namedparams()), grads):
            p.grad = g.copy()
        comm.multi_node_mean_grad(model)
        # The promise: a float32 sum of the wire-rounded inputs divided by
        # W, in worker order, rounded once to the wire dtype.
        everyone = comm.allgather_obj(grads)
        for k, (_, p) in enumerate(sorted(model.namedparams())):
            n = p.grad.size
            acc = numpy.zeros(n, numpy.float32)
            for w in range(comm.size):
                rounded = numpy.empty(n, gb.storage_dtype(wire))
                codec.encode(everyone[w][k].reshape(-1), rounded, comm.size)
                decoded = numpy.empty(n, numpy.float32)
                codec.decode(rounded, decoded)
                acc += decoded
            want = numpy.empty(n, gb.storage_dtype(wire))
            codec.encode(acc, want, 1)
            back = numpy.empty(n, numpy.float32)
            codec.decode(want, back)
            if comm.size == 1:
                back = everyone[0][k].reshape(-1)  # N=1: left untouched
            assert (p.grad.reshape(-1) == back).all(), (shapes, k, it)
# Double buffering through the same servers (the Chainer layer).
try:
    import chainer
except ImportError:
    print('OK worker %d of %d, %d servers' % (comm.rank, comm.size, comm.n_servers))
    sys.exit(0)
model = make_model([(4,), (300,)])
opt = mnopt.create_multi_node_optimizer(chainer.optimizers.SGD(lr=1.0), comm,
                                        double_buffering=True).setup(model)
for k in range(4):
    for _, p in model.namedparams():
        p.grad = numpy.full(p.shape, comm.rank + k, numpy.float32)
    opt.update()
opt.wait()
assert opt.t == 2
for _, p in model.namedparams():
    # applied: the means of iterations 1 and 2
    numpy.testing.assert_allclose(p.array, -(2 * (comm.size - 1) / 2.0 + 3),
                                  rtol=1e-2)
print('OK worker %d of %d, %d servers' % (comm.rank, comm.size, comm.n_servers))
'''


def run_job(workers, servers, wire='float32', worker_code=WORKER,
            server_args=(), timeout=120, worker_args=None, server_code=None):
    script = os.path.join(REPO, 'tests', '.rs_worker_%d.py' % os.getpid())
    with open(script, 'w') as f:
        f.write(worker_code)
    cmd = mpiexec() + ['-n', str(workers), sys.executable, '-m', 'mpi4py',
                       script] + list(worker_args if worker_args is not None else [wire])
    server = ['-m', 'mnopt.server']
    if server_code is not None:
        server = [script + '.server']
        with open(server[0], 'w') as f:
            f.write(server_code)
    if servers:
        cmd += [':', '-n', str(servers), sys.executable, '-m', 'mpi4py'] \
            + server + list(server_args)
    try:
        return run_launcher(cmd, timeout,
                            dict(os.environ, PYTHONPATH=python_path()))
    finally:
        os.remove(script)
        if server_code is not None:
            os.remove(server[0])


@pytest.mark.parametrize('servers', [
    0, pytest.param(1, marks=pytest.mark.every_mpi), 2])  # MPMD launch
@pytest.mark.parametrize('workers', [1, 2, 3])
def test_means_are_exact(workers, servers):
    proc = run_job(workers, servers)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for w in range(workers):
        assert 'OK worker %d of %d, %d servers' % (
            w, workers, servers or workers) in proc.stdout


@pytest.mark.parametrize('wire', ['float16', 'bfloat16'])
def test_16_bit_wires_are_exact(wire):
    proc = run_job(3, 2, wire, server_args=['--memory', '1'])  # 1 slot
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('OK worker') == 3


OTHER_COMMUNICATOR = '''
import mnopt
mnopt.create_communicator('flat')
'''


def test_servers_with_another_communicator_is_an_error():
    proc = run_job(2, 1, worker_code=OTHER_COMMUNICATOR, timeout=60)
    assert proc.returncode != 0
    assert "asks for the 'flat' communicator: use 'reduction_server'" \
        in proc.stderr


MISMATCH = '''
import numpy, mnopt
from mpi4py import MPI
comm = mnopt.create_communicator('reduction_server')
if comm.rank == 1:   # a worker that bypasses the cross-worker check
    comm._workers = comm._workers[:1]
model = __import__('param_models').make_model([(5,)])
model.p000.grad = numpy.ones(5, numpy.float32)
try:
    comm.multi_node_mean_grad(model)
except mnopt.LayoutMismatchError as e:
    print('worker %d: %s' % (comm.rank, e))
'''


def test_signature_mismatch_fails_fast_on_every_process():
    code = 'import sys; sys.path.insert(0, "tests")\n' + MISMATCH
    proc = run_job(2, 1, worker_code=code, timeout=60, worker_args=[])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for w in (0, 1):
        assert 'worker %d: the reduction servers refused' % w in proc.stdout
    assert 'worker 0 and worker 1 disagree on workers (protocol %d' % PROTOCOL_VERSION \
        in proc.stdout
    assert 'mnopt.server 0: refused a reduction' in proc.stderr


CRASH = '''
import os, sys, numpy, mnopt
sys.path.insert(0, 'tests')
from param_models import make_model
comm = mnopt.create_communicator('reduction_server')
model = make_model([(1000,)])
model.p000.grad = numpy.ones(1000, numpy.float32)
comm.multi_node_mean_grad(model)
if comm.rank == 1:
    raise RuntimeError('worker 1 fell over')
comm.multi_node_mean_grad(model)   # worker 0 would wait forever
print('should never get here')
'''


def test_a_crashed_worker_ends_the_job():
    proc = run_job(2, 1, worker_code=CRASH, timeout=60, worker_args=[])
    assert proc.returncode != 0
    assert 'worker 1 fell over' in proc.stderr
    assert 'should never get here' not in proc.stdout


def test_a_server_that_dies_at_start_up_ends_the_job():
    code = CRASH.replace("if comm.rank == 1:\n    raise RuntimeError('worker 1 "
                         "fell over')\n", '')
    # The server exits on a bad option while the workers start: they must
    # not wait for it forever.
    proc = run_job(2, 1, worker_code=code, timeout=60, worker_args=[],
                   server_args=['--no-such-option'])
    assert proc.returncode != 0
    assert 'should never get here' not in proc.stdout


SERVER_DIES_AFTER_ONE_REDUCTION = '''
import os, sys
from mnopt import server
from mnopt.server import loop as server_loop
serve_one = server_loop._reduce
def serve_then_die(*args, **kwargs):
    serve_one(*args, **kwargs)
    sys.stderr.write('server going down\\n')
    sys.stderr.flush()
    os._exit(3)   # no exception, no goodbye: as if the node died
server_loop._reduce = serve_then_die
server.main()
'''


def test_a_server_that_dies_mid_job_ends_the_job():
    code = CRASH.replace("if comm.rank == 1:\n    raise RuntimeError('worker 1 "
                         "fell over')\n", '')
    proc = run_job(2, 2, worker_code=code, timeout=90, worker_args=[],
                   server_code=SERVER_DIES_AFTER_ONE_REDUCTION)
    assert proc.returncode != 0
    assert 'server going down' in proc.stderr
    assert 'should never get here' not in proc.stdout


TWO_COMMUNICATORS = '''
import numpy, mnopt
comms = [mnopt.create_communicator('reduction_server', allreduce_grad_dtype=w)
         for w in ('float32', 'float16')]
for c in comms + comms[1:]:
    grads = [('w', numpy.full(1000, c.rank, numpy.float32))]
    c.mean_grads(grads)
    assert (grads[0][1] == (c.size - 1) / 2.0).all()
    comms[0].finalize()   # must not stop the servers for the other one
print('OK two communicators')
'''


def test_several_communicators_share_the_servers():
    proc = run_job(2, 2, worker_code=TWO_COMMUNICATORS, timeout=60,
                   worker_args=[])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('OK two communicators') == 2


POWERSGD_WORKER = r'''
import numpy, mnopt
from mpi4py import MPI
comm = mnopt.create_communicator('reduction_server', compression='powersgd',
                                 powersgd_rank=2, chunk_bytes=64)
world = comm.mpi_comm
for step in range(3):
    rng = numpy.random.RandomState(10 * step + comm.rank)
    named = [('w', rng.standard_normal((20, 30)).astype(numpy.float32)),
             ('b', rng.standard_normal(30).astype(numpy.float32))]
    before = [a.copy() for _, a in named]
    comm.mean_grads(named)
    mine = b''.join(a.tobytes() for _, a in named)
    assert all(o == mine for o in world.allgather(mine)), step
    # The bias is averaged whole; the matrix is a rank-2 approximation.
    exact = sum(world.allgather(before[1])) / comm.size
    numpy.testing.assert_allclose(named[1][1], exact, rtol=1e-5, atol=1e-6)
    assert numpy.linalg.matrix_rank(named[0][1].astype(numpy.float64),
                                    tol=1e-4) <= 2
print('OK powersgd worker %d, %d servers' % (comm.rank, comm.n_servers))
'''


def test_powersgd_factors_go_through_the_servers():
    proc = run_job(3, 2, worker_code=POWERSGD_WORKER, worker_args=[])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('OK powersgd worker') == 3
    assert '2 servers' in proc.stdout
