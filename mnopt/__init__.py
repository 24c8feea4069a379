"""mnopt: multi-node data-parallel training for Chainer and CuPy.

A drop-in for ChainerMN's data-parallel API (``import mnopt as chainermn``).

Two layers:

- the core, which needs only numpy and mpi4py (and CuPy for GPU arrays):
  ``create_communicator`` and the communicators' ``mean_grads`` /
  ``mean_grads_async`` on ``[(name, array), ...]`` lists, the reduction
  server, sign compression, the benchmark;
- the Chainer layer on top (``create_multi_node_optimizer``,
  ``create_multi_node_evaluator``, ``scatter_dataset``, ``Signum``), imported
  on first use, so ``import mnopt`` works without Chainer.
"""

import importlib

import _mnopt_chainer_numpy2


__version__ = '0.1.0'

# Chainer 7.8.1 under NumPy 2 (a no-op under NumPy 1 or once Chainer is in).
_mnopt_chainer_numpy2.install_import_hook()

#: The core, imported on first use: ``import mnopt`` must not start MPI
#: (importing mpi4py.MPI initialises it), because the processes a script's
#: multiprocessing forkserver starts import the script, and with it mnopt,
#: without being MPI processes (ChainerMN's ImageNet example does this).
_CORE = {
    'create_communicator': 'mnopt.communicators',
    'CommunicatorBase': 'mnopt.communicators.base',
    'LayoutMismatchError': 'mnopt._mpi',
    'GradientOverflowError': 'mnopt.overflow',
}

#: The Chainer layer: name -> the module that defines it (a module name
#: maps to itself: ``mnopt.iterators`` as ``chainermn.iterators``).
_CHAINER_LAYER = {
    'datasets': 'mnopt.datasets',
    'iterators': 'mnopt.iterators',
    'extensions': 'mnopt.extensions',
    'links': 'mnopt.links',
    'functions': 'mnopt.functions',
    'create_multi_node_optimizer': 'mnopt.optimizers',
    'Signum': 'mnopt.optimizers',
    'create_multi_node_evaluator': 'mnopt.evaluator',
    'scatter_dataset': 'mnopt.datasets',
    'scatter_index': 'mnopt.datasets',
    'create_empty_dataset': 'mnopt.datasets',
    'DataSizeError': 'mnopt.datasets',
    'create_multi_node_checkpointer': 'mnopt.extensions',
    'MultiNodeChainList': 'mnopt.links',
}


def __getattr__(name):
    if name in _CORE:
        value = getattr(importlib.import_module(_CORE[name]), name)
        globals()[name] = value
        return value
    module = _CHAINER_LAYER.get(name)
    if module is None:
        raise AttributeError('module %r has no attribute %r'
                             % (__name__, name))
    try:
        value = importlib.import_module(module)
        if module != 'mnopt.' + name:
            value = getattr(value, name)
    except ImportError as e:
        if e.name != 'chainer' and not str(e.name).startswith('chainer.'):
            raise
        raise ImportError(
            'mnopt.%s is part of the Chainer layer and needs Chainer, which '
            "is not installed: pip install 'mnopt[chainer]' (see "
            'docs/install.md).  The core (create_communicator, mean_grads) '
            'works without it.' % name, name='chainer') from e
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_CORE) | set(_CHAINER_LAYER))
