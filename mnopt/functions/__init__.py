"""ChainerMN's differentiable communication functions (model
parallelism).  Layer 6 (chainer) of docs/architecture.md."""

from mnopt.functions.collective_communication import allgather  # NOQA
from mnopt.functions.collective_communication import alltoall  # NOQA
from mnopt.functions.collective_communication import bcast  # NOQA
from mnopt.functions.collective_communication import gather  # NOQA
from mnopt.functions.collective_communication import scatter  # NOQA
from mnopt.functions.point_to_point import pseudo_connect  # NOQA
from mnopt.functions.point_to_point import recv  # NOQA
from mnopt.functions.point_to_point import send  # NOQA
