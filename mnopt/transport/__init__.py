"""The transport layer: moving bytes between ranks (MPI, the ring, NCCL) and agreeing."""
