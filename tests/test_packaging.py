"""Packaging (issue 37): the sdist and wheel a user gets install and run
in a fresh environment, ``python -m mnopt`` answers, and the public API's
type hints (mnopt/py.typed) are complete and live for a type checker."""

import email.parser
import importlib.metadata
import importlib.util
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import zipfile

import pytest

import mnopt
from conftest import REPO, slack
from mnopt.__main__ import COMMANDS, main
from mnopt.communicators import create_communicator
from mnopt.communicators.base import CommunicatorBase

# The same at any number of ranks: the serial pass only (see the Makefile).
pytestmark = pytest.mark.one_rank

EXTRAS = {'mpich', 'chainer', 'test', 'examples', 'gpu', 'gpu-cuda12',
          'gpu-cuda13'}


def run(argv, timeout, cwd, env=None):
    """subprocess.run that kills the whole process group (a launcher's
    ranks too) on a timeout, then raises TimeoutExpired as usual."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=str(cwd),
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=slack(timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, '')


def _clean_env(**extra):
    """This environment without what would make a child see the checkout or
    the running venv instead of its own (PYTHONPATH, VIRTUAL_ENV), or join
    the running MPI job (a launcher's variables)."""
    drop = ('PYTHONPATH', 'PYTHONHOME', 'VIRTUAL_ENV')
    env = {k: v for k, v in os.environ.items() if k not in drop and
           not k.startswith(('PMI_', 'PMIX_', 'OMPI_', 'HYDRA_', 'MPIR_'))}
    env.update(extra)
    return env


# ------------------------------------------------------------ python -m mnopt
def test_python_m_mnopt_lists_the_commands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith('mnopt %s:' % mnopt.__version__)
    for name, how, _ in COMMANDS:
        # Each command named is a module that exists, run as shown.
        assert importlib.util.find_spec('mnopt.' + name) is not None, name
        assert '-m mnopt.%s' % name in how
        assert re.search(r'^  %s ' % name, out, re.M), out
        assert how in out


def test_python_m_mnopt_version_and_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(['--version'])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == 'mnopt %s\n' % mnopt.__version__
    with pytest.raises(SystemExit) as exit_:
        main(['--help'])
    assert exit_.value.code == 0
    assert 'mnopt.benchmark' in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(['--no-such-option'])
    assert exit_.value.code == 2


# ------------------------------------------------------------ sdist and wheel
def _uv():
    """uv, where ``make`` put it (.venv/uv) or on PATH, else None: it makes
    the fresh venv and installs the wheel into it 20x faster than venv and
    pip (half a minute of the test), from the same index and cache."""
    bundled = os.path.join(REPO, '.venv', 'uv', 'bin', 'uv')
    return bundled if os.access(bundled, os.X_OK) else shutil.which('uv')


def _copy_of_checkout(dest):
    """The working tree without build outputs and environments: the sdist
    is built from it as from a fresh clone (setuptools also reads an old
    mnopt.egg-info/SOURCES.txt if one is there)."""
    shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(
        '.git', '.venv', '.whl', 'result', 'build', 'dist', '*.egg-info',
        '__pycache__', '.pytest_cache', '.mypy_cache', '*.so', '.spawned_*'))
    return dest


@pytest.mark.spawn
@pytest.mark.timeout(600)
def test_sdist_and_wheel_install_and_run_in_a_fresh_venv(tmp_path):
    # The sdist, with the PEP 517 hook (setuptools, no wheel package needed).
    src = _copy_of_checkout(tmp_path / 'src')
    dist = tmp_path / 'dist'
    proc = run([sys.executable, '-c',
                'import sys; from setuptools import build_meta; '
                'print(build_meta.build_sdist(sys.argv[1]))', str(dist)],
               120, src, _clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:]
    sdist = dist / proc.stdout.split()[-1]
    assert sdist.name == 'mnopt-%s.tar.gz' % mnopt.__version__

    # The wheel from the sdist, as pip builds one for a user: proves the
    # sdist holds everything the build needs (the .pth file, the C
    # sources).  Build isolation: the build backend from the index.
    proc = run([sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps',
                '--disable-pip-version-check', '-w', str(dist), str(sdist)],
               300, tmp_path, _clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:]
    wheel, = dist.glob('mnopt-*.whl')
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = '%s.dist-info/' % '-'.join(wheel.name.split('-')[:2])
        metadata = email.parser.Parser().parsestr(
            zf.read(info + 'METADATA').decode())
    assert {'mnopt/py.typed', 'mnopt/__main__.py', 'mnopt-chainer-numpy2.pth',
            '_mnopt_chainer_numpy2.py'} <= names, sorted(names)
    assert any(n.startswith(info) and n.endswith('/LICENSE') or
               n == info + 'LICENSE' for n in names), sorted(names)
    assert not [n for n in names if n.endswith('.c')]
    assert metadata['Version'] == mnopt.__version__
    assert metadata['Requires-Python'] == '>=3.10'
    assert 'MIT' in (metadata['License-Expression'] or metadata['License'])
    assert set(metadata.get_all('Provides-Extra')) == EXTRAS
    requires = ' '.join(metadata.get_all('Requires-Dist'))
    for dependency in ('numpy', 'mpi4py', 'threadpoolctl', 'mpich'):
        assert dependency in requires

    # A fresh venv: the wheel, and the core's dependencies at the versions
    # running here (from the cache).  An MPI library as a wheel (mpich),
    # so the check below runs on its launcher.
    versions = {}
    for name in ('numpy', 'mpi4py', 'threadpoolctl', 'mpich'):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip('the smoke job needs the mpich wheel (%s is not '
                        'installed here)' % name)
    venv = tmp_path / 'venv'
    python = str(venv / 'bin' / 'python')
    uv = _uv()
    if uv:
        make_venv = [uv, 'venv', '-q', '-p', sys.executable, str(venv)]
        install = [uv, 'pip', 'install', '-q', '-p', python]
    else:
        make_venv = [sys.executable, '-m', 'venv', str(venv)]
        install = [python, '-m', 'pip', 'install', '-q',
                   '--disable-pip-version-check']
    proc = run(make_venv, 120, tmp_path, _clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:]
    proc = run(install + ['--no-deps', str(wheel)] +
               ['%s==%s' % item for item in sorted(versions.items())],
               300, tmp_path, _clean_env())
    assert proc.returncode == 0, proc.stdout[-3000:]

    # Run from tmp_path, away from the checkout: only the install is seen.
    env = _clean_env(PATH=os.pathsep.join(
        [str(venv / 'bin'), os.environ.get('PATH', '')]))
    proc = run([python, '-m', 'mnopt', '--version'], 60, tmp_path, env)
    assert (proc.returncode, proc.stdout) == (
        0, 'mnopt %s\n' % mnopt.__version__)
    proc = run([python, '-c',
                'import sys; hooked = "_mnopt_chainer_numpy2" in sys.modules; '
                'import mnopt; print(hooked, "mpi4py.MPI" in sys.modules, '
                'mnopt.__file__)'], 60, tmp_path, env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    hooked, mpi_started, where = proc.stdout.split()
    # The .pth file ran at start-up; import mnopt does not start MPI.
    assert (hooked, mpi_started) == ('True', 'False')
    assert where.startswith(str(venv)), where
    proc = run([str(venv / 'bin' / 'mpiexec'), '-n', '2', python, '-m',
                'mpi4py', '-m', 'mnopt.check'], 120, tmp_path, env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.rstrip().endswith('mnopt check: OK'), proc.stdout


# ------------------------------------------------------------ type hints
def _public_callables():
    """name -> function: CommunicatorBase's public methods and properties
    (their getters), and the two factories."""
    found = {'create_communicator': create_communicator}
    for name in dir(CommunicatorBase):
        if name.startswith('_'):
            continue
        value = inspect.getattr_static(CommunicatorBase, name)
        if isinstance(value, property):
            found[name] = value.fget
        elif isinstance(value, (classmethod, staticmethod)):
            found[name] = value.__func__
        elif inspect.isfunction(value):
            found[name] = value
    if importlib.util.find_spec('chainer') is not None:
        from mnopt.optimizers import create_multi_node_optimizer
        found['create_multi_node_optimizer'] = create_multi_node_optimizer
    return found


def test_public_api_is_annotated():
    """Every parameter and return of the public API has a hint (the
    decorated ones under the decorator: its result keeps them)."""
    missing = []
    for name, function in sorted(_public_callables().items()):
        signature = inspect.signature(inspect.unwrap(function))
        if signature.return_annotation is inspect.Signature.empty:
            missing.append('%s: return' % name)
        for i, parameter in enumerate(signature.parameters.values()):
            if parameter.annotation is inspect.Parameter.empty and not (
                    i == 0 and parameter.name in ('self', 'cls')):
                missing.append('%s: %s' % (name, parameter.name))
    assert not missing, missing
    assert 'mean_grads' in _public_callables()


#: One wrong use per public name, which mypy must reject: proves each
#: signature's hints resolve and reach a user (an unresolved hint, or a
#: decorator that hides the signature, would give Any and no error).
#: Names: ``comm`` a communicator, ``x`` an array, ``grads`` named arrays.
WRONG_USES = {
    'create_communicator': "mnopt.create_communicator(warmup_steps='3')",
    'create_multi_node_optimizer':
        "chainermn.create_multi_node_optimizer(opt, 'flat')",
    'lazy names': 'mnopt.create_comunicator()',
    'CommunicatorBase': 'mnopt.CommunicatorBase(0)',
    'MeanHandle': 'comm.mean_grads_async(grads).wait().done()',
    'mean_grads': "comm.mean_grads(grads, iteration='3')",
    'mean_grads_async': 'handle: int = comm.mean_grads_async(grads)',
    'rank': 'comm.rank.upper()',
    'size': 'comm.size.upper()',
    'intra_rank': 'comm.intra_rank.upper()',
    'intra_size': 'comm.intra_size.upper()',
    'inter_rank': 'comm.inter_rank.upper()',
    'inter_size': 'comm.inter_size.upper()',
    'set_config': 'comm.set_config(1)',
    'get_config': 'comm.get_config(1)',
    'check_arguments': "comm.check_arguments(warmup_steps='1')",
    'shared_settings': 'comm.shared_settings(1)',
    'serialize_compression':
        "comm.serialize_compression(serializer, shared='yes')",
    'multi_node_mean_grad': "comm.multi_node_mean_grad(model, zero_fill='no')",
    'allreduce_grad': "comm.allreduce_grad(model, zero_fill='no')",
    'bcast_data': "comm.bcast_data(model, root='0')",
    'broadcast_data': "comm.broadcast_data(model, root='0')",
    'finalize': 'comm.finalize().done()',
    'communication_stats': 'comm.communication_stats(True)',
    'tuned_settings': 'comm.tuned_settings.upper()',
    'tuning_problem': 'comm.tuning_problem(1)',
    'everyone': 'comm.everyone(1, 2)',
    'raise_together': "comm.raise_together('oops', 'a check')",
    'same': "comm.same([1], 'seeds')",
    'common': "comm.common(1, 'files')",
    'split': "comm.split('a', 0)",
    'send': "comm.send(x, dest='1', tag=0)",
    'recv': "comm.recv(source='0', tag=0)",
    'bcast': "comm.bcast(x, root='0')",
    'gather': "comm.gather(x, root='0')",
    'allgather': 'text: str = comm.allgather(x)',
    'scatter': 'comm.scatter(5)',
    'alltoall': 'comm.alltoall(5)',
    'allreduce': 'comm.allreduce(x, 0)',
    'send_obj': "comm.send_obj(1, dest='1')",
    'recv_obj': "comm.recv_obj(source='0')",
    'bcast_obj': "comm.bcast_obj(1, root='0')",
    'gather_obj': "comm.gather_obj(1, root='0')",
    'allgather_obj': 'text2: str = comm.allgather_obj(1)',
    'allreduce_obj': 'comm.allreduce_obj(1, 0)',
    'scatter_obj': 'comm.scatter_obj(5)',
    'sharding_problem': 'count: int = comm.sharding_problem()',
    'background_collectives_problem':
        'count2: int = comm.background_collectives_problem()',
    'shard_buffer_nbytes': 'text3: str = comm.shard_buffer_nbytes()',
    'reduce_scatter_mean': 'comm.reduce_scatter_mean(grads, 3)',
    'reduce_scatter_mean_async': 'comm.reduce_scatter_mean_async(grads, 3)',
    'allgather_params': 'comm.allgather_params(grads, 3)',
}

WRONG_HEADER = '''\
from __future__ import annotations

from typing import Any

import chainer
import numpy

import mnopt
import mnopt as chainermn
from mnopt.communicators.base import CommunicatorBase


def wrong(comm: CommunicatorBase, x: numpy.ndarray, model: chainer.Chain,
          serializer: chainer.Serializer, opt: chainer.Optimizer,
          grads: list[tuple[str, Any]]) -> None:
'''


def test_every_public_name_has_a_wrong_use_to_reject():
    assert set(_public_callables()) - {'name'} <= set(WRONG_USES)


@pytest.mark.spawn   # one mypy run, in the serial pass of the first stack
@pytest.mark.timeout(300)
def test_mypy_accepts_the_typed_user_and_rejects_each_wrong_use(tmp_path):
    """``python -m mypy`` as configured in pyproject.toml passes (the typed
    user tests/typing_api.py, the entry points), and every line of
    WRONG_USES is an error, and nothing else in its file."""
    pytest.importorskip('mypy')
    wrong = tmp_path / 'wrong_uses.py'
    lines = WRONG_HEADER.splitlines()
    first = len(lines) + 1
    lines += ['    ' + use for use in WRONG_USES.values()]
    wrong.write_text('\n'.join(lines) + '\n')

    proc = run([sys.executable, '-m', 'mypy', '--cache-dir',
                str(tmp_path / 'cache'), '--no-error-summary'], 240, REPO,
               _clean_env())
    assert proc.returncode == 0, proc.stdout[-5000:]

    proc = run([sys.executable, '-m', 'mypy', '--cache-dir',
                str(tmp_path / 'cache'), '--no-error-summary', str(wrong)],
               240, REPO, _clean_env())
    flagged = {int(m.group(1)) for m in re.finditer(
        r'^%s:(\d+): error:' % re.escape(str(wrong)), proc.stdout, re.M)}
    expected = dict(zip(range(first, first + len(WRONG_USES)), WRONG_USES))
    not_rejected = sorted(name for line, name in expected.items()
                          if line not in flagged)
    assert not not_rejected, (not_rejected, proc.stdout[-5000:])
    assert flagged <= set(expected), proc.stdout[-5000:]
