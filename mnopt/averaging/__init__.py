"""The averaging every communicator kind shares: the pipeline that packs,
sums and unpacks a gradient set, in the caller or on the background
thread (pipeline.py, background.py, mean_handle.py), the private MPI
communicators and buffers it averages over (group.py, devices.py), the
timeline's wire spans (wires.py), sign and PowerSGD compression and the
guard of ``compression='auto'`` (compression.py, low_rank.py,
compression_guard.py), the tuning of ``'auto'`` settings (tuning.py),
ZeRO's sharded collectives (sharded.py, shard_layout.py,
shard_staging.py), the check of the gradient pairs an averaging takes
(grad_pairs.py) and the release of what garbage-collected communicators
leave (janitor.py).  The communicators (mnopt/communicators/) are put
together from these; nothing here imports them.  Layer 5 (communicators) of docs/architecture.md.
"""
