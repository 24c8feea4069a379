"""mnopt: multi-node data-parallel training for Chainer and CuPy.

A drop-in for ChainerMN's data-parallel API (``import mnopt as chainermn``).
"""

from mnopt._mpi import LayoutMismatchError  # NOQA
from mnopt.communicators import create_communicator  # NOQA
from mnopt.communicators.base import CommunicatorBase  # NOQA
from mnopt.datasets import scatter_dataset, scatter_index  # NOQA
from mnopt.evaluator import create_multi_node_evaluator  # NOQA
from mnopt.optimizers import Signum, create_multi_node_optimizer  # NOQA

__version__ = '0.1.0'
