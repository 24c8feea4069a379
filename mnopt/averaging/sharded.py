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
the same error is raised on every rank, never a hang
(mnopt/averaging/shard_layout.py).  Both operations are stall-watched
like every other communicator operation.  The packed path is
mnopt/averaging/shard_staging.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy

from mnopt.codecs import grad_buffer
from mnopt.common.arrays import array_module
from mnopt.averaging.wires import Wires
from mnopt.averaging.background import caller_ready, on_side_stream
from mnopt.averaging.devices import on_device
from mnopt.averaging.mean_handle import MeanHandle
from mnopt.averaging.shard_layout import ShardLayout, agree
from mnopt.averaging.shard_layout import arguments_problem
from mnopt.averaging.shard_staging import ShardState
from mnopt.averaging.shard_staging import allgather_packed
from mnopt.averaging.shard_staging import check_overflow
from mnopt.averaging.shard_staging import reduce_scatter_packed
from mnopt.stall.monitor import watched

#: Wires on which numpy gradients of that dtype are summed where they are.
_IN_PLACE_WIRES = ('float32', 'float64')


class ShardedCollectives(object):
    """Needs the host's public ``rank``, ``size``, ``name``,
    ``compression``, ``allreduce_grad_dtype``, ``skip_single_rank`` and
    ``averaging`` (an Averaging: the groups, the background thread, the
    operation in flight, the averaging counter, the time spent and the
    overflow reporter), ``timeline_name``, the hooks ``_wire_span`` and
    ``_traffic`` (AveragingPipeline's), and the stall monitor ``watched``
    uses.

    A communicator gives itself a sharded path by overriding the two
    transports, ``_shard_reduce_scatter`` and ``_shard_allgather`` (host
    memory: flat, hierarchical, naive), or the whole device-side methods
    ``_reduce_scatter_mean`` and ``_allgather_params`` (pure_nccl); the
    layout, the checks, the packing, the overflow flags and the staging of
    GPU arrays are here.  ``shard_parts``: whether its transports take a
    list of arrays (then numpy arrays are reduced and gathered where they
    are, with no scratch) or one contiguous buffer only.  Gradients are
    divided by the number of ranks (``size``) before they are summed."""

    #: Whether ``_shard_reduce_scatter``/``_shard_allgather`` take any
    #: list of parts; False: one contiguous buffer (the packed copy).
    shard_parts = False

    def sharding_problem(self) -> str | None:
        """Why this communicator cannot run a sharded optimizer (a
        sentence), or None."""
        if self.averaging.comm_hook is not None:
            return ('a comm hook averages whole buckets; a sharded '
                    'optimizer reduce-scatters, so that each rank receives '
                    'the mean of its share only: register the hook without '
                    'shard_state, or take it away (hook=None) first')
        if self.compression == 'sign':
            return ("compression='sign' sends one bit per gradient element "
                    'and every rank decodes the whole vote; a sharded '
                    'optimizer needs each rank to receive the mean of its '
                    'share only (see docs/limits.md)')
        if self.compression in ('powersgd', 'auto'):
            return ('compression=%r sends low-rank factors of whole '
                    'gradient matrices, from which every rank rebuilds the '
                    'whole mean; a sharded optimizer reduce-scatters, so '
                    'that each rank receives the mean of its share only '
                    '(see docs/limits.md)' % (self.compression,))
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
        state = self.averaging.sync_group.sharded
        if state is None:
            return 0
        total = getattr(state.scratch, 'nbytes', 0)
        for shards in state.layouts.values():
            buffer = shards.grad_buffer
            if buffer is not None and buffer.xp is not numpy:
                total += buffer.wire.nbytes
            total += sum(a.nbytes for a in shards.device.values()
                         if hasattr(a, 'nbytes'))
        return total

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
        problem = arguments_problem(named, arrays_per_rank, self.size)
        shards = None
        if problem is None:
            state = group.sharded
            if state is None:
                state = group.sharded = ShardState()
            kept = state.layouts
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
        agree(group.comm, shards, problem)
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
        self._reduce_scatter_mean_on(self.averaging.sync_group,
                                     list(named_grads), arrays_per_rank)

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
        averaging = self.averaging
        executor = averaging.background()
        xp, problem = self._array_module_or_problem(named)
        device = ready = None
        if problem is None:
            device, ready = caller_ready(named, xp)
        handle = averaging.in_flight = MeanHandle(executor.submit(
            self._reduce_scatter_in_background, named, arrays_per_rank, xp,
            problem, device, ready), self.timeline, averaging.stats)
        del named   # the background's reference is the only one left here
        return handle

    @watched('reduce_scatter_mean_async.background')
    def _reduce_scatter_in_background(self, named, arrays_per_rank, xp,
                                      problem, device, ready):
        group = self.averaging.async_group
        if problem is not None:
            agree(group.comm, None, problem)
        return on_side_stream(group, xp, device, ready,
                              self._reduce_scatter_mean_on, group, named,
                              arrays_per_rank)

    def _reduce_scatter_mean_on(self, group, named, arrays_per_rank):
        xp, problem = self._array_module_or_problem(named)
        if problem is not None:
            agree(group.comm, None, problem)
        averaging = self.averaging
        with averaging.timed(averaging.where(group)), on_device(xp, named):
            averaging.stats.arrive()
            shards = self._shards(group, named, arrays_per_rank,
                                  self.allreduce_grad_dtype)
            if self.size == 1 and self.skip_single_rank:
                return  # the mean of one gradient is itself
            step = averaging.next_step()
            counted = shards.layout.wire in ('float16', 'bfloat16') and \
                averaging.overflow.on_overflow != 'ignore'
            arrays = [a for _, a in named]
            with self._wire_span(step, sum(shards.byte_counts),
                                 'reduce_scatter'):
                if shards.in_place:
                    self._reduce_scatter_in_place(group, shards, arrays)
                    return
                nonfinite = self._reduce_scatter_mean(group, shards, arrays,
                                                      xp, counted)
            if counted:
                check_overflow(group, shards, nonfinite, step,
                               averaging.overflow)

    def _reduce_scatter_in_place(self, group, shards, arrays):
        """numpy gradients in the wire's dtype: each divided by the
        number of ranks where it is (the packing's division: the same
        bits), then one reduce-scatter over the arrays as parts.  A
        non-contiguous gradient is summed in a contiguous stand-in, copied
        back where it is this rank's."""
        divisor = self.size
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
        """Through the packed host scratch (shard_staging.py): the
        non-finite counts when ``counted``, else None.  ``pure_nccl``
        overrides it."""
        return reduce_scatter_packed(group, shards, arrays, xp, counted,
                                     self.rank, self.size,
                                     self._shard_reduce_scatter)

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
        stats = self.averaging.stats
        group = self.averaging.sync_group
        if problem is not None:
            agree(group.comm, None, problem)
        # The caller is blocked for all of it (exposed).  Its 'wire'
        # carries no seq (that is the averaging counter, which snapshots
        # keep: an all-gather counted in it would change what they hold)
        # but its own count, 'gather', as the per-step figures name it.
        with stats.timed('caller'), on_device(xp, named):
            stats.arrive()
            shards = self._shards(group, named, arrays_per_rank, 'bytes')
            if self.size == 1:
                return
            arrays = [a for _, a in named]
            self.averaging.allgathers += 1
            nbytes, tl = sum(shards.byte_counts), self.timeline
            span = Wires(tl, stats, gather=self.averaging.allgathers,
                         op='allgather', comm=self.timeline_name,
                         bytes=nbytes) if tl else tl.span('wire')
            with stats.wire_timer(
                    span, (self.timeline_name, 'allgather',
                           self.averaging.allgathers),
                    nbytes, 'allgather', self._traffic):
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
        """Through a host byte buffer (shard_staging.py).  ``pure_nccl``
        overrides it."""
        allgather_packed(group, shards, arrays, xp, self.rank, self.size,
                         self._shard_allgather)
