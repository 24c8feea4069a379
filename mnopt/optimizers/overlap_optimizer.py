"""The overlapped optimizer (``overlap=True``): the multi-node step with
its averaging during backward (mnopt/optimizers/overlap.py)."""

import chainer
import numpy

from mnopt.optimizers.overlap import Overlap
from mnopt.optimizers.protocol import BROADCAST, RESUME, MultiNodeOptimizer
from mnopt.optimizers.protocol import stepped


class OverlapOptimizer(MultiNodeOptimizer):
    """Averages gradients during backward, bucket by bucket as they become
    final (mnopt/optimizers/overlap.py), and updates with the exact mean:
    the same parameters as without overlap.  Needs ``update(lossfun,
    *args)`` (as Chainer's updaters call it); ``update()`` alone averages
    after the fact, as without overlap."""

    def __init__(self, actual_optimizer, communicator, zero_fill):
        super(OverlapOptimizer, self).__init__(
            actual_optimizer, communicator, zero_fill)
        object.__setattr__(self, '_overlap', None)

    def setup(self, link):
        super(OverlapOptimizer, self).setup(link)
        object.__setattr__(self, '_overlap', Overlap(
            self.communicator, link, self.zero_fill))
        return self

    @property
    def overlap_stats(self):
        """{'buckets': n, 'during_backward': k}: of the last update's n
        buckets, k were handed to the communicator during backward."""
        return dict(self._overlap.stats)

    def serialize(self, serializer):
        """With a ``compression`` or a comm hook also the buckets (the
        plan): a vote, a low-rank mean or a hook's state depends on them
        (each bucket is a gradient set of its own, with its own
        residuals, PowerSGD factors, turn of the counter), so a resumed
        run keeps them to continue bit for bit.  Every rank must then load the same
        snapshot (a rank that loaded none would average other buckets:
        an error on every rank).  Without either, or from a snapshot
        without them, the plan is made again, as after a broadcast."""
        super(OverlapOptimizer, self).serialize(serializer)
        compressed = self.communicator.compression is not None or \
            self._hooked()
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        if not loading:
            if compressed:
                plan = self._overlap.plan or []
                serializer('mnopt_plan_names', numpy.array(
                    [n for names in plan for n in names], dtype=str))
                serializer('mnopt_plan_sizes', numpy.array(
                    [len(names) for names in plan], numpy.int64))
            return
        self._overlap.forget_plan()
        try:
            names = serializer('mnopt_plan_names', None) if compressed else None
            sizes = serializer('mnopt_plan_sizes', None) if compressed else None
        except KeyError:
            names = sizes = None
        if names is None or sizes is None or not len(sizes):
            return
        names, plan = [str(n) for n in names], []
        for size in (int(s) for s in sizes):
            plan.append(names[:size])
            names = names[size:]
        if not names and set(n for b in plan for n in b) <= set(
                n for n, _ in self.target.namedparams()):
            self._overlap.plan = plan

    def _hooked(self):
        """Whether a comm hook averages (the same on every rank)."""
        return getattr(self.communicator, 'comm_hook_registered', False)

    @stepped
    def update(self, lossfun=None, *args, **kwds):
        if lossfun is None:
            return super(OverlapOptimizer, self).update(None, *args, **kwds)
        overlap = self._overlap
        if self._accumulation.end():
            overlap.accumulated(self._accumulation.take_sums(self.target),
                                self._accumulation.steps)
        # Warm-up (``warmup_steps``) counts iterations, not buckets: every
        # averaging of this update is of iteration t.
        overlap.forward_backward(lossfun, args, kwds,
                                 self.actual_optimizer._loss_scale,
                                 self.actual_optimizer.t)
        if overlap.plan is None and self._hooked():
            overlap.make_plan(alone=True)   # its buckets averaged at once
        overlap.finish()
        # Whether any rank has gradients no bucket holds rides on the
        # step's exchange: from the third update on usually none does,
        # and no empty set is averaged (a collective, a layout check and,
        # with compression='auto', a guard's trials of its own).
        step, anyone_has_rest = self._agree_step(bool(overlap.rest))
        for handle in overlap.send_rest(anyone_has_rest):
            self._blocked(handle.wait)
        if step is BROADCAST:
            overlap.forget_plan()
            self.communicator.bcast_data(self.target)
            return
        if self._hooked() and (overlap.unchecked or step is RESUME):
            # Planned alone this update, or loaded from a snapshot (or
            # kept where a rank loaded none): the same everywhere?
            overlap.check_plan()
        if step is RESUME and not self._make_replicas_agree():
            return
        overlap.adopt()
        if overlap.plan is None:
            overlap.make_plan()
        self._apply(*args, **kwds)
