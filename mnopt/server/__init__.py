"""The reduction server (Herring / Fairring / Optcast): the processes that
sum the workers' gradient shards, their protocol, job and loop.  Layer 4
(server) of docs/architecture.md: below the communicators (the
reduction_server communicator is its client, and runs the same loop on
threads when it is colocated), above the transport and the codecs.

    mpiexec -n W python train.py : -n S python -m mnopt.server [--memory B]

protocol.py (the messages), job.py (who is a worker and who a server, the
channels), loop.py (serving a channel), process.py (the server process).
"""


def main(argv=None):
    """The server process (mnopt/server/process.py), for a script that
    wraps ``python -m mnopt.server``: MPI starts here, not at import."""
    from mnopt.server import process
    process.main(argv)
