"""Evaluation averaged over ranks."""

import types

import numpy


def _mean_dicts(results):
    keys = results[0].keys()
    for r, res in enumerate(results):
        if res.keys() != keys:
            raise ValueError('evaluators on rank 0 and rank %d reported '
                             'different keys: %s vs %s'
                             % (r, sorted(keys), sorted(res.keys())))
    return {k: float(numpy.mean([float(res[k]) for res in results]))
            for k in keys}


def create_multi_node_evaluator(actual_evaluator, communicator):
    """Make ``actual_evaluator.evaluate`` return the mean, over all ranks,
    of each rank's results (the same dict on every rank).  Each rank
    evaluates its own share of the data (see ``scatter_dataset``)."""
    local_evaluate = actual_evaluator.evaluate

    def evaluate(self):
        local = {k: float(v) for k, v in local_evaluate().items()}
        return _mean_dicts(communicator.allgather_obj(local))

    actual_evaluator.evaluate = types.MethodType(evaluate, actual_evaluator)
    return actual_evaluator
