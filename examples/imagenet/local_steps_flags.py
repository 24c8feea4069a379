"""The ImageNet example's flags of local steps with an outer optimizer
(DiLoCo, Streaming DiLoCo: docs/local_sgd.md): ``--local-steps H``,
``--fragments F``, ``--fragment-sync-delay T``, ``--outer-lr``,
``--outer-momentum`` and ``--sync-warmup-steps``, turned into the keywords
of ``create_multi_node_optimizer``.

With ``--local-steps`` the example evaluates the synced parameters (the
same on every rank: ``evaluating_synced``), so the validation accuracy is
that of the model a user would keep, and its default ``--lr`` is the inner
optimizer's for one rank's batch (``set_inner_lr``): a resume on another
number of ranks changes it, and says so (``warn_of_resumed_lr``).  A
local-steps snapshot resumes only with the flags it was written with:
read from the file before anything is loaded, and named where they
differ (``resume_problem``)."""

import types

import numpy

import mnopt  # before Chainer: NumPy 2 names for it
import chainer  # NOQA: E402
from mnopt.optimizers.local_steps_mark import SNAPSHOT_KEY, saved_values

#: Where the example's shared snapshot file holds the local-steps state.
SAVED = 'updater/optimizer:main/%s/' % SNAPSHOT_KEY


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
                       '0.5; DiLoCo\'s is 0.9, for H in the hundreds)')
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


def note_lr_given(args):
    """Before the example fills in its defaults: whether --lr was given."""
    args.lr_given = args.lr is not None


def set_inner_lr(args, comm):
    """With --local-steps and no --lr: ``args.lr`` (the example's
    synchronous default, tuned for the batch of ``batchsize`` x ranks one
    synchronous update averages) divided by the ranks, the linear scaling
    rule for the inner optimizer, which steps on one rank's batch alone.
    (The synchronous 0.05 as the inner lr of 16 images per rank does not
    train the example's CNN, even on one rank: docs/local_sgd.md.)"""
    if args.local_steps is None or args.lr_given:
        return
    synchronous = args.lr
    args.lr = synchronous / comm.size
    if comm.rank == 0:
        print('local steps: inner lr %g, the synchronous %g over %d ranks '
              '(each inner update sees one rank\'s batch; --lr sets it)'
              % (args.lr, synchronous, comm.size))


def warn_of_resumed_lr(args, comm, same_ranks):
    """After ``--resume`` on another number of ranks than the snapshot's,
    with --local-steps and no --lr: rank 0 says that the inner lr is now
    the synchronous one over the new number of ranks, not the one the
    snapshot trained with (Chainer's snapshots do not hold an
    optimizer's lr).  True where it said so."""
    if same_ranks or args.local_steps is None or args.lr_given:
        return False
    if comm.rank == 0:
        print('train_imagenet.py: warning: resumed on %d ranks from a '
              'snapshot of another number of ranks: the default inner lr is '
              'now %g (the synchronous lr over %d ranks), not the one the '
              'snapshot trained with; pass --lr to keep that one '
              '(docs/local_sgd.md)' % (comm.size, args.lr, comm.size),
              flush=True)
    return True


def evaluating_synced(evaluator, optimizer):
    """``evaluator`` evaluating the synced parameters, the same on every
    rank (``optimizer.using_synced_parameters()``; the local ones again
    after), where the optimizer has local steps; as it is otherwise.
    Wrap it before ``mnopt.create_multi_node_evaluator``."""
    synced = getattr(optimizer, 'using_synced_parameters', None)
    if synced is None:
        return evaluator
    evaluate = evaluator.evaluate

    def evaluate_synced(self):
        with synced():
            return evaluate()

    evaluator.evaluate = types.MethodType(evaluate_synced, evaluator)
    return evaluator


def local_steps_optimizer(optimizer):
    """``optimizer`` where it has local steps, else None."""
    return optimizer if hasattr(optimizer, 'using_synced_parameters') \
        else None


def saved_flags(path):
    """The local-steps flags the snapshot whose shared file is ``path``
    was written with ({flag's dest: value}), or None: written without
    --local-steps.  Read from the file, before anything is loaded."""
    with numpy.load(path) as f:
        flags = saved_values(chainer.serializers.NpzDeserializer(
            f, path=SAVED))
    if flags is not None:
        flags.pop('outer_optimizer', None)   # no flag: --outer-* only
    return flags


def _said(flags, names=None):
    """``flags`` as the command line gives them: ``names``, or --local-steps
    and the others that are not their defaults."""
    if names is None:
        names = [n for n in ('local_steps', 'fragments',
                             'fragment_sync_delay', 'sync_warmup_steps')
                 if n in flags and flags[n] != DEFAULTS.get(n)]
    return ' '.join('--%s %d' % (n.replace('_', '-'), flags[n])
                    for n in names)


#: The defaults of the flags a local-steps snapshot records.
DEFAULTS = {'fragments': 1, 'fragment_sync_delay': 0, 'sync_warmup_steps': 0}


def resume_problem(path, args):
    """None where this run's flags (``args``) can resume the snapshot whose
    shared file is ``path``, else why not, naming the flags to resume it
    with: a local-steps snapshot needs --local-steps and the settings it
    was written with (the outer lr and momentum may change).  A snapshot
    without local steps resumed with --local-steps starts its first H
    from the snapshot's parameters."""
    saved = saved_flags(path)
    if saved is None:
        return None
    if args.local_steps is None:
        return ('it was written with %s, and between syncs each rank holds '
                'its own parameters and inner optimizer state, which a run '
                'without --local-steps cannot continue: resume it with those '
                'flags (on any number of ranks)' % _said(saved))
    differ = [name for name in saved if getattr(args, name) != saved[name]]
    if not differ:
        return None
    return ('it was written with %s; this run has %s: resume it with the '
            "snapshot's" % (_said(saved, differ), _said(vars(args), differ)))
