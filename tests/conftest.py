"""Shared test helpers.  The same modules run serially and under
``mpiexec -n 2`` / ``-n 3`` (see the Makefile's ``test`` target)."""

import os
import subprocess
import sys

import numpy
import pytest
from mpi4py import MPI

try:
    import chainer
except ImportError:  # the core stack: mnopt without Chainer
    chainer = None

WORLD = MPI.COMM_WORLD
CPU_COMMUNICATORS = ('naive', 'flat', 'hierarchical')


def pytest_configure(config):
    config.addinivalue_line(
        'markers', 'spawn: launches its own mpiexec job; runs only in the '
                   'serial pass (an mpiexec inside mpiexec is not supported)')
    if WORLD.rank > 0:
        # Only rank 0 reports progress; failures on any rank still print.
        config.option.verbose = -1


def pytest_collection_modifyitems(config, items):
    if WORLD.size > 1:
        items[:] = [i for i in items if 'spawn' not in i.keywords]


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


class _Param(object):
    def __init__(self, array):
        self.array, self.grad = array, None

    @property
    def shape(self):
        return self.array.shape


class _Model(object):
    """What communicators read of a Chainer Link: ``namedparams()``, and
    each parameter as an attribute."""

    def __init__(self, params):
        self._params = params
        for name, param in params:
            setattr(self, name.lstrip('/'), param)

    def namedparams(self):
        return iter(self._params)


def make_model(shapes, dtype=numpy.float32):
    """A Link with one parameter per shape, named p000, p001, ...; without
    Chainer, an object with the same ``namedparams()``."""
    if chainer is None:
        return _Model([('/p%03d' % i, _Param(numpy.zeros(s, dtype=dtype)))
                       for i, s in enumerate(shapes)])
    link = chainer.Link()
    with link.init_scope():
        for i, shape in enumerate(shapes):
            setattr(link, 'p%03d' % i,
                    chainer.Parameter(numpy.zeros(shape, dtype=dtype)))
    return link


def rank_grads(shapes, dtype, rank):
    """Gradient k of parameter i on ``rank``: rank + a per-element pattern,
    so the mean over ranks is (size - 1) / 2 + pattern."""
    return [(numpy.arange(int(numpy.prod(s))).reshape(s) % 13 * 0.25 - 1.5
             + i + rank).astype(dtype) for i, s in enumerate(shapes)]


def expected_mean(shapes, size):
    return [g + (size - 1) / 2.0 for g in rank_grads(shapes, numpy.float64, 0)]


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_mpi(n, code, timeout=60, args=(), env=None, module_runner=True):
    """Run ``code`` as a script under ``mpiexec -n n``; returns the
    CompletedProcess.  A hang fails the calling test via the timeout."""
    script = os.path.join(REPO, 'tests', '.spawned_%d.py' % os.getpid())
    with open(script, 'w') as f:
        f.write(code)
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    if not os.path.exists(mpiexec):
        mpiexec = 'mpiexec'
    runner = ['-m', 'mpi4py'] if module_runner else []
    full_env = dict(os.environ, PYTHONPATH=REPO, **(env or {}))
    try:
        return subprocess.run(
            [mpiexec, '-n', str(n), sys.executable] + runner + [script]
            + list(args), capture_output=True, text=True, timeout=timeout,
            env=full_env, cwd=REPO)
    finally:
        os.remove(script)
