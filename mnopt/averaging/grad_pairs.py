"""The (name, array) pairs ``mean_grads`` takes: any other shape is a
TypeError that says what to pass, raised before any collective."""


def named_pairs(named_grads, what):
    """``named_grads`` as a list of (name, array) pairs, else a TypeError
    saying what ``what`` takes (before any collective)."""
    named = None if isinstance(named_grads, dict) else list(named_grads)
    bad = 'a dict' if named is None else next((
        'item %d, a %s' % (i, type(p).__name__) for i, p in enumerate(named)
        if not isinstance(p, (tuple, list)) or len(p) != 2), None)
    if bad:
        raise TypeError('%s takes a list of (name, array) pairs: pass '
                        'sorted(grads.items()), not %s' % (what, bad))
    return named
