"""ChainerMN's model-level methods of a communicator (a Chainer Link's
gradients averaged, its parameters broadcast) and the snapshot of its sign
compression (a Chainer serializer): the communicator's Chainer glue, mixed
into every communicator.  The core does not import Chainer for them."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from mnopt.transport import buffers, layouts
from mnopt.codecs import grad_buffer
from mnopt.common.arrays import array_module, named_grads, to_host
from mnopt.averaging.compression import warn_of_dropped_state
from mnopt.stall.monitor import watched

if TYPE_CHECKING:
    import chainer


def _chainer_debug():
    """Whether Chainer is in use and in debug mode (``chainer.set_debug``);
    the core does not import Chainer for it."""
    chainer = sys.modules.get('chainer')
    return chainer is not None and chainer.is_debug()


class ChainerGlue(object):
    """Needs the host's public ``mean_grads``, ``averaging`` (an
    Averaging), ``compression``, ``rank`` and ``size``, and the stall
    monitor ``watched`` uses."""

    def multi_node_mean_grad(self, model: chainer.Link,
                             zero_fill: bool = False) -> None:
        """Replace each parameter's gradient by its mean over all ranks.

        Parameters without data are skipped.  Parameters without a gradient
        are skipped too, unless ``zero_fill``: then they count as zeros
        (and receive the mean as their gradient).
        """
        named = named_grads(model, zero_fill)
        self.mean_grads(named)
        if _chainer_debug():
            # ChainerMN's check, in Chainer's debug mode: the means are the
            # same on every rank, so every rank raises.
            for name, grad in named:
                if not array_module([grad]).isfinite(grad).all():
                    raise ValueError('Parameters diverged after allreduce: '
                                     'the mean gradient of %s is not finite'
                                     % name)

    def allreduce_grad(self, model: chainer.Link,
                       zero_fill: bool = False) -> None:
        """Deprecated ChainerMN name of multi_node_mean_grad."""
        self.multi_node_mean_grad(model, zero_fill)

    @watched('bcast_data')
    def bcast_data(self, model: chainer.Link, root: int = 0) -> None:
        """Broadcast every parameter's data from ``root`` (checked first)."""
        named = [(n, p.array) for n, p in sorted(model.namedparams())
                 if p.array is not None]
        comm = self.averaging.sync_group.comm
        layout = grad_buffer.Layout([n for n, _ in named],
                                    [a.shape for _, a in named],
                                    [a.dtype for _, a in named], wire='-')
        layouts.check_layouts(comm, layout, what='parameters')
        for _, array in named:
            host = to_host(array)
            buffers.bcast_bytes(comm, host, root)
            if host is not array:
                array.set(host)

    broadcast_data = bcast_data

    def serialize_compression(self, serializer: chainer.AbstractSerializer,
                              shared: bool = True,
                              local: bool = True) -> None:
        """Save (a Chainer Serializer) or load (a Deserializer) the state
        of gradient compression, so that a run resumed from a snapshot
        continues bit for bit.  Nothing without ``compression``.
        Waits for a background averaging first.

        ``shared``: the averaging counter ``steps`` (warm-up, and the
        votes' coin) and, with ``compression='auto'``, the choice made
        for each gradient set, the same on every rank.  ``local``: with
        ``error_feedback``, this rank's residuals, one per gradient layout
        averaged (per bucket with overlap; those averaged in the
        background apart); with PowerSGD also its warm Qs (the same on
        every rank, so they are taken from any rank's snapshot).  The multi-node optimizer's snapshot holds both;
        the state its replicas agree on after a load, the shared part only.

        Residuals are rank-local: a rank takes them only from a snapshot
        this rank wrote in a job of this size, and otherwise starts them
        at zero.  So an exact resume needs a snapshot per rank (e.g.
        ``multi_node_snapshot`` with a replica set per rank); with one
        replica set, where every rank loads rank 0's file, only rank 0
        keeps its residuals.  A snapshot without this state (older mnopt,
        ChainerMN) loads and changes nothing.  Loaded residuals wait until
        the first averaging of their layout builds its codec.
        """
        import chainer   # the Chainer layer's call
        hook = self.averaging.comm_hook   # docs/hooks.md: its state
        if hook is not None and local:
            self.averaging.in_flight.wait()
            hook.serialize(serializer['comm_hook'], not isinstance(
                serializer, chainer.serializer.Deserializer))
        if self.compression is None:
            if local and self.rank == 0 and isinstance(
                    serializer, chainer.serializer.Deserializer):
                warn_of_dropped_state(serializer, self)
            return
        averaging = self.averaging
        averaging.in_flight.wait()
        state = averaging.signs if self.compression == 'sign' \
            else averaging.low_rank
        if isinstance(serializer, chainer.serializer.Deserializer):
            state.load(serializer, averaging, self.rank, self.size, shared,
                       local)
        else:
            state.save(serializer, averaging, self.rank, self.size, shared,
                       local)
