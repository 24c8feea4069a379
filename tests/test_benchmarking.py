"""The benchmark library (mnopt/benchmarking/) in process: what its
training modes hand to mnopt is what mnopt accepts."""

import pytest

import mnopt
from conftest import needs_chainer




@needs_chainer
@pytest.mark.parametrize('double_buffering', [False, True])
def test_the_simulated_optimizer_is_a_chainer_optimizer(double_buffering):
    """--double-buffering and --scaling wrap it: create_multi_node_optimizer
    refuses what is not a chainer.Optimizer (it once was not)."""
    import chainer
    from mnopt.benchmarking.training import simulated_update
    comm = mnopt.create_communicator('flat')
    try:
        link = chainer.links.Linear(3, 2)
        opt = mnopt.create_multi_node_optimizer(
            simulated_update(), comm,
            double_buffering=double_buffering).setup(link)
        for param in link.params():
            param.grad = param.array * 0 + 1
        for _ in range(3):
            opt.update()
        # The first update broadcasts the parameters; double buffering
        # applies each mean one update later.
        assert opt.t == (1 if double_buffering else 2), opt.t
    finally:
        comm.finalize()


def test_the_old_library_names_of_mnopt_benchmark_still_resolve():
    """Scripts written against mnopt.benchmark's library names (before it
    became the command line only) find them, warned."""
    import importlib
    import mnopt.benchmark as command
    for name, module in command.MOVED.items():
        with pytest.warns(DeprecationWarning, match=name):
            found = getattr(command, name)
        assert found is getattr(importlib.import_module(
            'mnopt.benchmarking.' + module), name)
    with pytest.raises(AttributeError):
        command.no_such_name
