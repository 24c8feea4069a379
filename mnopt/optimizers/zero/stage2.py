"""ZeRO stage 2 (``shard_state=True, overlap=True``): stage 1 with the
gradients sharded too, each bucket reduce-scattered to its pieces' ranks
during backward (overlap's machinery, extended)."""

import collections

from mnopt.common.arrays import array_module
from mnopt.optimizers.overlap import Overlap
from mnopt.optimizers.protocol import BROADCAST, RESUME, stepped
from mnopt.optimizers.zero.partition import piece_label
from mnopt.optimizers.zero.stage1 import ShardedStateOptimizer


class ShardedOverlap(Overlap):
    """Overlap's machinery (mnopt/optimizers/overlap.py) for stage 2: a
    bucket is reduce-scattered to its parameters' owners as soon as
    backward has finished every gradient in it, and the gradients of the
    other ranks' parameters are let go as soon as that is done.

    The node of a planned parameter takes its gradient (a copy, as
    overlap's: Chainer may share the array it passes) and gives the
    parameter none, so Chainer drops its own array at once instead of
    holding every parameter's gradient until backward ends.  A bucket
    holds its gradients' pieces laid out by rank (rank 0's, then rank
    1's...: plan order within each) and goes to
    ``reduce_scatter_mean_async``; the copies of parameters this rank
    holds no piece of are referenced by that job only, so they are freed
    when its reduce-scatter ends (a parameter cut by this rank's share's
    ends is kept whole until backward ends: at most two per dtype)."""

    #: Buckets in flight at most: launching one more first waits for the
    #: oldest (whose other ranks' gradients are then freed), so that a
    #: backward faster than the network holds a few buckets' copies, not
    #: every gradient.
    max_in_flight = 2

    def __init__(self, communicator, target, pieces):
        self._pieces = pieces   # () -> [Piece, ...]
        super(ShardedOverlap, self).__init__(communicator, target, True)

    def reset(self):
        super(ShardedOverlap, self).reset()
        self.oldest = 0      # handles before it have been waited for
        self.seen = {}       # planning: name -> the array its node got
        self.fired = set()   # names whose node took the gradient
        self.extra = set()   # of those, also used outside their link
        self.vouched = set()

    def unplanned(self, name, grad):
        """Planning: remember the array, to vouch for it in ``finish``."""
        self.seen[name] = grad   # Chainer holds it anyway
        return None

    def keep(self, name, grad):
        """Take the gradient: a copy for the bucket, none for Chainer."""
        self.early[name] = self.fold(name, grad.copy())
        self.fired.add(name)
        return False   # the parameter gets no gradient from Chainer

    def bucket_gradient(self, name, params):
        """The copy its node took (the bucket's job alone holds it where
        another rank owns the parameter), else its gradient."""
        if name in self.early:
            return self.early[name] if self.comm.rank in \
                self._holders().get(name, ()) \
                else self.early.pop(name)   # the job's alone
        # Unused by its link this time: zeros, or what a use outside gave.
        return self.summed_gradient(name, params[name])

    def _holders(self):
        """{name: the ranks holding a piece of it}."""
        return _ranks_of(self._pieces())

    def send(self, named):
        """Queue the reduce-scatter of ``named``'s pieces laid out by
        rank."""
        of = collections.defaultdict(list)
        for p in self._pieces():
            of[p.name].append(p)
        by_rank = collections.defaultdict(list)
        for name, grad in named:
            flat = _flat(grad)
            for p in of[name]:
                by_rank[p.rank].append((piece_label(p), flat[p.lo:p.hi]))
        size = self.comm.size
        per_rank = [len(by_rank[r]) for r in range(size)]
        named = [x for r in range(size) for x in by_rank[r]]
        while len(self.handles) - self.oldest >= self.max_in_flight:
            self.handles[self.oldest].wait()
            self.oldest += 1
        return self.comm.reduce_scatter_mean_async(named, per_rank)

    def finish(self):
        """Queue the buckets backward did not finish; the rest (the
        parameters outside the plan, and the gradients that planned
        parameters got from a use outside their link, added to the mean
        in ``adopt``) waits in ``rest`` for ``send_rest``'s one
        reduce-scatter, where any rank has some (overlap's ``finish``).
        Returns the handles."""
        params = self.params()
        covered = self.launch_remaining(params)
        if self.plan is None:
            # Planning: a node vouches for a parameter whose final
            # gradient is the array it received.
            self.vouched = {n for n, g in self.seen.items()
                            if params[n].grad is g}
            self.seen = {}
        self.stats['buckets'] = 0 if self.plan is None else len(self.plan)
        self.extra = {n for n in self.fired if params[n].grad is not None}
        rest = [n for n in sorted(params) if params[n].array is not None
                and (n not in covered or n in self.extra)]
        self.rest = [(n, g) for n, g in (
            (n, self.summed_gradient(n, params[n])) for n in rest)
            if g is not None]
        self.accumulated({}, 1)
        return self.handles

    def adopt(self):
        """Once every handle is done: {name: this rank's piece's mean
        gradient, flat}.  A parameter this rank holds whole gets its mean
        as gradient; the others' gradients are dropped."""
        rank, means = self.comm.rank, {}
        mine = {p.name: p for p in self._pieces() if p.rank == rank}
        for name, param in self.params().items():
            piece = mine.get(name)
            mean = self.early.get(name)
            if piece is not None and mean is not None:
                if name in self.extra:   # mean of the link's + the rest's
                    mean += param.grad
                param.grad = mean
            if piece is None or param.grad is None:
                param.grad = None
                continue
            flat = _flat(param.grad)
            if piece.lo == 0 and piece.hi == flat.size:
                means[name] = flat
            else:
                means[name] = flat[piece.lo:piece.hi].copy()
                param.grad = None
        self.early, self.fired, self.extra = {}, set(), set()
        return means

    def make_plan(self):
        """From the planning iteration: parameters its nodes vouched for,
        in forward order."""
        params = self.params()
        self.set_plan([(n, params[n].array.nbytes)
                       for n, k in self.wraps.items()
                       if k == 1 and n in self.vouched])
        self.vouched = set()


def _ranks_of(pieces):
    out = collections.defaultdict(set)
    for p in pieces:
        out[p.name].add(p.rank)
    return out


def _flat(grad):
    """A gradient's flat view (a C-ordered copy if it is not
    contiguous: then the mean lands in the copy, which is what is read)."""
    if not grad.flags.c_contiguous:
        grad = array_module([grad]).ascontiguousarray(grad)
    return grad.reshape(-1)


class ShardedGradsOptimizer(ShardedStateOptimizer):
    """ZeRO stage 2 (``shard_state=True, overlap=True``): the optimizer
    state and the gradients are sharded.  During ``update(lossfun, ...)``'s
    backward each bucket of gradients goes to its parameters' owners in a
    reduce-scatter as soon as backward has finished it, and the other
    ranks' gradients are freed then, so a rank holds its own gradients
    and the buckets in flight rather than every gradient.  The owners
    then update and the parameters are all-gathered, as in stage 1
    (``ShardedStateOptimizer``, whose snapshots, hooks and checks it
    keeps).  ``update()`` without a loss function is stage 1's.

    The first update broadcasts; the next one (the planning iteration)
    reduce-scatters after backward, as stage 1, and makes the plan of
    buckets (checked the same on every rank); from the third on, buckets
    leave during backward."""

    def __init__(self, actual_optimizer, communicator, zero_fill):
        super(ShardedGradsOptimizer, self).__init__(
            actual_optimizer, communicator, zero_fill)
        object.__setattr__(self, '_overlap', None)

    def setup(self, link):
        super(ShardedGradsOptimizer, self).setup(link)
        object.__setattr__(self, '_overlap', ShardedOverlap(
            self.communicator, link, lambda: self._pieces))
        return self

    @property
    def overlap_stats(self):
        """{'buckets': n, 'during_backward': k}: of the last update's n
        buckets, k were reduce-scattered during backward."""
        return dict(self._overlap.stats)

    def _wait_all(self, handles, quiet=False):
        """Wait for every handle; then raise the first error unless
        ``quiet``."""
        first = None
        for handle in handles:
            try:
                self._blocked(handle.wait)
            except Exception as e:
                first = first or e
        if first is not None and not quiet:
            raise first

    @stepped
    def update(self, lossfun=None, *args, **kwds):
        if lossfun is None:
            return super(ShardedGradsOptimizer, self).update(
                None, *args, **kwds)
        loaded = self._loaded_share
        if loaded is not None and loaded[1] is None and loaded[0]:
            # The snapshot's pieces (checked the same on every rank at
            # this update), before any bucket leaves for their ranks.
            object.__setattr__(self, '_pieces', list(loaded[0]))
        ov, actual, comm = self._overlap, self.actual_optimizer, \
            self.communicator
        if self._accumulation.end():
            ov.accumulated(self._accumulation.take_sums(self.target),
                           self._accumulation.steps)
        try:
            ov.forward_backward(lossfun, args, kwds, actual._loss_scale,
                                actual.t)
            order, per_rank = self._plan()   # pieces of new parameters
            used = list(self._pieces)
            ov.finish()
            # Whether any rank has gradients no bucket holds rides on the
            # step's exchange: from the third update on usually none
            # does, and no empty set is reduce-scattered (a collective
            # and a layout check a step).
            step, anyone_has_rest = self._agree_step(bool(ov.rest))
            ov.send_rest(anyone_has_rest)
        except Exception:
            # A bucket's error or the step's (every rank has it), or the
            # loss's; what is in flight fails or ends alike: wait for it,
            # so that nothing is left running.
            self._wait_all(ov.handles, quiet=True)
            raise
        self._wait_all(ov.handles)
        means = ov.adopt()
        if step is BROADCAST:
            ov.forget_plan()
            comm.bcast_data(self.target)
            self._plan()
            return
        if step is RESUME and (not self._make_replicas_agree() or
                               used != self._pieces):
            # Other weights' gradients, or sent to other pieces than the
            # snapshot's: nothing applied (as after a broadcast).
            ov.forget_plan()
            self._plan()
            for name, param in self.target.namedparams():
                param.cleargrad()
            return
        if ov.plan is None:
            ov.make_plan()
        self._update_pieces(means)
        self._allgather(dict(self.target.namedparams()), order, per_rank)
