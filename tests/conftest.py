"""Shared test helpers.  The same modules run serially and under
``mpiexec -n 2`` / ``-n 3`` (see the Makefile's ``test`` target)."""

import contextlib
import gc
import importlib.util
import json
import logging
import os
import re
import shutil
import shlex
import signal
import subprocess
import sys
import tempfile

import numpy
import pytest


def _drop_an_inherited_singleton():
    """pytest-xdist's workers are children of the controller, which made
    itself an Open MPI singleton by importing this module: they inherit the
    variables its MPI_Init set, and an mpiexec a worker starts reads
    OMPI_MCA_ess=singleton (that one alone is enough), takes the singleton
    component and exits at once with status 1, saying nothing.  Dropped
    (with the PMIx and ORTE ones) before this process's own MPI_Init.

    That MPI_Init sets them again in the C environment, not in
    ``os.environ`` (Python's copy, taken at start-up): spawned jobs must
    be given ``env`` built from ``os.environ`` (run_job's callers do), not
    inherit the process's environment."""
    if os.environ.get('OMPI_MCA_ess') != 'singleton':
        return
    for key in list(os.environ):
        if key.startswith(('PMIX_', 'OMPI_MCA_orte_')) or key in (
                'OMPI_MCA_ess', 'OMPI_MCA_pmix', 'OMPI_APP_CTX_NUM_PROCS'):
            del os.environ[key]


_drop_an_inherited_singleton()
from mpi4py import MPI  # NOQA  (initializes MPI)

import mnopt  # NOQA

# Chainer (None on the core stack), and the models and gradients tests and
# their spawned jobs average (the jobs import them from param_models,
# without pytest).
from param_models import chainer, expected_mean, make_model, rank_grads  # NOQA

WORLD = MPI.COMM_WORLD


def _measured_slowdown():
    """How much longer than its CPU time a fixed piece of work (about 0.15 s
    on an idle core) takes here and now: 1 on an idle machine, 3 to 5 with
    a busy process beside each core."""
    import time
    wall, cpu = time.perf_counter(), time.process_time()
    x = numpy.ones(1 << 16)
    for _ in range(1500):
        x = numpy.sqrt(x + 1.0)
    return (time.perf_counter() - wall) / max(time.process_time() - cpu, 1e-6)


#: How many pytest processes share the machine: pytest-xdist's workers
#: (the Makefile's serial pass runs two), else 1.
WORKERS = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT') or 1)

#: The factor every timeout and time bound in the tests is multiplied by:
#: MNOPT_TEST_SLOWDOWN if set, else measured at start-up (at least 1, at
#: most 4), so that a test's pass never depends on an idle machine.  Under
#: xdist at least the number of workers: they start together, so each
#: measures before the others' jobs load the machine.
SLOWDOWN = float(os.environ.get('MNOPT_TEST_SLOWDOWN') or
                 min(4.0, max(float(WORKERS),
                              round(_measured_slowdown(), 1))))


def slack(seconds):
    """``seconds`` of allowance (a timeout, an upper bound on how long
    something may take), scaled by SLOWDOWN."""
    return seconds * SLOWDOWN
CPU_COMMUNICATORS = ('naive', 'flat', 'hierarchical')


def pytest_configure(config):
    config.addinivalue_line(
        'markers', 'spawn: launches its own mpiexec job; runs only in the '
                   'serial pass (an mpiexec inside mpiexec is not supported)')
    config.addinivalue_line(
        'markers', 'long: runs in the process, but for as long as a '
                   'spawned job (tens of seconds): runs where spawned jobs '
                   'do, in the serial pass of the first stack (and, marked '
                   'every_mpi too, on a stack with another MPI library)')
    config.addinivalue_line(
        'markers', 'every_stack: a spawned job that runs on every stack, not '
                   'only the first (what NumPy, Chainer or the MPI library '
                   'and its launcher can change; see the Makefile)')
    config.addinivalue_line(
        'markers', 'every_mpi: a spawned job that runs on the first stack '
                   'and on every stack with another MPI library (what the '
                   'library and its launcher decide: how a job ends, MPMD '
                   'launches; see the Makefile)')
    config.addinivalue_line(
        'markers', 'machine_wide: sets up what is the whole machine\'s '
                   '(network namespaces, shaped links); the Makefile runs '
                   'these after the others, alone, not beside another '
                   'test')
    config.addinivalue_line(
        'markers', 'many_ranks: where the number of ranks changes what '
                   'is computed (ring segments, uneven shards and scatters, '
                   'votes, a middle rank): the first stack runs it under '
                   'mpiexec -n 3 too, the other stacks only it under -n 2 '
                   '(see the Makefile)')
    config.addinivalue_line(
        'markers', 'one_rank: does the same work at any number of ranks '
                   '(no communicator: docs, static checks, one process\'s '
                   'buffers and files): runs serially only, not under '
                   'mpiexec -n 2 (see the Makefile)')
    if WORLD.rank > 0:
        # Only rank 0 reports progress; failures on any rank still print.
        config.option.verbose = -1


def pytest_collection_modifyitems(config, items):
    if WORLD.size > 1:
        items[:] = [i for i in items if 'spawn' not in i.keywords]
    # pytest-timeout's limit (setup.cfg), scaled like every other allowance.
    limit = config.getini('timeout')
    if limit and SLOWDOWN != 1:
        for item in items:
            if item.get_closest_marker('timeout') is None:
                item.add_marker(pytest.mark.timeout(slack(float(limit))))


def pytest_collection_finish(session):
    # What is alive once the tests are collected (the modules, Chainer,
    # the test items) lives for the whole run: out of the collector's
    # sight, the collections the tests' own garbage triggers do not walk
    # it each time (the collector had about a sixth of an mpiexec -n 2
    # pass's CPU; freezing saved about 5% of its time).  The tests' own
    # objects are collected as before.
    gc.freeze()


def pytest_report_header(config):
    return 'mnopt: time allowances x%.1f (MNOPT_TEST_SLOWDOWN%s)' % (
        SLOWDOWN, '' if os.environ.get('MNOPT_TEST_SLOWDOWN') else
        ' unset: measured')


@pytest.fixture(params=CPU_COMMUNICATORS + ('reduction_server',))
def any_comm(request):
    """A communicator of every CPU kind, reduction_server workers (with
    colocated servers) included; finalized after the test."""
    import mnopt
    c = mnopt.create_communicator(request.param)
    yield c
    c.finalize()


@pytest.fixture
def naive_comm():
    """A naive communicator, finalized after the test (modules testing the
    ChainerMN-shaped pieces import it as their ``comm`` fixture)."""
    import mnopt
    c = mnopt.create_communicator('naive')
    yield c
    c.finalize()


@pytest.fixture
def cupy():
    """CuPy, where a GPU is usable; else the test skips (fails under
    MNOPT_REQUIRE_GPU=1, as on the GPU machine)."""
    from mnopt.gpu import diagnosis
    problem = diagnosis.gpu_problem()
    if problem is not None:
        if os.environ.get('MNOPT_REQUIRE_GPU') == '1':
            pytest.fail('MNOPT_REQUIRE_GPU=1 but %s' % problem)
        pytest.skip('needs a GPU: %s' % problem)
    import cupy as cp
    return cp


@pytest.fixture(params=CPU_COMMUNICATORS + ('hierarchical-2-per-node',))
def comm_name(request, monkeypatch):
    """Each CPU communicator; hierarchical also with nodes faked as pairs
    of ranks, so the inter-node step runs on one machine."""
    name = request.param
    if name == 'hierarchical-2-per-node':
        monkeypatch.setenv('MNOPT_RANKS_PER_NODE', '2')
        name = 'hierarchical'
    return name


needs_chainer = pytest.mark.skipif(
    chainer is None, reason='the Chainer layer (this stack has no Chainer; '
                            'the numpy1 and numpy2 stacks run it)')


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpiexec():
    """The launcher for spawned jobs, as an argv prefix: $MNOPT_TEST_MPIEXEC
    (e.g. Open MPI's 'mpiexec --oversubscribe'), else the environment's own
    mpiexec (the mpich wheel's), else the one on PATH."""
    if os.environ.get('MNOPT_TEST_MPIEXEC'):
        return shlex.split(os.environ['MNOPT_TEST_MPIEXEC'])
    beside = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    return [beside if os.path.exists(beside) else 'mpiexec']


def mpi_library():
    """'mpich', 'openmpi' or 'other': what mpi4py runs on."""
    version = MPI.Get_library_version()
    if 'MPICH' in version:
        return 'mpich'
    return 'openmpi' if 'Open MPI' in version else 'other'


def python_path():
    """PYTHONPATH for spawned jobs: this checkout first, then whatever the
    caller's had (packages carried beside the installed ones)."""
    return os.pathsep.join([REPO] + [p for p in os.environ.get(
        'PYTHONPATH', '').split(os.pathsep) if p])


def run_mpi(n, code, timeout=60, args=(), env=None, module_runner=True):
    """Run ``code`` as a script under ``mpiexec -n n``; returns the
    CompletedProcess.  A hang fails the calling test via the timeout."""
    script = os.path.join(REPO, 'tests', '.spawned_%d.py' % os.getpid())
    with open(script, 'w') as f:
        f.write(code)
    runner = ['-m', 'mpi4py'] if module_runner else []
    full_env = dict(os.environ, PYTHONPATH=python_path(), **(env or {}))
    try:
        return run_job(mpiexec() + ['-n', str(n), sys.executable] + runner
                       + [script] + list(args), timeout, full_env)
    finally:
        os.remove(script)


def run_job(argv, timeout, env, cwd=REPO):
    """subprocess.run for a launcher: on a timeout the launcher's whole
    process group is killed (its ranks included, even stopped ones), then
    TimeoutExpired is raised as usual.  ``env``: built from ``os.environ``
    (see _drop_an_inherited_singleton), never None."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=slack(timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def build_embedded_set(cache, images_per_class, val_per_class):
    """The ImageNet example's embedded set in ``cache``, smaller than the
    example's own (80 and 40 images per class): the example finds it
    complete in its --data-cache and reads it as it is.  Each job of a
    test validates on the whole validation set at its end."""
    imagenet_example_module('embedded_data').build(
        cache, n_train=images_per_class, n_val=val_per_class)
    return cache


def imagenet_example_module(name):
    """The ImageNet example's module ``name`` (examples/imagenet/NAME.py),
    loaded from its file (the example is no package)."""
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(REPO, 'examples', 'imagenet', name + '.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def snapshot_plots_equal(path_a, path_b):
    """Assert two ImageNet-example snapshots hold the same plot state (the
    current epoch's sums, the points per epoch) of the training loss and
    accuracy (a run that stops validates at its end, which the run it is
    compared with may not; the communication's are timings)."""
    def plots(path):
        with numpy.load(str(path)) as f:
            state = {k: json.loads(str(f['extensions/epoch_plots/' + k]))
                     for k in ('sums', 'points')}
        return {k: {key: v for key, v in state[k].items()
                    if key.startswith('main/')} for k in state}
    a, b = plots(path_a), plots(path_b)
    assert a['sums'] or a['points'], a
    assert a == b


def snapshot_models_equal(path_a, path_b):
    """Assert two trainer snapshots hold the same model, bit for bit."""
    def model(path):
        with numpy.load(str(path)) as f:
            return {k: f[k] for k in f.files
                    if k.startswith('updater/model:main/')}
    a, b = model(path_a), model(path_b)
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        numpy.testing.assert_array_equal(a[k], b[k], err_msg=k)


@contextlib.contextmanager
def mnopt_records():
    """The records said on mnopt's loggers ('mnopt' and its children,
    mnopt/common/log.py) while the block runs, as a list."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger('mnopt')
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def warns_on_rank_0(comm, match):
    """Rank 0 reports what autoload skipped (a WARNING record of logger
    'mnopt', mnopt/common/log.py, matching ``match``); the others stay
    quiet."""
    with mnopt_records() as records:
        yield
    said = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    if comm.rank == 0:
        assert any(re.search(match, m) for m in said), said



def process_state(pid):
    """The state letter of process ``pid`` in /proc ('R', 'S', 'Z', ...),
    None where it is gone."""
    try:
        with open('/proc/%s/stat' % pid) as f:
            return f.read().rsplit(')', 1)[1].split()[0]
    except OSError:
        return None

@contextlib.contextmanager
def shared_directory(comm, prefix):
    """A fresh directory every rank of ``comm`` uses, removed after the
    block (once every rank is done with it)."""
    path = comm.bcast_obj(tempfile.mkdtemp(prefix=prefix)
                          if comm.rank == 0 else None)
    yield path
    comm.allgather_obj(None)
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def untagged(err):
    """stderr's lines without the rank mnopt puts before each of its own
    in a job of several ranks ('[rank 1] mnopt: ...')."""
    return [re.sub(r'^\[rank \d+\] ', '', line) for line in err.splitlines()]


@pytest.fixture
def flat_comm():
    """A ``flat`` communicator of every rank, finalized after the test."""
    c = mnopt.create_communicator('flat')
    yield c
    c.finalize()


@pytest.fixture
def outdir(flat_comm):
    """One fresh directory shared by every rank (the snapshot tests')."""
    with shared_directory(flat_comm, 'mnopt-out-') as path:
        yield path
