"""mnopt's own messages never reach the user's receives, and none is left
unreceived when a job ends (issue 35, items 8 and 9).

A ChainerMN user may receive with ``comm.recv_obj(MPI.ANY_SOURCE)`` (any
tag) while mnopt exchanges objects inside an update, an evaluator or an
object collective: that receive must get the user's message.  And a
healthy job must end without a message that nobody received (UCX reports
each at MPI_Finalize)."""

import pickle
import threading
import time

import numpy
import pytest
from mpi4py import MPI

import mnopt
from conftest import WORLD, chainer, make_model, run_mpi, slack

# Also under mpiexec -n 3: a third rank's messages interleave with mnopt's.
pytestmark = pytest.mark.many_ranks


def _communicator():
    # A short stall timeout: on a defect, the rank whose message was
    # taken waits for it and the job ends soon, instead of at 600 s.
    return mnopt.create_communicator('naive', stall_warning=0,
                                     timeout=slack(60))


def _update(comm):
    model = chainer.links.Linear(3, 2)
    optimizer = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(), comm)
    optimizer.setup(model)
    for _ in range(2):   # the first update broadcasts, the second averages
        model.cleargrads()
        loss = chainer.functions.sum(
            model(numpy.full((1, 3), comm.rank, numpy.float32)))
        loss.backward()
        optimizer.update()
    return float(model.W.array.sum())


def _evaluate(comm):
    class Evaluator(object):
        def evaluate(self):
            return {'loss': float(comm.rank)}
    evaluator = mnopt.create_multi_node_evaluator(Evaluator(), comm)
    return evaluator.evaluate()['loss']


def _mean_grad(comm):
    model = make_model([(4,)])
    model.p000.grad = numpy.full(4, comm.rank, numpy.float32)
    comm.multi_node_mean_grad(model)
    return float(model.p000.grad[0])


#: Exchanges that ran point-to-point messages to rank 0 on the user's
#: communicator (or next to it): name -> (function, the result on every
#: rank as a function of the size).
EXCHANGES = {
    'optimizer update': (_update, None),
    'multi-node evaluator': (_evaluate, lambda n: (n - 1) / 2),
    'multi_node_mean_grad': (_mean_grad, lambda n: (n - 1) / 2),
    'gather_obj': (lambda c: c.gather_obj(c.rank, root=0),
                   lambda n: None),
    'allgather_obj': (lambda c: c.allgather_obj(c.rank),
                      lambda n: list(range(n))),
    'scatter_obj from rank 1': (
        lambda c: c.scatter_obj(
            [10 * r for r in range(c.size)] if c.rank == 1 else None,
            root=1), None),
}


@pytest.mark.parametrize('name', sorted(EXCHANGES))
def test_a_receive_from_any_rank_gets_the_users_message(name):
    if WORLD.size < 2:
        pytest.skip('a message from rank 1 to rank 0 needs two ranks')
    if name == 'optimizer update' and chainer is None:
        pytest.skip('the core stack has no Chainer')
    comm = _communicator()
    exchange, expected = EXCHANGES[name]
    got = {}

    def receive():
        status = MPI.Status()
        try:
            got['message'] = comm.recv_obj(MPI.ANY_SOURCE, status=status)
            got['source'] = status.Get_source()
        except Exception as e:   # the old defect: mnopt's piece, unpickled
            got['error'] = repr(e)

    receiver = None
    if comm.rank == 0:
        receiver = threading.Thread(target=receive, daemon=True)
        receiver.start()
        time.sleep(0.3)   # the receive is posted before any exchange
    result = exchange(comm)
    if comm.rank == 1:
        comm.send_obj('user', dest=0, tag=5)
    if receiver is not None:
        receiver.join(slack(60))
        assert not receiver.is_alive(), 'the user\'s message never came'
        assert got == {'message': 'user', 'source': 1}
    if name == 'gather_obj':
        assert result == (list(range(comm.size)) if comm.rank == 0 else None)
    elif name.startswith('scatter_obj'):
        assert result == 10 * comm.rank
    elif expected is not None:
        assert result == expected(comm.size)
    else:   # the update: the same parameters on every rank
        assert len(set(comm.allgather_obj(result))) == 1
    comm.finalize()


def test_an_object_that_does_not_pickle_is_an_error_on_every_rank():
    comm = _communicator()
    bad = lambda: None   # NOQA: E731 (a local lambda does not pickle)
    last = comm.size - 1
    for call in (lambda o: comm.gather_obj(o, root=0),
                 lambda o: comm.allgather_obj(o),
                 lambda o: comm.bcast_obj(o, root=last)):
        with pytest.raises((RuntimeError, pickle.PicklingError,
                            AttributeError, TypeError)) as e:
            call(bad if comm.rank == last else comm.rank)
        if comm.rank != last:
            assert 'rank(s) %d could not be pickled' % last in str(e.value)
    with pytest.raises((RuntimeError, pickle.PicklingError, AttributeError,
                        TypeError)) as e:
        comm.scatter_obj([bad] * comm.size if comm.rank == last else None,
                         root=last)
    if comm.rank != last:
        assert 'could not be pickled' in str(e.value)
    with pytest.raises(ValueError, match=r'one object per rank \(%d\), got '
                       r'%d' % (comm.size, comm.size + 1)):
        comm.scatter_obj(list(range(comm.size + 1)) if comm.rank == 0
                         else None)
    # Still in step: the next collective works.
    assert comm.allgather_obj(comm.rank) == list(range(comm.size))
    comm.finalize()


# ------------------------------------------------ nothing left unreceived
LAST_WORDS = r'''
import atexit, sys
from mpi4py import MPI


def nothing_pending():
    # Registered before mnopt's at-exit protocol, so it runs after it.
    from mnopt.stall import watchdog as stall_watchdog
    MPI.COMM_WORLD.Barrier()
    dog = stall_watchdog.the_watchdog()
    for m in dog._monitors + getattr(dog, '_leaving', []):
        if m.comm != MPI.COMM_NULL and m.comm.Iprobe(MPI.ANY_SOURCE,
                                                     MPI.ANY_TAG):
            print('pending on %s at rank %d' % (m.label, m.rank))


atexit.register(nothing_pending)
import numpy, mnopt
comms = [mnopt.create_communicator(name) for name in sys.argv[1].split(',')]
for c in comms:
    c.mean_grads([('w', numpy.ones(10, numpy.float32))])
    c.allreduce_obj(1)
comms[0].finalize()     # the others are left to the exit
print('done')
'''


@pytest.mark.spawn
@pytest.mark.parametrize('n, names', [
    (2, 'flat,naive,hierarchical'),
    (3, 'naive,reduction_server,flat')])
def test_a_healthy_job_leaves_no_message_unreceived(n, names):
    # MPICH's UCX reports every message left unreceived at MPI_Finalize
    # ("unexpected tag-receive descriptor ... was not matched") when the
    # ranks talk through UCX, as on several nodes: NOLOCAL makes the
    # ranks of one machine do so.  The job also checks with MPI itself
    # (any library) that nothing is pending on mnopt's monitors at exit.
    proc = run_mpi(n, LAST_WORDS, args=[names], timeout=120,
                   env={'MPIR_CVAR_NOLOCAL': '1', 'UCX_TLS': 'tcp'})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count('done') == n, proc.stdout
    assert 'pending' not in proc.stdout, proc.stdout
    assert 'was not matched' not in proc.stderr, proc.stderr
    assert 'mnopt:' not in proc.stderr, proc.stderr


FINALIZED_EARLY = r'''
import time, numpy, mnopt
comm = mnopt.create_communicator('flat', stall_warning=200, timeout=300)
grads = [('w', numpy.ones(10, numpy.float32))]
comm.mean_grads(grads)
if comm.rank == 1:
    comm.finalize()      # its last word on the communicator
    time.sleep(60)       # still alive: only the last word can tell
else:
    comm.mean_grads(grads)
'''


@pytest.mark.spawn
def test_a_rank_waiting_for_one_that_finalized_the_communicator_aborts():
    # The last word also goes out when a communicator is finalized: a
    # rank waiting on it for that rank aborts at once, not at the timeout.
    start = time.monotonic()
    proc = run_mpi(2, FINALIZED_EARLY, timeout=120, module_runner=False)
    assert proc.returncode != 0
    assert ('flat#0.mean_grads #2; rank 1 finalized or dropped its '
            'communicator (or its script ended) without entering it, so it '
            'cannot finish') in proc.stderr, \
        proc.stderr
    assert time.monotonic() - start < slack(50)
