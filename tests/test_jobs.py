"""Whole mpiexec jobs, launched from the serial pass with a timeout, for
what must end a job rather than hang it."""

import pytest

from conftest import run_mpi

pytestmark = pytest.mark.spawn

CRASH = '''
import sys, numpy, mnopt
from conftest import make_model
comm = mnopt.create_communicator(sys.argv[1])
model = make_model([(1000,)])
model.p000.grad = numpy.ones(1000, numpy.float32)
if comm.rank == 1:
    raise RuntimeError('rank 1 fell over')
comm.multi_node_mean_grad(model)   # rank 0 would wait here forever
print('rank 0 should never get here')
'''


@pytest.mark.parametrize('module_runner', [True, False],
                         ids=['python-m-mpi4py', 'plain-python'])
@pytest.mark.parametrize('name', ['flat', 'hierarchical'])
def test_uncaught_exception_on_one_rank_ends_the_job(name, module_runner):
    proc = run_mpi(2, 'import sys; sys.path.insert(0, "tests")\n' + CRASH,
                   args=[name], timeout=60, module_runner=module_runner)
    assert proc.returncode != 0
    assert 'rank 1 fell over' in proc.stderr
    assert 'should never get here' not in proc.stdout


MISMATCH = '''
import sys, numpy, mnopt
sys.path.insert(0, 'tests')
from conftest import make_model
comm = mnopt.create_communicator('flat')
model = make_model([(3,), (4 + comm.rank,)])
for _, p in model.namedparams():
    p.grad = numpy.zeros(p.shape, numpy.float32)
try:
    comm.multi_node_mean_grad(model)
except mnopt.LayoutMismatchError as e:
    print('rank %d: %s' % (comm.rank, e))
'''


def test_layout_mismatch_is_reported_by_every_rank():
    proc = run_mpi(2, MISMATCH, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for r in (0, 1):
        assert ("rank %d: ranks would reduce gradients that do not line up "
                "(rank 0 vs rank 1): gradient #1 is '/p001' (4,) float32 vs "
                "'/p001' (5,) float32" % r) in proc.stdout
