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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import _mnopt_chainer_numpy2

if TYPE_CHECKING:
    # For type checkers only (mnopt/py.typed): what the lazy names below
    # are.  At run time they are imported on first use (__getattr__).
    from mnopt import datasets as datasets
    from mnopt import extensions as extensions
    from mnopt import functions as functions
    from mnopt import iterators as iterators
    from mnopt import links as links
    from mnopt import zero as zero
    from mnopt.transport.layouts import LayoutMismatchError as LayoutMismatchError
    from mnopt.communicators import create_communicator as create_communicator
    from mnopt.communicators.base import CommunicatorBase as CommunicatorBase
    from mnopt.datasets import DataSizeError as DataSizeError
    from mnopt.datasets import create_empty_dataset as create_empty_dataset
    from mnopt.datasets import scatter_dataset as scatter_dataset
    from mnopt.datasets import scatter_index as scatter_index
    from mnopt.extensions.multi_node_evaluator import (
        create_multi_node_evaluator as create_multi_node_evaluator)
    from mnopt.extensions import (
        create_multi_node_checkpointer as create_multi_node_checkpointer)
    from mnopt.links import MultiNodeChainList as MultiNodeChainList
    from mnopt.optimizers import OuterNesterov as OuterNesterov
    from mnopt.optimizers import Signum as Signum
    from mnopt.optimizers import UnevenInputsError as UnevenInputsError
    from mnopt.optimizers import join as join
    from mnopt.optimizers import (
        create_multi_node_optimizer as create_multi_node_optimizer)
    from mnopt.codecs.overflow import (
        GradientOverflowError as GradientOverflowError)


__version__ = '0.1.0'

# Chainer 7.8.1 under NumPy 2 (a no-op under NumPy 1 or once Chainer is in).
_mnopt_chainer_numpy2.install_import_hook()

# A rank launched as one of several that dies of an uncaught exception
# aborts the job, also before its first create_communicator (which every
# other rank would wait in for ever): mnopt/global_except_hook.py.  It
# starts nothing here.
from mnopt import global_except_hook  # noqa: E402
global_except_hook.install_at_import()


def _set_log_level() -> None:
    """$MNOPT_LOG_LEVEL: the level of the 'mnopt' loggers, without code
    (a bad value is create_communicator's ValueError, on every rank:
    importing mnopt must not fail for it)."""
    import logging
    from mnopt.common import _env
    try:
        level = _env.log_level()
    except ValueError:
        return
    if level is not None:
        logging.getLogger('mnopt').setLevel(level)


_set_log_level()

#: The core, imported on first use: ``import mnopt`` must not start MPI
#: (importing mpi4py.MPI initialises it), because the processes a script's
#: multiprocessing forkserver starts import the script, and with it mnopt,
#: without being MPI processes (ChainerMN's ImageNet example does this).
_CORE = {
    'create_communicator': 'mnopt.communicators',
    'CommunicatorBase': 'mnopt.communicators.base',
    'LayoutMismatchError': 'mnopt.transport.layouts',
    'GradientOverflowError': 'mnopt.codecs.overflow',
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
    'OuterNesterov': 'mnopt.optimizers',
    'join': 'mnopt.optimizers',
    'UnevenInputsError': 'mnopt.optimizers',
    'create_multi_node_evaluator': 'mnopt.extensions.multi_node_evaluator',
    'scatter_dataset': 'mnopt.datasets',
    'scatter_index': 'mnopt.datasets',
    'create_empty_dataset': 'mnopt.datasets',
    'DataSizeError': 'mnopt.datasets',
    'create_multi_node_checkpointer': 'mnopt.extensions',
    'MultiNodeChainList': 'mnopt.links',
    'zero': 'mnopt.zero',
}


def __getattr__(name: str) -> object:
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


#: mnopt's documented modules (ChainerMN's ``chainermn.communicators``,
#: ...) that are no lazy name: attributes once imported.
_PUBLIC_MODULES = ('communicators', 'optimizers', 'global_except_hook',
                   'zero')


def __dir__() -> list[str]:
    # The API only: the lazy names, the documented modules imported so far
    # and the module's dunders (__version__); not what this file imports
    # for itself (importlib, TYPE_CHECKING, annotations), nor the internal
    # modules other imports bring in (mnopt.common, mnopt.codecs, ...).
    shown = {name for name in globals() if name in _PUBLIC_MODULES or
             (name.startswith('__') and name.endswith('__'))}
    return sorted(shown | set(_CORE) | set(_CHAINER_LAYER))
