"""Where each step's time goes, as the job runs: the timeline recorder
(recorder.py: Chrome trace-event JSON, ``MNOPT_TIMELINE``), which steps it
records (window.py), and the per-step communication statistics the
communicator keeps with or without a timeline (step_stats.py).  Reading
the traces back is ``python -m mnopt.report`` (mnopt/report/).  Layer 0
(leaves) of docs/architecture.md.
"""
