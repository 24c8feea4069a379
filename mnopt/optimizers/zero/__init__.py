"""ZeRO: the sharded optimizers (``create_multi_node_optimizer(opt, comm,
shard_state=True)``; the documented names are in mnopt.zero).

The parameters of each dtype, one after another in name order, are cut
into one contiguous share of elements per rank (partition.py): a
parameter may span ranks, each rank holding a piece of it.  Each update of
stage 1 (stage1.py):

1. the mean gradients reach their pieces' ranks only: one reduce-scatter
   of the gradients' pieces laid out by rank (``comm.reduce_scatter_mean``);
2. each rank runs the wrapped optimizer's hooks and update rules on its
   pieces (owned_update.py: elementwise rules and hooks, GradientClipping
   by one scalar allreduce), so a rule holds state for its rank's piece
   only (Adam's m and v...); the other gradients are dropped (None): they
   are not means, and their memory is free until the next backward;
3. the updated pieces come back to every rank: one all-gather of the
   parameters' pieces (``comm.allgather_params``), bytes as their rank
   has them, so the replicas stay identical.

Stage 2 (``shard_state=True, overlap=True``: stage2.py) does step 1 during
backward instead, bucket by bucket as overlap's nodes find the gradients
final (``comm.reduce_scatter_mean_async``), and each bucket's gradients of
other ranks' pieces are freed once it is reduced, so backward holds
this rank's gradients and a few buckets, not every gradient.

A snapshot holds each rank's share (snapshots.py); trainer.py finds the
sharded optimizers of a trainer and re-shards them.  docs/zero.md has the
design and the numbers.
"""
