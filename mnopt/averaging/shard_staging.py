"""The sharded collectives' packed path: gradients packed into the wire
dtype in a host scratch (a cast, GPU arrays, or a transport that takes one
buffer), reduce-scattered and unpacked into this rank's share; parameters
gathered through a flat host byte buffer; and the overflow check of a
packed reduce-scatter.  The scratch is kept on the group (``ShardState``)."""

import numpy
from mpi4py import MPI

from mnopt.codecs import grad_buffer
from mnopt.transport import waiting


class ShardState(object):
    """What the sharded collectives keep on a group (``Group.sharded``):
    the ShardLayouts of the sets seen lately, and the host scratch."""

    def __init__(self):
        #: {(names, shapes, dtypes, wire, arrays per rank, array module):
        #: ShardLayout}: a few, each holding buffers as large as its arrays.
        self.layouts = {}
        #: The host byte buffer of what is not done in place.
        self.scratch = None


def host_scratch(group, nbytes, xp):
    """``nbytes`` of the group's host byte buffer, for what is not done
    in place.  The two operations run one after the other on the group,
    so they share it: the packed gradients (numpy gradients are packed
    straight into it; GPU ones are staged through it), then the
    parameters' bytes.  One buffer of the larger size instead of two
    (pinned where a GPU copies to or from it)."""
    state = group.sharded
    scratch = state.scratch
    if scratch is None or scratch.size < nbytes or (
            xp is not numpy and not grad_buffer.is_pinned_host(scratch)):
        state.scratch = None   # the old one can go first
        scratch = state.scratch = \
            numpy.empty(nbytes, numpy.uint8) if xp is numpy else \
            grad_buffer.pinned_host_empty(nbytes, numpy.uint8)
    return scratch[:nbytes]


def _own_bytes(array):
    """A contiguous array's bytes as a flat uint8 view (a copy for a
    non-contiguous numpy array)."""
    return numpy.ascontiguousarray(array).reshape(-1).view(numpy.uint8)


def _spread(shards, own, counts):
    """Per-array counts of the whole layout from those of the arrays
    ``own`` (0 elsewhere)."""
    out = [0] * len(shards.layout.sizes)
    for i, c in zip(own, counts):
        out[i] = c or 0
    return out


def reduce_scatter_packed(group, shards, arrays, xp, counted, rank,
                          divisor, reduce_scatter):
    """Pack into the host scratch, reduce-scatter it
    (``reduce_scatter(group, shards, [host])``, the communicator's
    transport), unpack this rank's share; return (non-finite gradient
    values per array, non-finite means per array of this rank's share, 0
    elsewhere) when ``counted`` (16-bit wires), else None."""
    buffer = shards.grad_buffer
    if buffer is None:
        # One contiguous packed buffer: no bucket cuts, nothing reduced
        # in place (the shares must be ranges of one buffer).
        buffer = shards.grad_buffer = grad_buffer.GradBuffer(
            shards.layout, xp, bucket_bytes=1 << 62)
    buffer.reset_counts()
    dtype = buffer.dtype
    host = host_scratch(group, buffer.layout.total * dtype.itemsize,
                        xp).view(dtype)
    if xp is numpy:
        buffer.swap_host(host)   # packed straight into the scratch
        buffer.pack(arrays, divisor)
    else:
        buffer.pack(arrays, divisor)
        buffer.wire.get(out=host)
    reduce_scatter(group, shards, [host])
    lo = shards.starts[rank]
    mine = host[lo:lo + shards.counts[rank]]
    if xp is numpy:
        own = list(shards.own(rank))
        # unpack_range decodes through reshape(-1) views: a
        # non-contiguous gradient gets a contiguous stand-in.
        stand_in = {i: numpy.ascontiguousarray(arrays[i]) for i in own
                    if not arrays[i].flags.c_contiguous}
        work = [stand_in.get(i, a) for i, a in enumerate(arrays)]
        buffer.unpack_range(work, mine, lo, lo + shards.counts[rank])
        for i, a in stand_in.items():
            arrays[i][...] = a
        if counted:
            return buffer.nonfinite_in, buffer.nonfinite_out
        return None
    own = list(shards.own(rank))
    if shards.own_codec is None:
        offs = shards.layout.offsets
        from mnopt.gpu.codec import Codec
        shards.own_codec = Codec(
            shards.layout.wire, [shards.layout.sizes[i] for i in own],
            [offs[i] - lo for i in own])
    shards.own_codec.reset()
    device_chunk = buffer.wire[lo:lo + shards.counts[rank]]
    device_chunk.set(mine)
    shards.own_codec.unpack(device_chunk, [arrays[i] for i in own])
    if not counted:
        return None
    buffer.take_counts()
    return buffer.nonfinite_in, _spread(
        shards, own, shards.own_codec.take_counts()[1])


def allgather_packed(group, shards, arrays, xp, rank, size, allgather):
    """Each rank's share of the parameters to every rank through a host
    byte buffer (``allgather(group, shards, [flat])``, the communicator's
    transport)."""
    flat = host_scratch(group, shards.byte_offsets[-1], xp)
    offs = shards.byte_offsets
    for i in shards.own(rank):
        a = arrays[i]
        if xp is numpy:
            flat[offs[i]:offs[i + 1]] = _own_bytes(a)
        else:
            a.reshape(-1).view(numpy.uint8).get(
                out=flat[offs[i]:offs[i + 1]])
    allgather(group, shards, [flat])
    for r in range(size):
        if r == rank:
            continue
        for i in shards.own(r):
            a, piece = arrays[i], flat[offs[i]:offs[i + 1]]
            if xp is not numpy:
                a.reshape(-1).view(numpy.uint8).set(piece)
            elif a.flags.c_contiguous:
                a.reshape(-1).view(numpy.uint8)[...] = piece
            else:
                a[...] = piece.view(a.dtype).reshape(a.shape)


class _EveryRanksCounts(object):
    """What overflow.Reporter reads of a GradBuffer (``layout``,
    ``take_counts``, ``nonfinite_in``/``nonfinite_out``), holding every
    rank's flags: whether any rank's gradients, and any share's means,
    had non-finite values in each array."""

    def __init__(self, layout, nonfinite_in, nonfinite_out):
        self.layout = layout
        self.nonfinite_in = [int(c) for c in nonfinite_in]
        self.nonfinite_out = [int(c) for c in nonfinite_out]

    def take_counts(self):
        pass


def check_overflow(group, shards, nonfinite, step, reporter):
    """``on_overflow`` for the sharded averaging.  Each rank counted the
    non-finite gradients it packed (every array) and the non-finite means
    it unpacked (its share): one all-reduce (MAX, non-blocking, waited
    for in waiting.wait_all) of a byte per array and
    direction gives every rank the same view, which the communicator's
    overflow ``reporter`` then judges as it judges an allreduce's (the
    same suspects on every rank, so its exchange cannot hang)."""
    nonfinite_in, nonfinite_out = nonfinite
    n = len(shards.layout.sizes)
    flags = numpy.zeros(2 * n, numpy.int8)
    flags[:n] = [bool(c) for c in nonfinite_in]
    flags[n:] = [bool(c) for c in nonfinite_out]
    waiting.wait_all([group.comm.Iallreduce(MPI.IN_PLACE, flags,
                                            op=MPI.MAX)])
    reporter.check(_EveryRanksCounts(shards.layout, flags[:n], flags[n:]),
                   group.comm, step)
