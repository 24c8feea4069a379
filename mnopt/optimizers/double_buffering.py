"""Double buffering: update k applies the mean of iteration k-1's
gradients while iteration k's are averaged in the background."""

import chainer
import numpy

from mnopt.common.arrays import named_grads
from mnopt.optimizers.protocol import BROADCAST, RESUME, MultiNodeOptimizer
from mnopt.optimizers.protocol import stepped


class DoubleBufferingOptimizer(MultiNodeOptimizer):
    """``double_buffering=True``: update k applies the mean of iteration
    k-1's gradients while iteration k's are averaged in the background
    (one step stale).

    Only the gradient arrays are double buffered: after backward, each
    parameter's fresh gradient is swapped with its shadow (which holds the
    finished mean of the previous iteration), and the shadows are averaged
    asynchronously.  Parameters and persistent values are never copied.
    """

    def __init__(self, actual_optimizer, communicator, zero_fill):
        super(DoubleBufferingOptimizer, self).__init__(
            actual_optimizer, communicator, zero_fill)
        object.__setattr__(self, 'communicated_target', {})
        object.__setattr__(self, 'needs_update', False)
        object.__setattr__(self, '_handle', None)

    def wait(self):
        """Block until the averaging in flight ends (re-raising its error)."""
        handle = self._handle
        object.__setattr__(self, '_handle', None)
        if handle is not None:
            self._blocked(handle.wait)

    def _serialize_state(self, serializer):
        """Also the averaged gradients of the last iteration, which the
        next update applies: a resumed run continues exactly where the
        snapshot left off.  They are means, the same on every rank, so a
        snapshot resumes on any number of ranks.

        A snapshot without them (a plain multi-node optimizer's, or
        ChainerMN's) loads too: nothing is pending (``needs_update``
        False), so the next update averages its gradients and applies
        nothing, as after a broadcast; the pipeline then runs one step
        stale again.  A plain optimizer ignores them."""
        self.wait()
        super(DoubleBufferingOptimizer, self)._serialize_state(serializer)
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        # Absent from the snapshot: False (a strict deserializer's KeyError
        # means the same).
        try:
            needs_update = bool(serializer(
                'mnopt_needs_update', False if loading else
                self.needs_update))
        except KeyError:
            needs_update = False
        names = numpy.array(sorted(self.communicated_target)
                            if self.needs_update else [], dtype=str)
        if loading:
            names = serializer('mnopt_averaged_names', None) \
                if needs_update else []
        else:
            serializer('mnopt_averaged_names', names)
        # '/' would nest the keys; parameter names start with it.
        grads = serializer['mnopt_averaged_grads']
        if not loading:
            for name in names:
                grads(name.replace('/', '|'), self.communicated_target[name])
            return
        params = dict(self.target.namedparams())
        loaded = {}
        for name in (str(n) for n in names):
            xp = chainer.backend.get_array_module(params[name].array)
            loaded[name] = xp.asarray(grads(name.replace('/', '|'), None))
        object.__setattr__(self, 'communicated_target', loaded)
        object.__setattr__(self, 'needs_update', needs_update)

    @stepped
    def update(self, lossfun=None, *args, **kwds):
        if lossfun is not None:
            self._backward(lossfun, args, kwds)
        step = self._next_step()
        self.wait()
        if step is BROADCAST:
            self.communicator.bcast_data(self.target)
            object.__setattr__(self, 'communicated_target', {})
            object.__setattr__(self, 'needs_update', False)
            return
        if step is RESUME and not self._make_replicas_agree():
            return   # what was pending (now rank 0's) applies next update
        params = dict(self.target.namedparams())
        shadows = self.communicated_target
        fresh = named_grads(self.target, self.zero_fill)
        for name, grad in fresh:
            # Each parameter's gradient becomes the mean this update
            # applies; where nothing is applied yet, zeros (never None).
            param = params[name]
            shadow = shadows.get(name)
            if shadow is None:
                with chainer.using_device(param.device):
                    shadow = param.device.xp.zeros_like(grad)
            param.grad = shadow
        object.__setattr__(self, 'communicated_target', dict(fresh))
        object.__setattr__(self, '_handle', self._blocked(
            self.communicator.mean_grads_async, fresh))
        if self.needs_update:
            self._apply(*args, **kwds)
        else:
            object.__setattr__(self, 'needs_update', True)
