"""The settings of ``create_multi_node_optimizer(..., local_steps=H)``
(mnopt/optimizers/local_steps.py; docs/local_sgd.md): their checks on
this rank, without communicating, and the values every rank must share,
which the factory compares in its one exchange.

Names: ``local_steps`` is DiLoCo's H (torchft's ``sync_every``, PyTorch's
``PeriodicModelAverager(period)``), ``outer_optimizer`` torchft's,
``fragments`` Streaming DiLoCo's P (torchft's number of
``model_fragments``), ``fragment_sync_delay`` Streaming DiLoCo's tau
(torchft's name), ``sync_warmup_steps`` PyTorch's ``warmup_steps`` /
``start_localSGD_iter``."""

import chainer
import numpy

from mnopt.averaging.tuning import REKEY_AFTER
from mnopt.optimizers.outer_nesterov import OuterNesterov


def whole(value):
    return not isinstance(value, bool) and isinstance(
        value, (int, numpy.integer))


def hook_problem(comm):
    """The ValueError for a comm hook registered on ``comm``, or None:
    checked by the factory and again at each meeting of the optimizer
    (a hook registered after it was made; registration is collective, so
    every rank raises alike)."""
    if not getattr(comm, 'comm_hook_registered', False):
        return None
    return ValueError(
        'local_steps does not combine with a registered comm hook '
        '(register_comm_hook): the hook is made for every step\'s '
        'gradients, not a sync\'s pseudo-gradients.  Call '
        'comm.register_comm_hook(None, None) first')


class LocalSteps(object):
    """What the caller passed; ``enabled`` where ``local_steps`` is."""

    def __init__(self, local_steps=None, outer_optimizer=None, fragments=1,
                 fragment_sync_delay=0, sync_warmup_steps=0):
        self.local_steps = local_steps
        self.outer_optimizer = outer_optimizer
        self.fragments = fragments
        self.fragment_sync_delay = fragment_sync_delay
        self.sync_warmup_steps = sync_warmup_steps

    @property
    def enabled(self):
        return self.local_steps is not None

    def outer(self):
        """The outer optimizer to copy once per fragment: the caller's,
        or Nesterov with lr 0.7 (DiLoCo's) and momentum 0.5."""
        return OuterNesterov() if self.outer_optimizer is None \
            else self.outer_optimizer

    def check(self, communicator, **modes):
        """A ValueError/TypeError for what this rank was given; ``modes``:
        the factory's other keywords (double_buffering=..., ...)."""
        if not self.enabled:
            given = [n for n, v, default in (
                ('outer_optimizer', self.outer_optimizer, None),
                ('fragments', self.fragments, 1),
                ('fragment_sync_delay', self.fragment_sync_delay, 0),
                ('sync_warmup_steps', self.sync_warmup_steps, 0))
                if v is not default and v != default]
            if given:
                raise ValueError(
                    '%s only apply with local_steps=H (the number of local '
                    'updates between syncs, DiLoCo\'s H): pass local_steps '
                    'too, or leave them out' % ', '.join(given))
            return
        self._check_numbers()
        self._check_outer()
        on = [n for n, v in sorted(modes.items()) if v]
        if on:
            raise ValueError(
                'local_steps does not combine with %s: local steps update '
                'each replica on its own gradients and average parameters '
                'every H steps, while %s averages every step\'s gradients.  '
                'Leave %s out (the inner optimizer runs unwrapped between '
                'syncs; docs/local_sgd.md)' % (' or '.join(
                    '%s=True' % n for n in on), on[0], on[0]))
        self._check_communicator(communicator)

    def _check_numbers(self):
        h, f, tau, w = (self.local_steps, self.fragments,
                        self.fragment_sync_delay, self.sync_warmup_steps)
        if not whole(h) or h < 1:
            raise ValueError('local_steps must be a whole number of local '
                             'updates between syncs, at least 1 (DiLoCo\'s '
                             'H, torchft\'s sync_every); got %r' % (h,))
        if not whole(f) or f < 1 or h % f:
            raise ValueError(
                'fragments must be a whole number that divides '
                'local_steps=%d (fragment f syncs every H steps, H/F steps '
                'after fragment f-1); got %r' % (h, f))
        if not whole(tau) or tau < 0 or tau > h // f:
            raise ValueError(
                'fragment_sync_delay must be a whole number of local steps '
                'from 0 (the outer update right after the sync) to '
                'local_steps // fragments = %d (one fragment in flight at a '
                'time); got %r' % (h // f, tau))
        if not whole(w) or w < 0:
            raise ValueError('sync_warmup_steps must be a whole number of '
                             'synchronous updates before the local steps, '
                             'at least 0; got %r' % (w,))

    def _check_outer(self):
        outer = self.outer_optimizer
        if outer is None:
            return
        if isinstance(outer, type) or not isinstance(outer, chainer.Optimizer):
            raise TypeError(
                'outer_optimizer takes a Chainer optimizer instance that is '
                'not set up (e.g. chainer.optimizers.SGD(lr=1.0), or '
                'mnopt.OuterNesterov(lr=0.7, momentum=0.5)); '
                'got %r' % (outer,))
        if getattr(outer, 'target', None) is not None:
            raise ValueError(
                'outer_optimizer is already set up on a model: pass a fresh '
                'optimizer; the multi-node optimizer sets up one copy per '
                'fragment on the synced parameters')

    def _check_communicator(self, comm):
        """A compression (sign, PowerSGD, 'auto') compresses each sync's
        pseudo-gradients, its state kept per fragment (a gradient set of
        its own); 'auto' settings are tuned on the syncs' averagings, as
        long as the fragment being timed comes back before the tuning
        gives it up (tuning.REKEY_AFTER averagings of other sets)."""
        problem = hook_problem(comm)
        if problem is not None:
            raise problem
        tuning_problem = getattr(comm, 'tuning_problem', None)
        if tuning_problem is not None and \
                tuning_problem('local_steps') is not None and \
                self.fragments > REKEY_AFTER:
            raise ValueError(
                "fragments=%d does not combine with a communicator's "
                "settings ='auto' (bucket_bytes='auto', ...): the tuning "
                'times the averagings of one fragment, and gives it up '
                'when %d averagings of others pass before it comes back.  '
                'Pass fragments=%d or fewer while tuning, or pass the '
                'settings as numbers (comm.tuned_settings of a tuned run; '
                'docs/tuning.md)' % (self.fragments, REKEY_AFTER,
                                     REKEY_AFTER))

    def shared(self):
        """What every rank must pass alike, as comparable values (the
        factory adds its own comparable() of hyperparameters)."""
        if not self.enabled:
            return {'local_steps': None}
        outer = self.outer()
        cls = type(outer)
        settings = {
            'local_steps': int(self.local_steps),
            'fragments': int(self.fragments),
            'fragment_sync_delay': int(self.fragment_sync_delay),
            'sync_warmup_steps': int(self.sync_warmup_steps),
            'outer_optimizer': '%s.%s' % (cls.__module__, cls.__qualname__)}
        for name, value in outer.hyperparam.get_dict().items():
            settings['outer_optimizer.%s' % name] = value
        return settings
