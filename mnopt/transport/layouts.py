"""The check that every rank's gradient set lines up before it is summed:
LayoutMismatchError on every rank otherwise (through mnopt's agreement)."""

from mnopt.transport import agreement


class LayoutMismatchError(ValueError):
    """Ranks tried to reduce gradient sets that do not line up."""


def check_layouts(comm, layout, what='gradients'):
    """Raise LayoutMismatchError on every rank unless all layouts agree.

    Costs one all-gather of 8 bytes per rank (``agreement.numbers``,
    non-blocking) when they agree; only on a
    mismatch are the full layouts exchanged to name the first difference.
    """
    digests = agreement.numbers(comm, [layout.digest])[:, 0]
    if (digests == digests[0]).all():
        return
    layouts = agreement.everyone(comm, layout, 'the check of the %s' % what)
    bad = next(r for r in range(comm.size) if layouts[r].key != layouts[0].key)
    raise LayoutMismatchError(
        'ranks would reduce %s that do not line up (rank 0 vs rank %d): %s. '
        'Every rank must hold the same parameters, with the same shapes and '
        'dtypes, and the same allreduce_grad_dtype.'
        % (what, bad, layouts[0].first_difference(layouts[bad])))
