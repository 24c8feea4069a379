"""Gradient accumulation (``create_multi_node_optimizer(...,
accumulation_steps=K)``, Horovod's ``backward_passes_per_step``, DDP's
``no_sync()``): K local backward passes per averaging, their gradients
summed in the parameters' ``grad`` and divided by K once, before the
averaging, so that the update is that of one step over the K batches.

The sum lives where Chainer puts gradients anyway: a micro-step's
backward adds to ``param.grad`` (it is cleared only before the first
micro-step of each update), so accumulating costs no memory beyond the
gradients themselves.  The overlapped variants take the sum out before
the K-th backward (``take_sums``) and add it to each gradient as its
bucket leaves (mnopt/optimizers/overlap.py's ``fold``).

The count of micro-steps and the partial sums are this rank's own (its
own batches'): a snapshot keeps them beside the agreed state, and the
next update restores them, so a run resumed mid-accumulation continues
bit for bit.  A job of another size drops them on every rank: the
snapshot's size is the same in each of its files, and the next update's
exchange checks that every rank restored as many micro-steps."""

import chainer
import numpy

from mnopt.common import log

logger = log.get(__name__)

#: Where a snapshot keeps them (under the optimizer's key).
KEY = 'mnopt_accumulation'


class Accumulation(object):
    """One optimizer's count of micro-steps: ``steps`` (K) per update,
    ``done`` of them accumulated since the last update."""

    def __init__(self, steps):
        self.steps = steps
        self.done = 0
        #: From a snapshot, until the next update puts them back:
        #: (micro-steps done, {name: partial sum}).
        self.loaded = None
        #: The micro-steps a loaded snapshot restored: told in the next
        #: step exchange, where every rank must have restored as many.
        self.resumed = 0

    def micro_step(self, target, computed):
        """Count this call; True where it only accumulates (not the K-th
        of its update).  The caller then runs backward, clearing the
        gradients first where ``done`` is 1 (the first of the update);
        ``computed``: the caller's backward has run already (``update()``
        without a loss function)."""
        self.restore(target, computed)
        if self.done + 1 < self.steps:
            self.done += 1
            return True
        return False

    def end(self):
        """The K-th call: the number of micro-steps whose sum the
        gradients hold (0 with K=1); the count starts again."""
        done, self.done = self.done, 0
        return done

    def divide(self, target):
        """The K-th call's gradients (the sum of K backward passes) divided
        by K, in place."""
        for _, param in sorted(target.namedparams()):
            if param.grad is not None:
                param.grad /= param.grad.dtype.type(self.steps)

    def take_sums(self, target):
        """The sums of the micro-steps before the K-th, taken out of the
        parameters (whose ``grad`` is then None): {name: array}."""
        sums = {}
        for name, param in target.namedparams():
            if param.grad is not None:
                sums[name] = param.grad
                param.grad = None
        return sums

    # ------------------------------------------------------------ snapshots
    def serialize(self, serializer, target, comm):
        """The count, K, the number of ranks and the partial sums
        (``param.grad`` between micro-steps); nothing where K is 1.  A
        snapshot without them (written without accumulation, or between
        updates) loads as no micro-step done; one of another K, or of a
        job of another size than ``comm``'s, as none either, its partial
        sums dropped, which rank 0 says."""
        sums = serializer[KEY]
        if not isinstance(serializer, chainer.serializer.Deserializer):
            if self.steps > 1:
                self._save(sums, target, comm.size)
            return
        done, names, steps, size = (_read(sums, key) for key in
                                    ('done', 'names', 'steps', 'size'))
        done = 0 if done is None else int(done)
        names = [] if names is None else [str(n) for n in names]
        self.done = 0
        if done and steps is not None and int(steps) != self.steps:
            if comm.rank == 0:
                self._say_dropped(done, int(steps), names)
            done, names = 0, []
        elif done and size is not None and int(size) != comm.size:
            if comm.rank == 0:
                _say_resized(done, int(size), comm.size, self.steps)
            done, names = 0, []
        grads = sums['grads']
        self.loaded = (done, {n: grads(n.replace('/', '|'), None)
                              for n in names})

    def _save(self, sums, target, size):
        sums('done', numpy.int64(self.done))
        sums('steps', numpy.int64(self.steps))
        sums('size', numpy.int64(size))
        params = dict(target.namedparams()) if self.done else {}
        names = sorted(n for n, p in params.items() if p.grad is not None)
        sums('names', numpy.array(names, dtype=str))
        for name in names:
            sums['grads'](name.replace('/', '|'), params[name].grad)

    def _say_dropped(self, done, steps, names):
        logger.warning(
            'mnopt: warning: the snapshot loaded was written with '
            'accumulation_steps=%d, %d micro-steps into an update; this '
            'optimizer has accumulation_steps=%d, so the partial sums of '
            'those %d micro-batches (%d gradients) are dropped and the '
            'next update is over its own batches only.  To resume them, '
            'pass accumulation_steps=%d to create_multi_node_optimizer '
            '(or write snapshots right after an update)',
            steps, done, self.steps, done, len(names), steps)

    def restore(self, target, computed):
        """A loaded snapshot's count and partial sums, back in place
        (on the parameters' devices): at the first call after the load,
        when the model has its data.  Where the call's own backward has
        run (``computed``), the sums are added to its gradients; else
        they are the gradients its backward adds to."""
        if self.loaded is None:
            return
        done, sums = self.loaded
        self.loaded = None
        self.done, self.resumed = done, done
        params = dict(target.namedparams())
        if not computed:
            for param in params.values():
                param.grad = None
        for name, host in sums.items():
            param = params.get(name)
            if param is None or param.array is None:
                continue
            with chainer.using_device(param.device):
                earlier = param.device.xp.asarray(host)
                if param.grad is None:
                    param.grad = earlier
                else:
                    param.grad += earlier


def _say_resized(done, size, now, steps):
    logger.warning(
        'mnopt: warning: the snapshot loaded was written by %d ranks, %d '
        'micro-steps into an update (accumulation_steps=%d); this job has '
        '%d.  Partial sums are each rank\'s own batches\', which no rank '
        'here holds, so the micro-steps since the last update are dropped '
        'on every rank and the accumulation restarts: the next update '
        'comes after %d more calls, over their batches only.  To keep '
        'them, resume on %d ranks, or write snapshots right after an '
        'update (every multiple of %d iterations)',
        size, done, steps, now, steps, size, steps)


def _read(serializer, key):
    """A snapshot's value of ``key``, or None where it has none (a strict
    deserializer's KeyError, or a non-strict one's None)."""
    try:
        return serializer(key, None)
    except KeyError:
        return None
