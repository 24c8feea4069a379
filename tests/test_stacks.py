"""The stacks mnopt runs on: the core without Chainer, Chainer 7.8.1 under
NumPy 2 whatever is imported first, clear words for a wrong GPU stack.

Each case runs in a fresh interpreter (import order and sys.modules are
what is tested).  Without Chainer installed (the core stack) the core
cases run as they are; with it, Chainer is hidden from them."""

import os
import subprocess
import sys

import numpy
import pytest

from conftest import REPO, needs_chainer, run_mpi, slack

# NumPy, Chainer and the MPI library are what differ between stacks: every
# test here runs on every stack (every_stack), but the benchmark run.
pytestmark = pytest.mark.spawn
every_stack = pytest.mark.every_stack

NUMPY2 = int(numpy.__version__.split('.')[0]) >= 2

# Hides Chainer the way an environment without it behaves: `import chainer`
# raises ImportError.
NO_CHAINER = "import sys; sys.modules['chainer'] = None\n"

CORE = NO_CHAINER + r'''
import sys
import numpy
import mnopt
world = mnopt.create_communicator('flat').mpi_comm
r, n = world.rank, world.size
for name, options in [('flat', {'allreduce_grad_dtype': 'float16'}),
                      ('hierarchical', {}), ('naive', {}),
                      ('reduction_server', {'allreduce_grad_dtype': 'bfloat16'}),
                      ('flat', {'compression': 'sign'})]:
    comm = mnopt.create_communicator(name, **options)
    grads = [('a', numpy.full(5, r + 1.0, numpy.float32)),
             ('b', numpy.arange(6, dtype=numpy.float64).reshape(2, 3) * (r + 1))]
    comm.mean_grads(grads)
    if options.get('compression') == 'sign':
        want_a = numpy.full(5, (n + 1) / 2.0)   # all signs +1, mean scale
    else:
        want_a = numpy.full(5, (n + 1) / 2.0)
        numpy.testing.assert_allclose(grads[1][1], numpy.arange(6).reshape(
            2, 3) * (n + 1) / 2.0, rtol=1e-2)
    numpy.testing.assert_allclose(grads[0][1], want_a, rtol=1e-2)
    later = [('a', numpy.full(3, 2.0 * r, numpy.float32))]
    comm.mean_grads_async(later).wait()
    if not options.get('compression'):
        assert (later[0][1] == n - 1).all(), (name, later)
    comm.finalize()
assert 'chainer' not in [m.split('.')[0] for m in sys.modules
                         if sys.modules[m] is not None], 'chainer was imported'
try:
    mnopt.create_multi_node_optimizer
except ImportError as e:
    assert "pip install 'mnopt[chainer]'" in str(e), e
else:
    raise AssertionError('the Chainer layer imported without Chainer')
print('core OK on rank %d' % r)
'''


@every_stack
@pytest.mark.parametrize('n', [1, 2, 3])
def test_the_core_works_without_chainer(n):
    proc = run_mpi(n, CORE, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('core OK') == n


# A benchmark run (20 s): on the first stack only; what a stack changes in
# it, the core's averaging without Chainer, the job above checks.
def test_the_benchmark_runs_without_chainer(tmp_path):
    out = tmp_path / 'bench.json'
    code = NO_CHAINER + ('import runpy\nrunpy.run_module("mnopt.benchmark", '
                         'run_name="__main__")\n')
    proc = run_mpi(2, code, timeout=240, args=[
        '--quick', '--only-mnopt', '--reps', '1', '--communicators', 'flat',
        'reduction_server', '--dtypes', 'float16', 'sign', '--json',
        str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'mnopt flat float16' in proc.stdout
    assert 'mnopt reduction_server sign' in proc.stdout
    assert out.exists()


def python(code, env=None):
    """Run ``code`` in a fresh interpreter of this environment (site
    initialisation, .pth files included) from outside the checkout, with
    the checkout first on the path."""
    return subprocess.run(
        [sys.executable, '-c', code], capture_output=True, text=True,
        timeout=slack(120), cwd='/', env=dict(os.environ, PYTHONPATH=REPO,
                                       **(env or {})))


SCTYPES = r'''
import numpy
s = numpy.sctypes
assert s['int'] == [numpy.int8, numpy.int16, numpy.int32, numpy.int64], s
assert s['uint'] == [numpy.uint8, numpy.uint16, numpy.uint32, numpy.uint64]
assert s['float'] == [numpy.float16, numpy.float32, numpy.float64,
                      numpy.longdouble], s
assert s['complex'] == [numpy.complex64, numpy.complex128, numpy.clongdouble]
'''


@every_stack
@needs_chainer
@pytest.mark.parametrize('first', ['chainer', 'mnopt'])
def test_chainer_imports_before_or_after_mnopt(first):
    """Under NumPy 2 through the hook (the .pth that pip installs with
    mnopt, or mnopt's own import); under NumPy 1 there is nothing to do."""
    second = 'mnopt' if first == 'chainer' else 'chainer'
    proc = python('import %s, %s\nimport numpy\nimport chainer.functions as F\n'
                  'print(F.sum(numpy.ones(3, numpy.float32)).array)\n'
                  % (first, second) + SCTYPES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == '3.0'


@every_stack
@pytest.mark.skipif(not NUMPY2, reason='NumPy 1 has numpy.sctypes')
@needs_chainer
def test_without_the_hook_chainer_fails_under_numpy2():
    """The hook is what makes Chainer work (and import mnopt restores it)."""
    unhook = ('import _mnopt_chainer_numpy2 as h; h.uninstall_import_hook()\n'
              'import numpy\nassert "sctypes" not in vars(numpy)\n')
    proc = python(unhook + 'import chainer\n')
    assert proc.returncode != 0
    assert 'sctypes' in proc.stderr
    proc = python(unhook + 'import mnopt, chainer\nprint(chainer.__version__)')
    assert proc.returncode == 0, proc.stderr[-3000:]


@every_stack
def test_numpy_is_left_alone_unless_chainer_is_imported():
    proc = python('import numpy, mnopt\n'
                  'print("sctypes" in vars(numpy), "chainer" in sys.modules)'
                  .replace('import numpy', 'import sys, numpy'))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # NumPy 1 has its own sctypes; NumPy 2 gets none just for mnopt.
    assert proc.stdout.split() == [str(not NUMPY2), 'False']


@every_stack
def test_added_names_are_added_once_and_only_when_missing():
    """sctypes under NumPy 2; numpy.distutils where numpy has none (Python
    3.12+); nothing under NumPy 1 on Python 3.11."""
    proc = python(
        'import importlib.util, sys, numpy\n'
        'missing = [n for n, gone in [\n'
        '    ("sctypes", "sctypes" not in dir(numpy)),\n'
        '    ("distutils.system_info",\n'
        '     importlib.util.find_spec("numpy.distutils") is None)] if gone]\n'
        'import _mnopt_chainer_numpy2 as h\n'
        'assert h.add_missing_numpy_names() == missing, missing\n'
        'assert h.add_missing_numpy_names() == []\n'
        'from numpy.distutils.system_info import get_info\n'
        'print(missing, type(get_info("blas_opt")).__name__)\n' + SCTYPES)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = (['sctypes'] if NUMPY2 else []) + (
        ['distutils.system_info'] if sys.version_info >= (3, 12) else [])
    assert proc.stdout.strip() == '%s dict' % want


@every_stack
def test_a_wrong_gpu_stack_names_the_fix():
    from mnopt.gpu import diagnosis
    assert diagnosis.stack_conflict({}, '2.1.0') is None
    assert diagnosis.stack_conflict({'cupy-cuda13x': '14.2.0'}, '2.3.1') is None
    assert diagnosis.stack_conflict({'cupy-cuda12x': '13.6.0'}, '1.26.4') is None
    msg = diagnosis.stack_conflict({'cupy-cuda12x': '14.0.1'}, '1.26.4')
    assert 'CuPy 14.0.1 needs NumPy 2' in msg
    assert "pip install 'numpy>=2,<2.6'" in msg and "mnopt[gpu]" in msg
    msg = diagnosis.stack_conflict({'cupy-cuda12x': '13.6.0',
                                'cupy-cuda13x': '14.2.0'}, '2.3.1')
    assert 'cupy-cuda12x' in msg and 'cupy-cuda13x' in msg
    assert 'pip uninstall' in msg


@every_stack
def test_what_is_missing_for_a_gpu_names_the_fix():
    """Here (no GPU): without CuPy, the extras to install; with a CuPy that
    cannot load NCCL, the NCCL wheel to install."""
    from mnopt.gpu import diagnosis
    problem = diagnosis.gpu_problem()
    try:
        import cupy  # NOQA
    except ImportError:
        assert "pip install 'mnopt[gpu-cuda13]'" in problem, problem
        return
    from cupy.cuda import nccl
    if not getattr(nccl, 'available', True):
        assert 'pip install nvidia-nccl-cu' in problem, problem
    elif problem is not None:
        assert 'GPU' in problem, problem
