"""The benchmark of gradient averaging: ``python -m mnopt.benchmark``
(__main__.py) and its library, the workloads, the timing harness, the
cases and the message-size sweep.  Layer 7 (entry points) of
docs/architecture.md: nothing in mnopt imports it.
"""

#: Where the library names ``mnopt.benchmark`` had when it was one module
#: live now (its modules); ``mnopt.benchmark.NAME`` still finds them, with
#: a DeprecationWarning, for scripts written against it.
MOVED = {
    'resnet50_grad_shapes': 'workloads', 'grad_list': 'workloads',
    'grad_model': 'workloads', 'spread': 'harness', 'run_cases': 'harness',
    'bus_bandwidth': 'harness', 'link_tx_bytes': 'harness',
    'counting_link_bytes': 'harness', 'gather_link_bytes': 'harness',
    'build_cases': 'cases', 'SIGN_COMMS': 'cases', 'sweep': 'sizes',
    'print_sweep': 'sizes', 'plot_sweep': 'sizes', 'SWEEP_SIZES': 'sizes',
    'double_buffering': 'training', 'scaling': 'training',
    'STEPS_PER_BLOCK': 'training'}


def __getattr__(name):
    if name not in MOVED:
        raise AttributeError('module %r has no attribute %r'
                             % (__name__, name))
    import importlib
    import warnings
    where = 'mnopt.benchmark.' + MOVED[name]
    warnings.warn('mnopt.benchmark.%s is %s.%s now' % (name, where, name),
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(where), name)


def main(argv=None):
    """``python -m mnopt.benchmark`` (__main__.py), for a script that wraps it."""
    from mnopt.benchmark.__main__ import main as command
    return command(argv)
