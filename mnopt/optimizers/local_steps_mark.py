"""What marks a snapshot written with ``local_steps`` (``SNAPSHOT_KEY``:
in every rank's file, beside that rank's own parameters and inner state
between syncs), the settings it recorded, and the error an optimizer
without ``local_steps`` gives when asked to load one: the same on every
rank, before anything is loaded, instead of resuming each rank from
parameters that differ."""

import numpy

#: Serializer group holding the local-steps state in snapshots.
SNAPSHOT_KEY = 'mnopt_local_steps'


def not_local_steps(deserializer):
    """``deserializer``, or ValueError where it holds a local-steps
    optimizer's state, naming every setting the snapshot recorded (what
    ``create_multi_node_optimizer`` must be given to load it)."""
    said = saved_settings(deserializer[SNAPSHOT_KEY])
    if said:
        raise ValueError(
            'this snapshot was written with %s: between syncs each rank '
            'holds its own parameters and inner optimizer state, which a '
            'synchronous optimizer cannot resume; load it with '
            'create_multi_node_optimizer(..., %s) (on any number of ranks; '
            "the outer optimizer's hyperparameters may be other ones)"
            % (', '.join(said), ', '.join(
                s + '(...)' if s.startswith('outer_optimizer=') else s
                for s in said)))
    return deserializer


def settings_said(local_steps, fragments, fragment_sync_delay,
                  sync_warmup_steps, outer_optimizer):
    """``['local_steps=4', 'fragments=2', ...]``: the settings a snapshot
    records, as its refusals name them (None: not recorded, left out;
    ``outer_optimizer``: its class's module.name)."""
    return ['%s=%s' % (name, value) for name, value in (
        ('local_steps', local_steps), ('fragments', fragments),
        ('fragment_sync_delay', fragment_sync_delay),
        ('sync_warmup_steps', sync_warmup_steps),
        ('outer_optimizer', outer_optimizer)) if value is not None]


def saved_values(group):
    """{setting: value} the snapshot's local-steps ``group`` recorded
    (those an older snapshot lacks left out; ``outer_optimizer``: its
    class's module.name), or None where it holds none (a snapshot of
    another mode)."""
    settings = read(group, 'settings')
    if settings is None:
        return None
    values = dict(zip(('local_steps', 'fragments', 'sync_warmup_steps'),
                      (int(v) for v in settings)))
    delay, outer = read(group, 'fragment_sync_delay'), \
        read(group, 'outer_optimizer')
    if delay is not None:
        values['fragment_sync_delay'] = int(delay)
    if outer is not None:
        values['outer_optimizer'] = str(numpy.asarray(outer).item())
    return values


def saved_settings(group):
    """``settings_said`` of the snapshot's local-steps ``group`` (those an
    older snapshot lacks left out); [] where it holds none."""
    values = saved_values(group)
    if values is None:
        return []
    return settings_said(
        values['local_steps'], values['fragments'],
        values.get('fragment_sync_delay'), values.get('sync_warmup_steps'),
        values.get('outer_optimizer'))


def read(serializer, key):
    """A snapshot's value of ``key``, or None where it has none."""
    try:
        return serializer(key, None)
    except KeyError:   # strict: absent
        return None
