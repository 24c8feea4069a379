"""ChainerMN's trainer extensions (the Chainer layer), one small module
each."""

from mnopt.extensions.allreduce_persistent import AllreducePersistent  # NOQA
from mnopt.extensions.communication_report import CommunicationReport  # NOQA
from mnopt.extensions.checkpoint import create_multi_node_checkpointer  # NOQA
from mnopt.extensions.early_stopping import MultiNodeEarlyStoppingTrigger  # NOQA
from mnopt.extensions.generic_evaluator import GenericMultiNodeEvaluator  # NOQA
from mnopt.extensions.multi_node_snapshot import multi_node_snapshot  # NOQA
from mnopt.evaluator import create_multi_node_evaluator  # NOQA  (ChainerMN's path too)
from mnopt.extensions.observation_aggregator import ObservationAggregator  # NOQA
