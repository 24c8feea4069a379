"""ChainerMN's trainer extensions (the Chainer layer), one small module
each."""

from mnopt.extensions.allreduce_persistent import AllreducePersistent  # NOQA
from mnopt.extensions.early_stopping import MultiNodeEarlyStoppingTrigger  # NOQA
from mnopt.extensions.observation_aggregator import ObservationAggregator  # NOQA
