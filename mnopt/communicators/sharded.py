"""ZeRO's two collectives as communicator operations, mixed into every
communicator: ``reduce_scatter_mean`` (each rank ends with the mean of its
share of the gradients) and ``allgather_params`` (each rank's share of the
parameters to every rank).  mnopt/zero.py's sharded optimizer uses them;
docs/zero.md says what they cost.

Both take ``named`` arrays *laid out by owner* and ``arrays_per_rank``:
rank 0 owns the first ``arrays_per_rank[0]`` arrays, rank 1 the next
``arrays_per_rank[1]``, and so on (whole arrays: an update rule works on
whole parameters).  Packed in that order the shares are contiguous ranges
of one flat buffer, so each operation is one collective over it:

- gradients: packed into the wire dtype, each divided by the number of
  ranks on the way (divide before summing, as ``mean_grads`` does), one
  reduce-scatter with per-rank counts, then only this rank's range is cast
  back into its own arrays;
- parameters: this rank's arrays copied as raw bytes into its range of a
  flat byte buffer, one all-gather, every other rank's range copied back
  into the arrays (bits as the owner has them: replicas stay identical).

The transport is the communicator's: ``flat`` runs mnopt's pipelined ring
(mnopt/ring.py), ``hierarchical`` reduces inside each node, runs the ring
among the node leaders over the nodes' ranges and scatters inside the node
(gathers, ring, broadcast for the parameters), ``naive`` (the reference)
MPI's Reduce_scatter and Allgatherv, ``pure_nccl`` NCCL's reduceScatter and
allGather (mnopt/communicators/pure_nccl.py).  GPU arrays are staged
through pinned host memory except on ``pure_nccl``.

Every call first checks, in one 16-byte Allgather, that every rank passes
the same layout (names, shapes, dtypes, wire dtype) and the same
``arrays_per_rank``, and that no rank found its arguments bad: otherwise
the same error is raised on every rank, never a hang.  Both operations are
stall-watched like every other communicator operation.
"""

import hashlib

import numpy
from mpi4py import MPI

from mnopt import _mpi
from mnopt import grad_buffer
from mnopt import ring
from mnopt.arrays import array_module
from mnopt.stall import watched

#: Communicators whose shards move over host memory with these transports.
#: ``pure_nccl`` overrides the device-side methods; ``reduction_server``
#: has no sharded path (see ``sharding_problem``).
_HOST_TRANSPORTS = ('flat', 'naive', 'hierarchical')


class ShardLayout(object):
    """The arrays of one ``named`` set, their owners and where each rank's
    share lies in the packed gradient buffer (elements of the wire) and in
    the flat parameter buffer (bytes)."""

    def __init__(self, layout, arrays_per_rank, itemsizes):
        self.layout = layout
        self.arrays_per_rank = list(arrays_per_rank)
        n = len(self.arrays_per_rank)
        #: Array indices of rank r's share: first[r] .. first[r + 1] - 1.
        self.first = [0]
        for k in self.arrays_per_rank:
            self.first.append(self.first[-1] + k)
        offs = layout.offsets
        #: Wire elements of each rank's share, and where it starts.
        self.starts = [offs[self.first[r]] for r in range(n)]
        self.counts = [offs[self.first[r + 1]] - offs[self.first[r]]
                       for r in range(n)]
        #: Bytes of each array, of each rank's share, and where it starts.
        self.nbytes = [s * i for s, i in zip(layout.sizes, itemsizes)]
        self.byte_offsets = [0]
        for b in self.nbytes:
            self.byte_offsets.append(self.byte_offsets[-1] + b)
        self.byte_starts = [self.byte_offsets[self.first[r]]
                            for r in range(n)]
        self.byte_counts = [self.byte_offsets[self.first[r + 1]]
                            - self.byte_starts[r] for r in range(n)]
        h = hashlib.blake2b(repr((layout.key, self.arrays_per_rank))
                            .encode(), digest_size=8)
        #: What every rank must agree on, as a 63-bit number.
        self.digest = int.from_bytes(h.digest(), 'little') >> 1
        self.grad_buffer = None   # GradBuffer, made at first use
        self.own_codec = None     # GPU: unpacks this rank's share
        self.device = {}          # pure_nccl's device buffers

    def own(self, rank):
        """Indices of the arrays ``rank`` owns."""
        return range(self.first[rank], self.first[rank + 1])

    def describe_difference(self, other):
        """A sentence naming how two ranks' layouts differ."""
        if self.layout.key != other.layout.key:
            return self.layout.first_difference(other.layout)
        return 'arrays per rank %s vs %s' % (self.arrays_per_rank,
                                             other.arrays_per_rank)


def _arguments_problem(named, arrays_per_rank, size):
    """What is wrong with the arguments on this rank (a sentence), or
    None."""
    try:
        counts = [int(k) for k in arrays_per_rank]
    except (TypeError, ValueError):
        return 'arrays_per_rank must be whole numbers, not %r' % (
            arrays_per_rank,)
    if len(counts) != size or any(k < 0 for k in counts):
        return ('arrays_per_rank must give one count >= 0 per rank (%d), '
                'not %r' % (size, counts))
    if sum(counts) != len(named):
        return ('arrays_per_rank adds up to %d arrays but %d were given'
                % (sum(counts), len(named)))
    return None


def _agree(comm, shards, problem):
    """Raise on every rank unless no rank has a problem and every rank has
    the same ``shards`` digest: one Allgather of two int64 per rank; the
    details are exchanged only when something is wrong."""
    mine = numpy.array([1 if problem else 0,
                        shards.digest if shards is not None else -1],
                       dtype=numpy.int64)
    everyone = numpy.empty((comm.size, 2), dtype=numpy.int64)
    comm.Allgather(mine, everyone)
    if not everyone[:, 0].any() and (everyone[:, 1] == everyone[0, 1]).all():
        return
    details = _mpi.allgather_obj(comm, (problem, shards))
    bad = ['rank %d: %s' % (r, p) for r, (p, _) in enumerate(details) if p]
    if bad:
        raise ValueError('sharded collective: bad arguments on %s'
                         % '; '.join(bad))
    other = next(r for r in range(comm.size)
                 if details[r][1].digest != details[0][1].digest)
    raise _mpi.LayoutMismatchError(
        'ranks would exchange shards that do not line up (rank 0 vs rank '
        '%d): %s. Every rank must pass the same arrays (names, shapes, '
        'dtypes), the same allreduce_grad_dtype and the same '
        'arrays_per_rank.' % (other, details[0][1].describe_difference(
            details[other][1])))


def _on_device(xp, named):
    """The context of the arrays' GPU (a no-op for numpy arrays)."""
    import contextlib
    if xp is numpy:
        return contextlib.nullcontext()
    from mnopt import _cuda
    return xp.cuda.Device(_cuda.device_id([a for _, a in named]))


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


class ShardedCollectives(object):
    """Needs what CommunicatorBase has: ``rank``, ``size``, ``name``,
    ``compression``, ``allreduce_grad_dtype``, ``_sync_group``,
    ``_pack_divisor``, ``_averaging_timed`` and the stall monitor."""

    def sharding_problem(self):
        """Why this communicator cannot run a sharded optimizer (a
        sentence), or None."""
        if self.compression == 'sign':
            return ("compression='sign' sends one bit per gradient element "
                    'and every rank decodes the whole vote; a sharded '
                    'optimizer needs each rank to receive the mean of its '
                    'share only (see docs/limits.md)')
        if self.name not in _HOST_TRANSPORTS + ('pure_nccl',):
            return ('the %r communicator has no sharded path: its servers '
                    'already hold the shards of the sum, and the updated '
                    'parameters would have to come back from them (see '
                    'docs/limits.md)' % (self.name,))
        return None

    def shard_buffer_nbytes(self):
        """Bytes of the buffers the sharded collectives keep on the
        synchronous path: the host scratch, and the packed gradients where
        they do not live in it (GPU, pure_nccl's device buffers)."""
        group = self._sync_group
        total = getattr(getattr(group, 'shard_scratch', None), 'nbytes', 0)
        for shards in getattr(group, 'shard_layouts', {}).values():
            buffer = shards.grad_buffer
            if buffer is not None and buffer.xp is not numpy:
                total += buffer.wire.nbytes
            total += sum(a.nbytes for a in shards.device.values()
                         if hasattr(a, 'nbytes'))
        return total

    # ------------------------------------------------------------ scratch
    def _shard_scratch(self, group, nbytes, xp):
        """``nbytes`` of the group's host byte buffer.  The two operations
        run one after the other on the group, so they share it: the packed
        gradients (numpy gradients are packed straight into it; GPU ones
        are staged through it), then the parameters' bytes.  One buffer of
        the larger size instead of two (pinned where a GPU copies to or
        from it)."""
        scratch = getattr(group, 'shard_scratch', None)
        if scratch is None or scratch.size < nbytes or (
                xp is not numpy and not grad_buffer.is_pinned_host(scratch)):
            group.shard_scratch = None   # the old one can go first
            scratch = group.shard_scratch = \
                numpy.empty(nbytes, numpy.uint8) if xp is numpy else \
                grad_buffer.pinned_host_empty(nbytes, numpy.uint8)
        return scratch[:nbytes]

    # ------------------------------------------------------------ layout
    def _shards(self, group, named, arrays_per_rank, wire):
        """The ShardLayout of ``named`` (kept on the group while the set
        and counts stay the same), after every rank agreed on it."""
        problem = _arguments_problem(named, arrays_per_rank, self.size)
        shards = None
        if problem is None:
            kept = getattr(group, 'shard_layouts', None)
            if kept is None:
                kept = group.shard_layouts = {}
            key = (tuple(n for n, _ in named),
                   tuple(a.shape for _, a in named),
                   tuple(a.dtype.name for _, a in named),
                   wire, tuple(int(k) for k in arrays_per_rank),
                   array_module([a for _, a in named]).__name__)
            shards = kept.get(key)
            if shards is None:
                try:
                    layout = grad_buffer.make_layout(named, wire) \
                        if wire != 'bytes' else grad_buffer.Layout(
                            [n for n, _ in named], [a.shape for _, a in named],
                            [a.dtype for _, a in named], 'bytes')
                except TypeError as e:
                    problem = str(e)
                else:
                    # Each holds buffers as large as the arrays (on a
                    # GPU, device memory): a few, not one per set ever
                    # seen (a model that grows leaves its old sets).
                    if len(kept) >= 4:
                        kept.clear()
                    shards = kept[key] = ShardLayout(
                        layout, arrays_per_rank,
                        [a.dtype.itemsize for _, a in named])
        _agree(group.comm, shards, problem)
        return shards

    def _array_module_or_problem(self, named):
        try:
            return array_module([a for _, a in named]), None
        except TypeError as e:
            return None, str(e)

    # ------------------------------------------------------------ gradients
    @watched('reduce_scatter_mean')
    def reduce_scatter_mean(self, named_grads, arrays_per_rank):
        """Give this rank the mean over all ranks of its share of
        ``named_grads`` (``[(name, array), ...]`` laid out by owner: see
        the module), in place: its arrays hold their mean on return, the
        other arrays are left as they were.

        The gradients travel in ``allreduce_grad_dtype`` (None: their
        own), each divided by the number of ranks as it is packed, and
        are summed in one reduce-scatter of the packed buffer."""
        named = list(named_grads)
        xp, problem = self._array_module_or_problem(named)
        if problem is not None:
            _agree(self._sync_group.comm, None, problem)
        with self._averaging_timed(), _on_device(xp, named):
            group = self._sync_group
            shards = self._shards(group, named, arrays_per_rank,
                                  self.allreduce_grad_dtype)
            if self.size == 1 and self.skip_single_rank:
                return  # the mean of one gradient is itself
            step, self.steps = self.steps, self.steps + 1
            counted = shards.layout.wire in ('float16', 'bfloat16') and \
                self._overflow.on_overflow != 'ignore'
            nonfinite = self._reduce_scatter_mean(
                group, shards, [a for _, a in named], xp, counted)
            if counted:
                self._check_shard_overflow(group, shards, nonfinite, step)

    def _check_shard_overflow(self, group, shards, nonfinite, step):
        """``on_overflow`` for the sharded averaging.  Each rank counted
        the non-finite gradients it packed (every array) and the
        non-finite means it unpacked (its share): one Allreduce (MAX) of a
        byte per array and direction gives every rank the same view, which
        the communicator's overflow reporter then judges as it judges an
        allreduce's (the same suspects on every rank, so its exchange
        cannot hang)."""
        nonfinite_in, nonfinite_out = nonfinite
        n = len(shards.layout.sizes)
        flags = numpy.zeros(2 * n, numpy.int8)
        flags[:n] = [bool(c) for c in nonfinite_in]
        flags[n:] = [bool(c) for c in nonfinite_out]
        group.comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
        self._overflow.check(_EveryRanksCounts(shards.layout, flags[:n],
                                               flags[n:]), group.comm, step)

    def _reduce_scatter_mean(self, group, shards, arrays, xp, counted):
        """Pack, reduce-scatter through host memory, unpack this rank's
        share; return (non-finite gradient values per array, non-finite
        means per array of this rank's share, 0 elsewhere) when
        ``counted`` (16-bit wires), else None.  ``pure_nccl`` overrides
        it."""
        buffer = shards.grad_buffer
        if buffer is None:
            # One contiguous packed buffer: no bucket cuts, nothing reduced
            # in place (the shares must be ranges of one buffer).
            buffer = shards.grad_buffer = grad_buffer.GradBuffer(
                shards.layout, xp, bucket_bytes=1 << 62)
        buffer.reset_counts()
        dtype = buffer.dtype
        host = self._shard_scratch(group, buffer.layout.total
                                   * dtype.itemsize, xp).view(dtype)
        if xp is numpy:
            buffer.swap_host(host)   # packed straight into the scratch
            buffer.pack(arrays, self._pack_divisor())
        else:
            buffer.pack(arrays, self._pack_divisor())
            buffer.wire.get(out=host)
        mine = self._reduce_scatter_host(group, shards, host)
        rank = self.rank
        lo = shards.starts[rank]
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
        from mnopt import _cuda
        own = list(shards.own(rank))
        if shards.own_codec is None:
            offs = shards.layout.offsets
            shards.own_codec = _cuda.Codec(
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

    def _reduce_scatter_host(self, group, shards, host):
        """Sum the host wire buffer ``host`` over the ranks, share by
        share; return this rank's share (a numpy array) of the sum."""
        wire = shards.layout.wire
        if self.name == 'naive':
            # The reference: MPI's own Reduce_scatter.
            mine = numpy.empty(shards.counts[self.rank], host.dtype)
            mpi_type, op = _mpi.wire_sum(wire)
            group.comm.Reduce_scatter([host, mpi_type], [mine, mpi_type],
                                      shards.counts, op=op)
            return mine
        if self.name == 'hierarchical':
            return _hierarchical_reduce_scatter(group, shards, host, wire,
                                                self.bucket_bytes)
        # Checked by _agree already: no second exchange.
        return ring.reduce_scatter_sum(group.comm, host, wire,
                                       shards.counts, check=False)

    # ------------------------------------------------------------ parameters
    @watched('allgather_params')
    def allgather_params(self, named_params, arrays_per_rank):
        """Give every rank every rank's share of ``named_params``
        (``[(name, array), ...]`` laid out by owner, as for
        ``reduce_scatter_mean``), in place: each array ends with its
        owner's bytes, on every rank."""
        named = list(named_params)
        xp, problem = self._array_module_or_problem(named)
        if problem is not None:
            _agree(self._sync_group.comm, None, problem)
        with _on_device(xp, named):
            group = self._sync_group
            shards = self._shards(group, named, arrays_per_rank, 'bytes')
            if self.size == 1:
                return
            self._allgather_params(group, shards, [a for _, a in named], xp)

    def _allgather_params(self, group, shards, arrays, xp):
        """Through a host byte buffer.  ``pure_nccl`` overrides it."""
        flat = self._shard_scratch(group, shards.byte_offsets[-1], xp)
        offs = shards.byte_offsets
        rank = self.rank
        for i in shards.own(rank):
            a = arrays[i]
            if xp is numpy:
                flat[offs[i]:offs[i + 1]] = _own_bytes(a)
            else:
                a.reshape(-1).view(numpy.uint8).get(
                    out=flat[offs[i]:offs[i + 1]])
        self._allgather_host(group, shards, flat)
        for r in range(self.size):
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

    def _allgather_host(self, group, shards, flat):
        """Fill the host byte buffer ``flat`` with every rank's share."""
        counts = shards.byte_counts
        if self.name == 'naive':
            group.comm.Allgatherv(MPI.IN_PLACE, [flat, (
                counts, shards.byte_starts), MPI.BYTE])
        elif self.name == 'hierarchical':
            _hierarchical_allgather(group, shards, flat, self.bucket_bytes)
        else:
            ring.allgather_into(group.comm, flat, counts, check=False)


# ------------------------------------------------------------ hierarchical

def _nodes(group):
    """(this node's index, the first rank of every node and one past the
    last): the ranks of a node must be consecutive, which every rank
    checks alike (so a bad placement is the same error everywhere)."""
    known = getattr(group, 'shard_nodes', None)
    if known is not None:
        return known
    node = group.intra.bcast(group.inter.rank if group.intra.rank == 0
                             else None, root=0)
    nodes = group.comm.allgather(node)
    bounds = [0] + [r for r in range(1, len(nodes))
                    if nodes[r] != nodes[r - 1]] + [len(nodes)]
    if sorted(set(nodes)) != list(range(len(bounds) - 1)) or any(
            nodes[r] < nodes[r - 1] for r in range(1, len(nodes))):
        raise ValueError(
            'hierarchical sharded collectives need the ranks of each node '
            'to be consecutive (ranks by node: %s); launch with block '
            'placement, or use the flat communicator' % nodes)
    group.shard_nodes = (node, bounds)
    return group.shard_nodes


def _pieces(array, nbytes):
    """``array`` cut into pieces of about ``nbytes``: MPI's shared-memory
    Reduce and Bcast are faster on bucket-sized pieces than on one large
    buffer (as the unsharded averaging's buckets)."""
    step = max(1, nbytes // array.itemsize)
    return [array[s:s + step] for s in range(0, array.size, step)]


def _hierarchical_reduce_scatter(group, shards, host, wire, bucket_bytes):
    """Reduce inside the node to its leader; the leaders reduce-scatter
    the nodes' ranges on the ring (only one copy per node crosses the
    links between nodes); each leader scatters its node's range to the
    node's ranks."""
    node, bounds = _nodes(group)
    ranks = range(bounds[node], bounds[node + 1])
    for piece in _pieces(host, bucket_bytes):
        _mpi.reduce_sum(group.intra, piece, wire, root=0)
    mpi_type, _ = _mpi.wire_sum(wire)
    node_counts = [sum(shards.counts[bounds[k]:bounds[k + 1]])
                   for k in range(len(bounds) - 1)]
    rank = group.comm.rank
    mine = numpy.empty(shards.counts[rank], host.dtype)
    if group.intra.rank == 0:
        chunk = ring.reduce_scatter_sum(group.inter, host, wire, node_counts,
                                        check=False)
        start = shards.starts[bounds[node]]
        counts = [shards.counts[r] for r in ranks]
        displs = [shards.starts[r] - start for r in ranks]
        group.intra.Scatterv([chunk, (counts, displs), mpi_type],
                             [mine, mpi_type], root=0)
    else:
        group.intra.Scatterv(None, [mine, mpi_type], root=0)
    return mine


def _hierarchical_allgather(group, shards, flat, bucket_bytes):
    """Gather each node's shares at its leader, all-gather the nodes'
    ranges among the leaders on the ring, broadcast inside the node."""
    node, bounds = _nodes(group)
    ranks = range(bounds[node], bounds[node + 1])
    rank = group.comm.rank
    lo = shards.byte_starts[rank]
    mine = flat[lo:lo + shards.byte_counts[rank]]
    start = shards.byte_starts[bounds[node]]
    if group.intra.rank == 0:
        counts = [shards.byte_counts[r] for r in ranks]
        displs = [shards.byte_starts[r] - start for r in ranks]
        node_range = flat[start:start + sum(counts)]
        group.intra.Gatherv(MPI.IN_PLACE, [node_range, (counts, displs),
                                           MPI.BYTE], root=0)
        node_counts = [sum(shards.byte_counts[bounds[k]:bounds[k + 1]])
                       for k in range(len(bounds) - 1)]
        ring.allgather_into(group.inter, flat, node_counts, check=False)
    else:
        group.intra.Gatherv([mine, MPI.BYTE], None, root=0)
    for piece in _pieces(flat, bucket_bytes):
        _mpi.bcast_bytes(group.intra, piece, root=0)
