"""Evaluation averaged over ranks."""

import types

import numpy

from mnopt.communicators import any_communicator


def _check_same_keys(results):
    keys = results[0].keys()
    for r, res in enumerate(results):
        if res.keys() != keys:
            raise ValueError('evaluators on rank 0 and rank %d reported '
                             'different keys: %s vs %s'
                             % (r, sorted(keys), sorted(res.keys())))


def _mean_of(key, values):
    """ChainerMN's mean of one result over ranks: the sum in rank order
    divided by the number of ranks, so scalars, numpy (or CuPy) arrays and
    Chainer Variables keep their types.  Shapes must agree: broadcasting
    one rank's array against another's would be a silent wrong answer."""
    shapes = [numpy.shape(v) for v in values]
    if any(s != shapes[0] for s in shapes):
        raise ValueError('evaluators reported %r with different shapes: %s'
                         % (key, ', '.join('rank %d %s' % (r, s)
                                           for r, s in enumerate(shapes))))
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total / len(values)


def _mean_over_ranks(results):
    """{key: mean over ranks} of every rank's result dict (in rank
    order); the same on every rank, or the same error on every rank."""
    _check_same_keys(results)
    return {k: _mean_of(k, [res[k] for res in results])
            for k in sorted(results[0])}


def create_multi_node_evaluator(actual_evaluator, communicator):
    """Make ``actual_evaluator.evaluate`` return the mean, over all ranks,
    of each rank's results (the same dict on every rank).  Each rank
    evaluates its own share of the data (see ``scatter_dataset``).

    As ChainerMN's: each value is summed over ranks with ``+`` and divided
    by the number of ranks, so a scalar stays a scalar, an array (numpy or
    CuPy) is averaged element-wise and a Chainer Variable stays a
    Variable.  Keys, or an array's shape, that differ between ranks raise
    ValueError on every rank."""
    local_evaluate = actual_evaluator.evaluate

    def evaluate(self):
        return _mean_over_ranks(any_communicator.everyone(
            communicator, local_evaluate(), 'the multi-node evaluator'))

    actual_evaluator.evaluate = types.MethodType(evaluate, actual_evaluator)
    return actual_evaluator
