"""The ImageNet example's flags of local steps with an outer optimizer
(DiLoCo, Streaming DiLoCo: docs/local_sgd.md): ``--local-steps H``,
``--fragments F``, ``--fragment-sync-delay T``, ``--outer-lr``,
``--outer-momentum`` and ``--sync-warmup-steps``, turned into the keywords
of ``create_multi_node_optimizer``.

The multi-node evaluator the example uses evaluates the synced
parameters (the same on every rank), so the validation accuracy is that
of the model a user would keep."""

import mnopt


def add_arguments(parser):
    group = parser.add_argument_group(
        'local steps (DiLoCo; docs/local_sgd.md)')
    group.add_argument('--local-steps', type=int, default=None, metavar='H',
                       help='inner updates on each rank\'s own gradients '
                       'between syncs; every H the pseudo-gradients are '
                       'averaged and an outer optimizer applies them '
                       '(default: average every step\'s gradients)')
    group.add_argument('--fragments', type=int, default=1, metavar='F',
                       help='with --local-steps, sync the model in F '
                       'fragments in turn, one every H/F steps')
    group.add_argument('--fragment-sync-delay', type=int, default=0,
                       metavar='T', help='with --local-steps, apply a '
                       'fragment\'s outer update T steps after its sync '
                       'started (the averaging overlaps them)')
    group.add_argument('--outer-lr', type=float, default=None,
                       help='the outer Nesterov\'s lr (default: DiLoCo\'s '
                       '0.7)')
    group.add_argument('--outer-momentum', type=float, default=None,
                       help='the outer Nesterov\'s momentum (default: '
                       'DiLoCo\'s 0.9)')
    group.add_argument('--sync-warmup-steps', type=int, default=0,
                       help='with --local-steps, synchronous updates first')


def optimizer_kwargs(args):
    """The keywords of create_multi_node_optimizer for these flags ({}
    without --local-steps: the flags that need it are then passed on, and
    refused there on every rank)."""
    outer = {k: v for k, v in (('lr', args.outer_lr),
                               ('momentum', args.outer_momentum))
             if v is not None}
    if args.local_steps is None:
        kwargs = {}
        if args.fragments != 1:
            kwargs['fragments'] = args.fragments
        if args.fragment_sync_delay:
            kwargs['fragment_sync_delay'] = args.fragment_sync_delay
        if args.sync_warmup_steps:
            kwargs['sync_warmup_steps'] = args.sync_warmup_steps
        if outer:
            kwargs['outer_optimizer'] = mnopt.OuterNesterov(**outer)
        return kwargs
    return {'local_steps': args.local_steps, 'fragments': args.fragments,
            'fragment_sync_delay': args.fragment_sync_delay,
            'sync_warmup_steps': args.sync_warmup_steps,
            'outer_optimizer': mnopt.OuterNesterov(**outer) if outer
            else None}
