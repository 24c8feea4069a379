"""Splitting a dataset over ranks (ChainerMN's ``chainermn.datasets``,
at its module paths).  Layer 6 (chainer) of docs/architecture.md."""

from mnopt.datasets.empty_dataset import create_empty_dataset  # NOQA
from mnopt.datasets.scatter import DataSizeError  # NOQA
from mnopt.datasets.scatter import scatter_dataset  # NOQA
from mnopt.datasets.scatter import scatter_index  # NOQA
