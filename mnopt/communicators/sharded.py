"""ZeRO's two collectives as communicator operations, mixed into every
communicator: ``reduce_scatter_mean`` (each rank ends with the mean of its
share of the gradients) and ``allgather_params`` (each rank's share of the
parameters to every rank).  mnopt/zero.py's sharded optimizer uses them;
docs/zero.md says what they cost.

Both take ``named`` arrays *laid out by owner* and ``arrays_per_rank``:
rank 0 owns the first ``arrays_per_rank[0]`` arrays, rank 1 the next
``arrays_per_rank[1]``, and so on (whole arrays: an update rule works on
whole parameters).  In that order the shares are contiguous ranges of
one buffer (the arrays one after another), so each operation is one
collective over it:

- gradients: each divided by the number of ranks (divide before summing,
  as ``mean_grads`` does), one reduce-scatter with per-rank counts, after
  which this rank's arrays hold their mean.  Where the transport takes a
  list of arrays (``shard_parts``: flat, hierarchical) and the gradients
  are numpy arrays of the wire's dtype (float32 or float64, no cast), they
  are divided and summed where they are, the arrays themselves the parts
  of the buffer: no copy, no scratch; the other ranks' arrays are left
  holding partial sums.  Otherwise (a 16-bit or wider wire, GPU arrays,
  naive) they are packed into the wire dtype in a host scratch, and only
  this rank's range is cast back into its own arrays;
- parameters: one all-gather of the arrays' raw bytes, every rank's range
  filled with its owner's bytes (replicas stay identical): on numpy arrays
  where they are (``shard_parts``), else through a flat byte buffer.

The transport is the communicator's, two methods it overrides
(``_shard_reduce_scatter``, ``_shard_allgather``): ``flat`` runs mnopt's
pipelined ring (mnopt/transport/ring.py's ``*_parts``), ``hierarchical`` reduces
inside each node, runs the ring among the node leaders over the nodes'
ranges and sends each rank of the node its range (gathers, ring,
broadcast for the parameters), ``naive`` (the reference) MPI's
Reduce_scatter and Allgatherv on one packed buffer.  ``pure_nccl``
overrides the device-side methods instead: NCCL's reduceScatter and
allGather (mnopt/communicators/pure_nccl.py).  GPU arrays are staged
through pinned host memory except on ``pure_nccl``.

Every call first checks, in one 16-byte Allgather, that every rank passes
the same layout (names, shapes, dtypes, wire dtype) and the same
``arrays_per_rank``, and that no rank found its arguments bad: otherwise
the same error is raised on every rank, never a hang.  Both operations are
stall-watched like every other communicator operation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy
from mpi4py import MPI

from mnopt.transport import layouts
from mnopt.transport import agreement
from mnopt import grad_buffer
from mnopt.arrays import array_module
from mnopt.communicators.background import caller_ready, on_side_stream
from mnopt.stall import watched

if TYPE_CHECKING:
    from mnopt.communicators.base import MeanHandle


def _mean_handle(future):
    from mnopt.communicators.base import MeanHandle
    return MeanHandle(future)

#: Wires on which numpy gradients of that dtype are summed where they are.
_IN_PLACE_WIRES = ('float32', 'float64')


def _views(parts, lo, hi):
    """Views of ``parts`` covering range [lo, hi) of their concatenation
    (empty views left out)."""
    out, start = [], 0
    for part in parts:
        stop = start + part.size
        a, b = max(lo, start), min(hi, stop)
        if a < b:
            out.append(part[a - start:b - start])
        start = stop
    return out


class ShardLayout(object):
    """The arrays of one ``named`` set, their owners and where each rank's
    share lies in the packed gradient buffer (elements of the wire) and in
    the flat parameter buffer (bytes)."""

    def __init__(self, layout, arrays_per_rank, itemsizes, in_place=False):
        self.layout = layout
        #: Whether the collectives work on the arrays where they are (a
        #: list of parts) rather than on a packed copy: every rank must
        #: agree, the messages are cut differently.
        self.in_place = bool(in_place)
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
        h = hashlib.blake2b(repr((layout.key, self.arrays_per_rank,
                                  self.in_place)).encode(), digest_size=8)
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
        if self.in_place != other.in_place:
            return ('the arrays are reduced in place on one rank and '
                    'packed on the other (numpy arrays on one, GPU arrays '
                    'on the other?)')
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
    details = agreement.everyone(comm, (problem, shards),
                                 'the sharded collective\'s check')
    bad = ['rank %d: %s' % (r, p) for r, (p, _) in enumerate(details) if p]
    if bad:
        raise ValueError('sharded collective: bad arguments on %s'
                         % '; '.join(bad))
    other = next(r for r in range(comm.size)
                 if details[r][1].digest != details[0][1].digest)
    raise layouts.LayoutMismatchError(
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
    ``_pack_divisor``, ``_averaging_timed`` and the stall monitor.

    A communicator gives itself a sharded path by overriding the two
    transports, ``_shard_reduce_scatter`` and ``_shard_allgather`` (host
    memory: flat, hierarchical, naive), or the whole device-side methods
    ``_reduce_scatter_mean`` and ``_allgather_params`` (pure_nccl); the
    layout, the checks, the packing, the overflow flags and the staging of
    GPU arrays are here.  ``shard_parts``: whether its transports take a
    list of arrays (then numpy arrays are reduced and gathered where they
    are, with no scratch) or one contiguous buffer only."""

    #: Whether ``_shard_reduce_scatter``/``_shard_allgather`` take any
    #: list of parts; False: one contiguous buffer (the packed copy).
    shard_parts = False

    def sharding_problem(self) -> str | None:
        """Why this communicator cannot run a sharded optimizer (a
        sentence), or None."""
        if self.compression == 'sign':
            return ("compression='sign' sends one bit per gradient element "
                    'and every rank decodes the whole vote; a sharded '
                    'optimizer needs each rank to receive the mean of its '
                    'share only (see docs/limits.md)')
        cls = type(self)
        if cls._shard_reduce_scatter is \
                ShardedCollectives._shard_reduce_scatter and \
                cls._reduce_scatter_mean is \
                ShardedCollectives._reduce_scatter_mean:
            return ('the %r communicator has no sharded path: its servers '
                    'already hold the shards of the sum, and the updated '
                    'parameters would have to come back from them (see '
                    'docs/limits.md)' % (self.name,))
        return None

    # ------------------------------------------------------------ transports
    def _shard_reduce_scatter(self, group, shards, parts):
        """Sum over the ranks the wire buffer that ``parts`` (contiguous
        1-D numpy arrays of the wire's storage dtype) make one after
        another, so that this rank's range of it (``shards.starts[rank]``,
        ``shards.counts[rank]`` elements) holds its sum; the rest may be
        left anything.  ``parts`` is one array (the packed buffer) unless
        ``shard_parts``.  Every rank passes parts of the same sizes."""
        raise NotImplementedError('%s has no sharded path' % self.name)

    def _shard_allgather(self, group, shards, parts):
        """Fill the byte buffer that ``parts`` (contiguous 1-D uint8
        arrays) make one after another with every rank's range of it
        (``shards.byte_starts``/``byte_counts``); on entry this rank's
        range holds its share."""
        raise NotImplementedError('%s has no sharded path' % self.name)

    def shard_buffer_nbytes(self) -> int:
        """Bytes of the buffers the sharded collectives keep on the
        synchronous path: the host scratch (none where the arrays are
        reduced and gathered in place), and the packed gradients where
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
        """``nbytes`` of the group's host byte buffer, for what is not
        done in place.  The two operations run one after the other on the
        group, so they share it: the packed gradients (numpy gradients are
        packed straight into it; GPU ones are staged through it), then the
        parameters' bytes.  One buffer of the larger size instead of two
        (pinned where a GPU copies to or from it)."""
        scratch = getattr(group, 'shard_scratch', None)
        if scratch is None or scratch.size < nbytes or (
                xp is not numpy and not grad_buffer.is_pinned_host(scratch)):
            group.shard_scratch = None   # the old one can go first
            scratch = group.shard_scratch = \
                numpy.empty(nbytes, numpy.uint8) if xp is numpy else \
                grad_buffer.pinned_host_empty(nbytes, numpy.uint8)
        return scratch[:nbytes]

    # ------------------------------------------------------------ layout
    def _in_place(self, layout, xp):
        """Whether arrays of ``layout`` are reduced (gradients) or
        gathered (parameters, wire 'bytes') where they are: numpy arrays
        on a transport that takes parts, gradients only where their dtype
        is a float32/float64 wire (no cast, no overflow to count)."""
        if not self.shard_parts or xp is not numpy:
            return False
        if layout.wire == 'bytes':
            return True
        return layout.wire in _IN_PLACE_WIRES and all(
            numpy.dtype(d) == numpy.dtype(layout.wire)
            for d in layout.dtypes)

    def _shards(self, group, named, arrays_per_rank, wire):
        """The ShardLayout of ``named`` (kept on the group while the set
        and counts stay the same), after every rank agreed on it."""
        problem = _arguments_problem(named, arrays_per_rank, self.size)
        shards = None
        if problem is None:
            kept = getattr(group, 'shard_layouts', None)
            if kept is None:
                kept = group.shard_layouts = {}
            xp = array_module([a for _, a in named])
            key = (tuple(n for n, _ in named),
                   tuple(a.shape for _, a in named),
                   tuple(a.dtype.name for _, a in named),
                   wire, tuple(int(k) for k in arrays_per_rank),
                   xp.__name__)
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
                        [a.dtype.itemsize for _, a in named],
                        self._in_place(layout, xp))
        _agree(group.comm, shards, problem)
        return shards

    def _array_module_or_problem(self, named):
        try:
            return array_module([a for _, a in named]), None
        except TypeError as e:
            return None, str(e)

    # ------------------------------------------------------------ gradients
    @watched('reduce_scatter_mean')
    def reduce_scatter_mean(self, named_grads: Iterable[tuple[str, Any]],
                            arrays_per_rank: Sequence[int]) -> None:
        """Give this rank the mean over all ranks of its share of
        ``named_grads`` (``[(name, array), ...]`` laid out by owner: see
        the module), in place: its arrays hold their mean on return.  The
        other arrays may be left holding partial sums (where they are
        summed in place): they are not this rank's to read.

        The gradients travel in ``allreduce_grad_dtype`` (None: their
        own), each divided by the number of ranks first, and are summed in
        one reduce-scatter: where they are (numpy gradients whose dtype is
        the wire, on flat and hierarchical), else of a packed copy."""
        self._reduce_scatter_mean_on(self._sync_group, list(named_grads),
                                     arrays_per_rank)

    @watched('reduce_scatter_mean_async')
    def reduce_scatter_mean_async(
            self, named_grads: Iterable[tuple[str, Any]],
            arrays_per_rank: Sequence[int]) -> MeanHandle:
        """``reduce_scatter_mean`` in the background (ZeRO stage 2: a
        bucket of gradients as backward finishes it), queued behind every
        averaging already started (``mean_grads_async(queue=True)``'s
        thread and MPI communicator).  Returns a MeanHandle; the arrays
        must not be touched until its ``wait()`` returns.  The background
        holds them only until the reduce-scatter is done: an array the
        caller no longer holds (another rank's share) is freed then, while
        backward goes on.  Every rank must start the same ones in the same
        order; a rank whose arrays differ gets an error, as do the
        others (the layout check), never a hang."""
        named = list(named_grads)
        executor = self._background()
        xp, problem = self._array_module_or_problem(named)
        device = ready = None
        if problem is None:
            device, ready = caller_ready(named, xp)
        handle = self._in_flight = _mean_handle(executor.submit(
            self._reduce_scatter_in_background, named, arrays_per_rank, xp,
            problem, device, ready))
        del named   # the background's reference is the only one left here
        return handle

    @watched('reduce_scatter_mean_async.background')
    def _reduce_scatter_in_background(self, named, arrays_per_rank, xp,
                                      problem, device, ready):
        group = self._async_group
        if problem is not None:
            _agree(group.comm, None, problem)
        return on_side_stream(group, xp, device, ready,
                              self._reduce_scatter_mean_on, group, named,
                              arrays_per_rank)

    def _reduce_scatter_mean_on(self, group, named, arrays_per_rank):
        xp, problem = self._array_module_or_problem(named)
        if problem is not None:
            _agree(group.comm, None, problem)
        with self._averaging_timed(), _on_device(xp, named):
            shards = self._shards(group, named, arrays_per_rank,
                                  self.allreduce_grad_dtype)
            if self.size == 1 and self.skip_single_rank:
                return  # the mean of one gradient is itself
            step, self.steps = self.steps, self.steps + 1
            counted = shards.layout.wire in ('float16', 'bfloat16') and \
                self._overflow.on_overflow != 'ignore'
            arrays = [a for _, a in named]
            if shards.in_place:
                self._reduce_scatter_in_place(group, shards, arrays)
                return
            nonfinite = self._reduce_scatter_mean(group, shards, arrays, xp,
                                                  counted)
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

    def _reduce_scatter_in_place(self, group, shards, arrays):
        """numpy gradients in the wire's dtype: each divided by the
        number of ranks where it is (the packing's division: the same
        bits), then one reduce-scatter over the arrays as parts.  A
        non-contiguous gradient is summed in a contiguous stand-in, copied
        back where it is this rank's."""
        divisor = self._pack_divisor()
        parts, stand_in = [], {}
        for i, a in enumerate(arrays):
            if a.flags.c_contiguous:
                flat = a.reshape(-1)
            else:
                flat = stand_in[i] = numpy.ascontiguousarray(a).reshape(-1)
            numpy.divide(flat, divisor, out=flat)
            parts.append(flat)
        self._shard_reduce_scatter(group, shards, parts)
        for i in shards.own(self.rank):
            if i in stand_in:
                arrays[i][...] = stand_in[i].reshape(arrays[i].shape)

    def _reduce_scatter_mean(self, group, shards, arrays, xp, counted):
        """Pack into the host scratch (a cast, or a transport that takes
        one buffer), reduce-scatter it, unpack this rank's share; return
        (non-finite gradient values per array, non-finite means per array
        of this rank's share, 0 elsewhere) when ``counted`` (16-bit
        wires), else None.  ``pure_nccl`` overrides it."""
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
        self._shard_reduce_scatter(group, shards, [host])
        rank = self.rank
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

    # ------------------------------------------------------------ parameters
    @watched('allgather_params')
    def allgather_params(self, named_params: Iterable[tuple[str, Any]],
                         arrays_per_rank: Sequence[int]) -> None:
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
            arrays = [a for _, a in named]
            if shards.in_place:
                self._allgather_in_place(group, shards, arrays)
            else:
                self._allgather_params(group, shards, arrays, xp)

    def _allgather_in_place(self, group, shards, arrays):
        """numpy parameters, each array's bytes a part (a non-contiguous
        one through a contiguous stand-in)."""
        parts, stand_in = [], {}
        for i, a in enumerate(arrays):
            if not a.flags.c_contiguous:
                a = stand_in[i] = numpy.ascontiguousarray(a)
            parts.append(a.reshape(-1).view(numpy.uint8))
        self._shard_allgather(group, shards, parts)
        own = set(shards.own(self.rank))
        for i, a in stand_in.items():
            if i not in own:
                arrays[i][...] = a

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
        self._shard_allgather(group, shards, [flat])
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
