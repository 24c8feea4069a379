"""The wrapped optimizer's hooks (``optimizer.add_hook``: WeightDecay,
GradientClipping...) compared across ranks: a hook on one rank only lets
the replicas drift apart in silence.  Those added before wrapping ride on
create_multi_node_optimizer's exchange, those added after on each update's
own (every variant's ``_agree_step``): no collective of their own.  With
``local_steps``, the outer optimizer's hyperparameters ride with them
(``outer_settings``: an outer lr schedule set on one rank only would
give the ranks other synced parameters)."""

import numpy

#: How the outer optimizer's hyperparameters are named among the hooks.
OUTER = 'outer optimizer: '


def hook_settings(optimizer):
    """``optimizer``'s hooks as 'name: Class(setting=value, ...)', its
    simple settings (numbers, strings) only, before-update hooks first."""
    hookable = getattr(optimizer, '_hookable', None)   # once set up
    said = []
    for hooks in (getattr(hookable, '_pre_update_hooks', None) or {},
                  getattr(hookable, '_post_update_hooks', None) or {}):
        for name, hook in hooks.items():
            settings = ', '.join(
                '%s=%r' % kv for kv in sorted(vars(hook).items())
                if kv[0] != 'name' and
                isinstance(kv[1], (bool, int, float, str)))
            said.append('%s: %s(%s)' % (name, type(hook).__name__, settings))
    return tuple(said)


def outer_settings(outer):
    """The outer optimizer ``outer``'s hyperparameters as an entry beside
    the hooks: 'outer optimizer: Class(lr=0.7, momentum=0.9)'."""
    return '%s%s(%s)' % (OUTER, type(outer).__name__, ', '.join(
        '%s=%r' % (name, value.item() if isinstance(value, numpy.generic)
                   else value)
        for name, value in sorted(outer.hyperparam.get_dict().items())))


def check_hooks_agree(hooks):
    """Raise ValueError (on every rank: ``hooks`` is every rank's
    ``hook_settings``, with ``outer_settings`` where local steps, the same
    list on each) unless they are equal."""
    if all(h == hooks[0] for h in hooks):
        return
    outer = [tuple(e[len(OUTER):] for e in h if e.startswith(OUTER))
             for h in hooks]
    if any(o != outer[0] for o in outer):
        raise ValueError(
            "the outer optimizer's hyperparameters differ across ranks "
            '(%s): set them alike on every rank (an outer lr schedule '
            'too)' % '; '.join('rank %d: %s' % (r, ', '.join(o))
                               for r, o in enumerate(outer)))
    raise ValueError(
        'the optimizer hooks differ across ranks (%s): add the same '
        'hooks with the same settings on every rank' % '; '.join(
            'rank %d: %s' % (r, ', '.join(
                e for e in h if not e.startswith(OUTER)) or 'none')
            for r, h in enumerate(hooks)))
