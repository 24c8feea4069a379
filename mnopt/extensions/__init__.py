"""ChainerMN's trainer extensions, one small module each, and the
multi-node evaluator.  Layer 6 (chainer) of docs/architecture.md.

Each name is imported on first use: the multi-node evaluator needs no
Chainer (it averages what any object's ``evaluate()`` returns), and
importing it must not import the extensions that do."""

import importlib

#: name -> the module of this folder that defines it.
_NAMES = {
    'AllreducePersistent': 'allreduce_persistent',
    'CommunicationReport': 'communication_report',
    'create_multi_node_checkpointer': 'checkpoint',
    'MultiNodeEarlyStoppingTrigger': 'early_stopping',
    'GenericMultiNodeEvaluator': 'generic_evaluator',
    'multi_node_snapshot': 'multi_node_snapshot',
    'create_multi_node_evaluator': 'multi_node_evaluator',  # ChainerMN's
    'ObservationAggregator': 'observation_aggregator',
}
__all__ = sorted(_NAMES)


def __getattr__(name):
    if name not in _NAMES:
        raise AttributeError('module %r has no attribute %r'
                             % (__name__, name))
    value = getattr(importlib.import_module(
        __name__ + '.' + _NAMES[name]), name)
    globals()[name] = value   # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_NAMES))
