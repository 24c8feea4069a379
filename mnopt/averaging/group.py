"""Group: one private MPI communicator of a communicator, and the gradient
buffers and sign codecs it averages over it.

A communicator averages through a *group*: a private duplicate of the
user's MPI communicator and the persistent GradBuffer for the current
gradient layout.  The synchronous path and the asynchronous one (double
buffering) each have their own group, so two threads never share an MPI
communicator.  What a kind of communicator needs besides (sub-communicators,
an NCCL communicator, a server channel) is its own object, the group's
``state``; the sharded collectives keep theirs in ``sharded``.
"""

import logging

from mpi4py import MPI

from mnopt.common import log
from mnopt.transport import cpu_phases
from mnopt.transport import layouts
from mnopt.codecs import grad_buffer
from mnopt.codecs import sign
from mnopt.averaging.devices import device_of


class Group(object):
    """A private MPI communicator and the gradient buffer used over it."""

    #: Buffers (and sign codecs) kept per gradient set: the overlapped
    #: optimizer averages its buckets in turn, each with its own (and
    #: with PowerSGD two: its Ps', its Qs').
    MAX_KEPT = 512

    def __init__(self, comm, state=None):
        #: The private MPI communicator (a duplicate of the user's).
        self.comm = comm
        #: The communicator kind's own state for this group, or None: an
        #: object of its making with a ``free()``, called when the group
        #: is freed (before ``comm``): hierarchical's node communicators,
        #: pure_nccl's NCCL communicator, reduction_server's channel.
        self.state = state
        #: compression='sign': the sign codec used last.
        self.sign_codec = None
        #: GPU id -> the stream of background work on that GPU
        #: (mnopt/averaging/background.py).
        self.side_streams = {}
        #: The sharded collectives' state (sharded.ShardState), made at
        #: their first use on this group.
        self.sharded = None
        self._buffers, self._sign_codecs = {}, {}

    def _kept(self, kept, names, named, xp):
        key = (names, xp.__name__, device_of(named, xp))
        return key, kept.get(key)

    def _keep(self, kept, key, holder):
        if key not in kept and len(kept) >= self.MAX_KEPT:
            kept.clear()
        kept[key] = holder
        return holder

    def buffer_for(self, named, wire, xp, **buffer_options):
        """The GradBuffer for this gradient set; rebuilt when it changes
        (or moves to another device), or the ``buffer_options`` do (a
        bucket size being tuned).

        The cross-rank layout check runs on every call (one 8-byte
        Allgather) and before any buffer is built, so a rank whose parameter
        set changed alone gets an error instead of a hang or a corrupted sum.
        """
        names = tuple(n for n, _ in named)   # the key's and the layout's
        key, buffer = self._kept(self._buffers, names, named, xp)
        layout = self._checked_layout(names, named, wire, buffer)
        if buffer is None or buffer.layout is not layout or \
                buffer.options != buffer_options:
            buffer = self._keep(self._buffers, key, grad_buffer.GradBuffer(
                layout, xp, **buffer_options))
            buffer.options = buffer_options
            _log_layout(buffer, named)
        return buffer

    def sign_codec_for(self, named, xp, error_feedback):
        """The SignCodec (and its residuals) for this gradient set; rebuilt,
        residuals zeroed, when the set changes.  Checked as buffer_for."""
        names = tuple(n for n, _ in named)
        key, codec = self._kept(self._sign_codecs, names, named, xp)
        layout = self._checked_layout(names, named, 'float32', codec)
        if codec is None or codec.layout is not layout:
            codec = self._keep(self._sign_codecs, key, sign.SignCodec(
                layout, xp, error_feedback))
        self.sign_codec = codec
        return codec

    def sign_residuals(self):
        """{parameter names: residual} of this group's sign codecs (error
        feedback on), the arrays themselves."""
        return {key[0]: codec.residual
                for key, codec in self._sign_codecs.items()
                if codec.residual is not None}

    def forget_sign_codecs(self):
        """Drop the sign codecs: the next averaging of each layout builds
        a new one (residuals zero, unless a loaded snapshot has them)."""
        self.sign_codec = None
        self._sign_codecs = {}

    def _checked_layout(self, names, named, wire, holder):
        """``holder``'s layout (a buffer's or codec's) while it still fits
        ``named`` (whose ``names``) and ``wire``, else a new one; checked
        across ranks."""
        key = (names, tuple(a.shape for _, a in named),
               tuple(a.dtype.name for _, a in named))
        if (holder is not None and holder.layout.key[:3] == key
                and (wire is None or holder.layout.wire == wire)):
            layout = holder.layout
        else:
            layout = grad_buffer.make_layout(named, wire)
        with cpu_phases.phase('check'):
            layouts.check_layouts(self.comm, layout)
        return layout

    def free(self):
        self.sign_codec = None
        self._buffers, self._sign_codecs = {}, {}
        if self.state is not None:
            self.state.free()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()
        self.comm = MPI.COMM_NULL


#: Each new bucket layout, at DEBUG ($MNOPT_LOG_LEVEL=DEBUG), on every
#: rank: ranks whose layouts differ show it side by side.  Logger
#: mnopt.communicators.group, its name before averaging/
#: (docs/debugging.md).
_logger = log.get('mnopt.communicators.group')


def _log_layout(buffer, named):
    if not _logger.isEnabledFor(logging.DEBUG):
        return
    _logger.debug(
        'mnopt: a gradient set of %d arrays (%s ... %s), %d '
        'elements on the wire as %s, in %d bucket(s) of up to %d elements',
        len(named), named[0][0] if named else '-',
        named[-1][0] if named else '-', buffer.wire.size, buffer.layout.wire,
        len(buffer.buckets), buffer.bucket_elems)
