"""The old path of mnopt/wire/dtypes.py (``from mnopt import wire_dtypes``):
the same module object.  Layer 0 (leaves) of docs/architecture.md."""

import sys

from mnopt.wire import dtypes

sys.modules[__name__] = dtypes
