"""What marks a snapshot written with ``local_steps`` (``SNAPSHOT_KEY``:
in every rank's file, beside that rank's own parameters and inner state
between syncs), and the error an optimizer without ``local_steps`` gives
when asked to load one: the same on every rank, before anything is
loaded, instead of resuming each rank from parameters that differ."""

#: Serializer group holding the local-steps state in snapshots.
SNAPSHOT_KEY = 'mnopt_local_steps'


def not_local_steps(deserializer):
    """``deserializer``, or ValueError where it holds a local-steps
    optimizer's state."""
    try:
        settings = deserializer[SNAPSHOT_KEY]('settings', None)
    except KeyError:   # strict: absent, another mode's snapshot
        settings = None
    if settings is not None:
        steps, fragments = int(settings[0]), int(settings[1])
        raise ValueError(
            'this snapshot was written with local_steps=%d, fragments=%d: '
            'between syncs each rank holds its own parameters and inner '
            'optimizer state, which a synchronous optimizer cannot resume; '
            'load it with create_multi_node_optimizer(..., local_steps=%d, '
            'fragments=%d) (on any number of ranks)'
            % (steps, fragments, steps, fragments))
    return deserializer
