"""Uneven inputs, step by step (``mnopt.join``: mnopt/optimizers/join.py):
what a rank says in each update's one exchange (whether it still
contributes gradients, and how many batches it has had), what every rank
then does alike (the mean over the contributors, the end of the join, or
an error naming each rank's batch count), and the rescaling of the mean.

It rides on ``MultiNodeOptimizer._agree_step``'s exchange, which every
update already makes: whether a rank has run out of data costs no
exchange of its own, and no rank decides anything alone."""

#: A rank that has run out shadows the others (DDP's ``Join``).
SHADOW = 'shadow'
#: A rank that runs out before the others is an error on every rank.
ERROR = 'error'
MODES = (SHADOW, ERROR)


class UnevenInputsError(RuntimeError):
    """Ranks ran out of data at different batches, under
    ``mnopt.join(optimizer, uneven='error')`` (or only some ranks are
    inside a ``mnopt.join``): raised on every rank."""


class AllJoined(Exception):
    """Every rank has run out of data: the shadowing ends (raised out of
    the exchange on every rank alike; mnopt/optimizers/join.py catches
    it)."""


class Joined(object):
    """One rank's part in a ``mnopt.join`` block: its mode, whether it
    still contributes (it has not left the block), its batches so far,
    and what the last exchange said."""

    def __init__(self, mode):
        self.mode = mode
        self.contributing = True
        self.batches = 0
        #: Every rank's batches, as of the last exchange.
        self.every_rank = []
        #: The ranks that contributed to the update under way.
        self.contributors = None


def say(joined):
    """This rank's say in the update's exchange: None outside a join, else
    (mode, contributing, batches including this update's)."""
    if joined is None:
        return None
    if joined.contributing:
        joined.batches += 1
    return (joined.mode, joined.contributing, joined.batches)


def hear(joined, votes):
    """What every rank said (``votes``: each rank's ``say``), acted on
    alike everywhere: nothing outside a join; AllJoined when no rank
    contributes; UnevenInputsError in 'error' mode when some rank has run
    out; else the number of contributors, for ``rescale``."""
    if all(v is None for v in votes):
        return
    outside = [r for r, v in enumerate(votes) if v is None]
    if outside:
        raise UnevenInputsError(
            'ranks %s update inside mnopt.join(optimizer) but ranks %s do '
            'not: every rank must run its training loop inside the same '
            '"with mnopt.join(optimizer):" block' % (
                [r for r, v in enumerate(votes) if v is not None], outside))
    modes = [v[0] for v in votes]
    if any(m != modes[0] for m in modes):
        raise ValueError(
            'mnopt.join(optimizer, uneven=...) differs across ranks (%s): '
            'every rank must pass the same' % ', '.join(
                'rank %d: %r' % (r, m) for r, m in enumerate(modes)))
    contributing = [v[1] for v in votes]
    batches = [v[2] for v in votes]
    if joined is not None:
        joined.every_rank = batches
        joined.contributors = sum(contributing)
    if not any(contributing):
        raise AllJoined()
    if modes[0] == ERROR and not all(contributing):
        raise UnevenInputsError(uneven_message(contributing, batches))


def uneven_message(contributing, batches):
    """The error of 'error' mode: who ran out after how many batches, and
    where the others are."""
    done = [r for r, c in enumerate(contributing) if not c]
    going = [r for r, c in enumerate(contributing) if c]
    return (
        'uneven inputs: the data ran out on %s, while %s went on to batch '
        '%d (batches per rank: %s).  mnopt.join(optimizer, uneven=%r) asks '
        'for this error.  To train on with the ranks that still have data '
        '(the mean over them, as DDP\'s Join), use mnopt.join(optimizer); '
        'to give every rank the same number of batches, use '
        'scatter_dataset(..., force_equal_length=True) (ChainerMN\'s '
        'default) and the same batch size on every rank (docs/'
        'uneven_inputs.md)' % (
            ', '.join('rank %d after %d batches' % (r, batches[r])
                      for r in done),
            _ranks(going), max(batches),
            ', '.join('rank %d: %d%s' % (r, b, '' if contributing[r]
                                         else ' (done)')
                      for r, b in enumerate(batches)),
            ERROR))


def _ranks(ranks):
    if len(ranks) == 1:
        return 'rank %d' % ranks[0]
    return 'ranks %s and %d' % (', '.join(map(str, ranks[:-1])), ranks[-1])


def rescale(joined, target, size):
    """The mean over all ``size`` ranks (the ranks that ran out gave zero
    gradients) made the mean over the contributors: times size /
    contributors, in each gradient's dtype, the same on every rank (the
    same mean, the same factor)."""
    if joined is None or joined.contributors in (None, size):
        return
    factor = float(size) / joined.contributors
    joined.contributors = None
    for _, param in sorted(target.namedparams()):
        if param.grad is not None:
            param.grad *= param.grad.dtype.type(factor)
