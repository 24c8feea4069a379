"""The transport layer: moving bytes between ranks (MPI, the ring, NCCL)
and agreeing, with the C loop of its waits (_mpiwait.c).  Layer 2
(transport) of docs/architecture.md.
"""
