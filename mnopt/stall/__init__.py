"""Stall detection: no mnopt collective waits forever in silence.  A
Monitor per communicator watches each collective (monitor.py), with its
warning time and timeout (settings.py); one watchdog thread per process
asks the late ranks what they do, reports (report.py) and aborts at the
timeout (watchdog.py); a rank that exits or frees a monitor says so
first (last_word.py).  Before any of that, MPI's own start, which waits
for every rank: a C thread warns and ends a rank left waiting there
(launched.py, _startwatch.c; also a script started without its
launcher).  The waits outside a Monitor are the transport's
(mnopt/transport/stall_wait.py).  Layer 0 (leaves) of
docs/architecture.md.
"""
