"""What every other part of mnopt uses and that uses nothing of mnopt's: its
logging (log.py), the MNOPT_* settings read from the environment
(_env.py), its threads' scheduling (_sched.py), a node's cores shared
between its ranks (cores.py), numpy/CuPy array helpers (arrays.py), the
argument types of the command lines (cli.py) and the one failure summary
of a failed job (failure_summary.py).
Layer 0 (leaves) of docs/architecture.md.
"""
