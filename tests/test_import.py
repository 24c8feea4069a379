"""``import mnopt`` starts nothing: MPI starts with the first communicator.

A script's multiprocessing forkserver (ChainerMN's ImageNet example uses one
with MultiprocessIterator) starts processes that import the script, and with
it mnopt, without being MPI processes: importing mpi4py.MPI there would
initialise MPI in each of them.
"""

import subprocess
import sys

import pytest

from conftest import chainer, needs_chainer, python_path, run_mpi, slack

NOT_STARTED = r'''
import sys
import mnopt, mnopt.communicators
%s
started = [m for m in ('mpi4py.MPI',) if m in sys.modules]
assert not started, 'importing mnopt imported %%s' %% started
print(sorted(mnopt.communicators.NAMES))
'''


def _run(code):
    return subprocess.run([sys.executable, '-c', code], capture_output=True,
                          text=True, timeout=slack(120),
                          env={'PYTHONPATH': python_path(), 'PATH': '/usr/bin:/bin'})


def test_importing_the_core_does_not_start_mpi():
    done = _run(NOT_STARTED % '')
    assert done.returncode == 0, done.stderr
    assert "'flat'" in done.stdout


@needs_chainer
def test_importing_the_chainer_layer_does_not_start_mpi():
    layer = ('import mnopt.links, mnopt.functions, mnopt.iterators, '
             'mnopt.datasets, mnopt.optimizers, '
             'mnopt.extensions')
    done = _run(NOT_STARTED % layer)
    assert done.returncode == 0, done.stderr


FORKSERVER = r'''
import multiprocessing
import sys

import numpy
import mnopt
import chainer


def main():
    # As ChainerMN's ImageNet example: the forkserver (and one process from
    # it) before the communicator.
    multiprocessing.set_start_method('forkserver')
    p = multiprocessing.Process()
    p.start()
    p.join()
    comm = mnopt.create_communicator('flat')
    data = [(numpy.full(3, i, numpy.float32), i) for i in range(16)]
    data = mnopt.scatter_dataset(data, comm, shuffle=False)
    it = chainer.iterators.MultiprocessIterator(data, 4, n_processes=2,
                                                shuffle=False)
    batch = it.next()
    it.finalize()
    total = comm.allreduce_obj(sum(label for _, label in batch))
    if comm.rank == 0:
        print('labels summed', total)
    comm.finalize()


if __name__ == '__main__':
    main()
'''


@needs_chainer
@pytest.mark.spawn
def test_forkserver_multiprocess_iterator_as_chainermn_imagenet():
    done = run_mpi(2, FORKSERVER, timeout=240, module_runner=False)
    assert done.returncode == 0, done.stdout + done.stderr
    # ranks hold 0-7 and 8-15; each one's first batch of 4
    assert 'labels summed %d' % (0 + 1 + 2 + 3 + 8 + 9 + 10 + 11) in done.stdout


#: ChainerMN's names that ``import mnopt as chainermn`` offers
#: (docs/chainermn.md).
CHAINERMN_NAMES = {
    'create_communicator', 'CommunicatorBase', 'create_multi_node_optimizer',
    'create_multi_node_evaluator', 'scatter_dataset', 'scatter_index',
    'create_empty_dataset', 'DataSizeError', 'create_multi_node_checkpointer',
    'MultiNodeChainList', 'datasets', 'iterators', 'extensions', 'links',
    'functions'}


def test_dir_shows_the_public_api_only():
    import mnopt
    shown = set(dir(mnopt))
    assert CHAINERMN_NAMES | {'Signum', 'join', 'UnevenInputsError',
                              '__version__'} <= shown
    # What the package's source imports for itself is not its API.
    assert not shown & {'TYPE_CHECKING', 'annotations', 'importlib'}
    assert [n for n in shown if n.startswith('_') and not
            (n.startswith('__') and n.endswith('__'))] == []
    # Nor mnopt's internal modules, imported on the way.
    import mnopt.communicators
    assert 'communicators' in dir(mnopt)
    assert not set(dir(mnopt)) & {'log', 'arrays', 'timeline', 'transport'}
    # Every name shown is there (the Chainer layer's where Chainer is).
    chainer_layer = CHAINERMN_NAMES - {'create_communicator',
                                       'CommunicatorBase'} | {
        'Signum', 'join', 'UnevenInputsError', 'OuterNesterov', 'zero'}
    for name in shown - (chainer_layer if chainer is None else set()):
        getattr(mnopt, name)
