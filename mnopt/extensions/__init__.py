"""ChainerMN's trainer extensions, one small module each, and the
multi-node evaluator.  Layer 6 (chainer) of docs/architecture.md."""

from mnopt.extensions.allreduce_persistent import AllreducePersistent  # NOQA
from mnopt.extensions.communication_report import CommunicationReport  # NOQA
from mnopt.extensions.checkpoint import create_multi_node_checkpointer  # NOQA
from mnopt.extensions.early_stopping import MultiNodeEarlyStoppingTrigger  # NOQA
from mnopt.extensions.generic_evaluator import GenericMultiNodeEvaluator  # NOQA
from mnopt.extensions.multi_node_snapshot import multi_node_snapshot  # NOQA
from mnopt.extensions.multi_node_evaluator import (  # NOQA  (ChainerMN's path)
    create_multi_node_evaluator)
from mnopt.extensions.observation_aggregator import ObservationAggregator  # NOQA
