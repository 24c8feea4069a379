"""Trainer helpers of the sharded optimizers: find them in a trainer, and
re-shard them from every rank's snapshot file after a load."""

from mnopt.optimizers.zero.stage1 import ShardedStateOptimizer


def sharded_optimizers(target):
    """The sharded optimizers in ``target``: a trainer, an updater, or an
    optimizer itself."""
    if isinstance(target, ShardedStateOptimizer):
        return [target]
    updater = getattr(target, 'updater', target)
    optimizers = getattr(updater, 'get_all_optimizers', None)
    if optimizers is None:
        return []
    return [o for _, o in sorted(optimizers().items())
            if isinstance(o, ShardedStateOptimizer)]


def load_shards_of(target, share_file):
    """After every rank loaded ``target`` (a trainer, updater or optimizer)
    from a snapshot file of its own: each sharded optimizer in it that
    cannot resume from the share it loaded (another number of ranks wrote
    the snapshot) re-shards from every rank's file, ``share_file(r)`` for
    rank r of the ranks that wrote it (``load_shards``).  Returns the
    problems, [] if none (the next update raises them on every rank)."""
    problems = []
    for optimizer in sharded_optimizers(target):
        size = optimizer.needs_shards()
        if size is not None:
            problem = optimizer.load_shards(
                [share_file(r) for r in range(size)])
            if problem is not None:
                problems.append(problem)
    return problems

