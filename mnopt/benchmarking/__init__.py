"""The old name of the benchmark library, mnopt/benchmark/:
``mnopt.benchmarking.X`` is ``mnopt.benchmark.X``, with a
DeprecationWarning.  Layer 7 (entry points) of docs/architecture.md:
nothing in mnopt imports it.
"""

import importlib
import sys
import warnings

warnings.warn('mnopt.benchmarking is mnopt.benchmark now',
              DeprecationWarning, stacklevel=2)
for _name in ('cases', 'harness', 'sizes', 'training', 'workloads'):
    # The same module objects under the old names, so that
    # ``import mnopt.benchmarking.workloads`` finds them.
    globals()[_name] = sys.modules[__name__ + '.' + _name] = \
        importlib.import_module('mnopt.benchmark.' + _name)
