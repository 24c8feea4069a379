"""``python -m mnopt.launch``: relaunch a training job that died
(__main__.py), one attempt at a time (attempt.py); with ``--hosts``, the
elastic relaunch: which hosts (hosts.py), which of them answer
(probe.py), which run the next attempt (elastic.py) and which snapshots
are complete (snapshots.py).  Layer 7 (entry points) of
docs/architecture.md: nothing in mnopt imports it.
"""


def main(argv=None):
    """``python -m mnopt.launch`` (__main__.py), for a script that wraps it."""
    from mnopt.launch.__main__ import main as command
    return command(argv)
