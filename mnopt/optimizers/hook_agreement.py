"""The wrapped optimizer's hooks (``optimizer.add_hook``: WeightDecay,
GradientClipping...) compared across ranks: a hook on one rank only lets
the replicas drift apart in silence.  Those added before wrapping ride on
create_multi_node_optimizer's exchange, those added after on each update's
own (every variant's ``_agree_step``): no collective of their own."""


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


def check_hooks_agree(hooks):
    """Raise ValueError (on every rank: ``hooks`` is every rank's
    ``hook_settings``, the same list on each) unless they are equal."""
    if any(h != hooks[0] for h in hooks):
        raise ValueError(
            'the optimizer hooks differ across ranks (%s): add the same '
            'hooks with the same settings on every rank' % '; '.join(
                'rank %d: %s' % (r, ', '.join(h) or 'none')
                for r, h in enumerate(hooks)))
