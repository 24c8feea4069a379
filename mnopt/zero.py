"""The documented names of the sharded optimizers (``mnopt.zero``:
``load_shards_of``, ``partition``...), defined in
mnopt/optimizers/zero/."""

from mnopt.optimizers.factory import create_sharded as create  # NOQA
from mnopt.optimizers.zero.owned_update import optimizer_problem  # NOQA
from mnopt.optimizers.zero.partition import ALIGN  # NOQA
from mnopt.optimizers.zero.partition import Piece  # NOQA
from mnopt.optimizers.zero.partition import by_rank  # NOQA
from mnopt.optimizers.zero.partition import elements_per_rank  # NOQA
from mnopt.optimizers.zero.partition import partition  # NOQA
from mnopt.optimizers.zero.snapshots import SHARD_KEY  # NOQA
from mnopt.optimizers.zero.stage1 import ShardedStateOptimizer  # NOQA
from mnopt.optimizers.zero.stage2 import ShardedGradsOptimizer  # NOQA
from mnopt.optimizers.zero.trainer import load_shards_of  # NOQA
from mnopt.optimizers.zero.trainer import sharded_optimizers  # NOQA
