"""The multi-node optimizers (ChainerMN's ``chainermn.optimizers``):
``create_multi_node_optimizer`` and ``Signum``.  Layer 6 (chainer) of
docs/architecture.md.

Layout, each module below the ones that import it: protocol.py (the
multi-node step every variant follows, and the plain optimizer),
double_buffering.py, overlap.py (averaging during backward) and
overlap_optimizer.py, zero/ (the sharded optimizers: ownership,
owned_update, stage1, stage2, snapshots, trainer), signum.py, uneven.py
(below protocol.py) and joining.py (``mnopt.join``), and factory.py on
top.
"""

from mnopt.optimizers.double_buffering import DoubleBufferingOptimizer
from mnopt.optimizers.factory import check_actual_optimizer
from mnopt.optimizers.factory import create_multi_node_optimizer  # NOQA
from mnopt.optimizers.joining import join  # NOQA
from mnopt.optimizers.outer_nesterov import OuterNesterov  # NOQA
from mnopt.optimizers.overlap_optimizer import OverlapOptimizer
from mnopt.optimizers.protocol import AVERAGE, BROADCAST, LOADED, RESUME
from mnopt.optimizers.protocol import MultiNodeOptimizer
from mnopt.optimizers.protocol import digest, host, state_of
from mnopt.optimizers.signum import Signum, SignumRule  # NOQA
from mnopt.optimizers.uneven import UnevenInputsError  # NOQA

# The names this module defined while it was one file, and ChainerMN's
# class names: still importable.
_LOADED = LOADED
_BROADCAST = BROADCAST
_RESUME = RESUME
_AVERAGE = AVERAGE
_host = host
_digest = digest
_state_of = state_of
_MultiNodeOptimizer = MultiNodeOptimizer
_DoubleBufferingOptimizer = DoubleBufferingOptimizer
_OverlapOptimizer = OverlapOptimizer
_check_actual_optimizer = check_actual_optimizer
_SignumRule = SignumRule
