"""Which snapshots to keep, decided once from what every rank holds.

Pruning per rank (each rank keeps its own newest files) goes wrong where
one rank's newest write failed or is late: the others delete the last
snapshot it holds, and no snapshot is left that every rank can load.  So
every rank says what it holds, and all of them keep the newest that
*every* writing rank holds (ChainerMN's checkpointer keeps the newest
iterations all ranks have)."""

import re
import string


def agreed_retention(comm, held, n_keep, key, what, keep_newer):
    """``(kept, stale)``, the same on every rank.

    ``held``: the snapshots (names or iterations) this rank holds a file
    of, or None on a rank that writes none (its vote does not count); or
    a dict that maps each to ``(whether this rank can load it, the write
    id of the files it would read)``: then a snapshot is complete only
    where every writer can load it, all of one write (autoload's check:
    an earlier, larger run's set missing a file, or one rank's write lost
    beside an older file of the same name, is held but no snapshot).
    ``kept``: the ``n_keep`` newest (by ``key``) complete ones;
    ``stale``: the others, except, with ``keep_newer``, those newer than
    the newest kept (a write still in flight on some rank).  Nothing is
    stale while no snapshot is complete."""
    if held is not None and not isinstance(held, dict):
        held = {h: (True, None) for h in held}
    said = comm.everyone(None if held is None else sorted(
        held.items(), key=lambda item: key(item[0])), what)
    votes = [dict(h) for h in said if h is not None]
    writers = [set(v) for v in votes]
    if not writers:
        return [], []
    complete = sorted(
        (s for s in set.intersection(*writers)
         if all(v[s][0] for v in votes) and
         len({v[s][1] for v in votes}) == 1), key=key)
    kept = complete[-n_keep:]
    if not kept:
        return [], []
    newest = key(kept[-1])
    stale = [s for s in sorted(set().union(*writers), key=key)
             if s not in kept and not (keep_newer and key(s) > newest)]
    return kept, stale


def filename_pattern(fmt):
    """A regex for the names ``fmt`` formats into ('{...}' fields match
    anything)."""
    parts = []
    for literal, field, _, _ in string.Formatter().parse(fmt):
        parts.append(re.escape(literal))
        if field is not None:
            parts.append('.+?')
    return ''.join(parts)


def natural_key(name):
    """Sorts snapshot names by the numbers in them (iterations)."""
    return tuple(int(n) for n in re.findall(r'\d+', name)), name
