"""ZeRO: the sharded optimizers (``create_multi_node_optimizer(opt, comm,
shard_state=True)``; the documented names are in mnopt.zero).

Every parameter has one owner rank (ownership.py).  Each update of stage 1
(stage1.py):

1. the mean gradients reach their owners only: one reduce-scatter of the
   packed gradient buffer laid out by owner (``comm.reduce_scatter_mean``);
2. each rank runs the wrapped optimizer's hooks and update rules on the
   parameters it owns (owned_update.py), so only the owner's update rule
   ever holds state (Adam's m and v, momentum...); the other parameters'
   gradients are dropped (None) once packed: they are not means, and their
   memory is free until the next backward;
3. the updated parameters come back to every rank: one all-gather of the
   flat parameter buffer (``comm.allgather_params``), bytes as the owner
   has them, so the replicas stay identical.

Stage 2 (``shard_state=True, overlap=True``: stage2.py) does step 1 during
backward instead, bucket by bucket as overlap's nodes find the gradients
final (``comm.reduce_scatter_mean_async``), and each bucket's gradients of
other ranks' parameters are freed once it is reduced, so backward holds
this rank's gradients and a few buckets, not every gradient.

A snapshot holds each rank's share (snapshots.py); trainer.py finds the
sharded optimizers of a trainer and re-shards them.  docs/zero.md has the
design and the numbers.
"""
