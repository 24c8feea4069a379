"""ChainerMN's trainer extensions, one small module each, and the
multi-node evaluator.  Layer 6 (chainer) of docs/architecture.md.

The multi-node evaluator needs no Chainer (it averages what any object's
``evaluate()`` returns), so it imports without Chainer; the trainer
extensions need it, and without it naming one says so."""

from mnopt.extensions.multi_node_evaluator import (  # NOQA  (ChainerMN's path)
    create_multi_node_evaluator)

try:
    import chainer  # NOQA: what the trainer extensions below are for
except ImportError:
    def __getattr__(name):
        if name.startswith('__'):
            raise AttributeError(name)
        raise ImportError(
            "mnopt.extensions.%s is a Chainer trainer extension and needs "
            "Chainer, which is not installed: pip install 'mnopt[chainer]' "
            "(see docs/install.md)" % name, name='chainer')
else:
    from mnopt.extensions.allreduce_persistent import AllreducePersistent  # NOQA
    from mnopt.extensions.communication_report import CommunicationReport  # NOQA
    from mnopt.extensions.checkpoint import create_multi_node_checkpointer  # NOQA
    from mnopt.extensions.early_stopping import MultiNodeEarlyStoppingTrigger  # NOQA
    from mnopt.extensions.generic_evaluator import GenericMultiNodeEvaluator  # NOQA
    from mnopt.extensions.multi_node_snapshot import multi_node_snapshot  # NOQA
    from mnopt.extensions.observation_aggregator import ObservationAggregator  # NOQA
