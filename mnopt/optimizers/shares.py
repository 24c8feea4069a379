"""What marks a sharded optimizer's snapshot (``SHARD_KEY``: in every
rank's file, each holding that rank's share of the optimizer state), and
the error an optimizer without ``shard_state`` gives when asked to load
one: the same on every rank (every rank's file has the mark), before
anything is loaded, instead of a KeyError on some ranks and state of the
wrong shapes on others."""

#: Serializer group holding a shard's metadata in snapshots.
SHARD_KEY = 'mnopt_shard'


def not_a_share(deserializer):
    """``deserializer``, or ValueError where it holds a sharded
    optimizer's share."""
    try:
        size = deserializer[SHARD_KEY]('size', None)
    except KeyError:   # strict: absent, an unsharded optimizer's
        size = None
    if size is not None:
        raise ValueError(
            'this snapshot was written with shard_state=True: each rank\'s '
            'file holds its share of the optimizer state, not the whole '
            'state an optimizer without shard_state needs; load it with '
            'create_multi_node_optimizer(..., shard_state=True), on any '
            'number of ranks (on another number than wrote it, '
            'mnopt.zero.load_shards_of re-shards it)')
    return deserializer
