"""``python -m mnopt.report TRACE...``: where each step's time went, read
from the timelines a job wrote (mnopt/timeline/).  The text report and
the command line (__main__.py), the reading of the traces
(trace_analysis.py), the advice (rules.py) and the picture (plot.py).
Layer 7 (entry points) of docs/architecture.md: nothing in mnopt imports
it.
"""


def main(argv=None):
    """``python -m mnopt.report`` (__main__.py), for a script that wraps it."""
    from mnopt.report.__main__ import main as command
    return command(argv)
