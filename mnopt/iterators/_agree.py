"""The ranks' agreement on an iterator's arguments, checked once at
creation (mnopt/transport/agreement.py, over the communicator's private channel)."""


def same_on_every_rank(communicator, what, value):
    """Raise ValueError on every rank unless every rank passed the same
    ``value``; otherwise return it."""
    values = communicator.everyone(value, what)
    if any(v != values[0] for v in values):
        raise ValueError('ranks disagree on %s: %s' % (what, ', '.join(
            'rank %d: %r' % rv for rv in enumerate(values))))
    return value
