"""The averaging pipeline: a gradient set packed, summed by the algorithm
and unpacked, in the caller or on the background thread; and the state
every averaging of a communicator shares (``Averaging``).

``AveragingPipeline`` is a communicator's ``mean_grads`` and
``mean_grads_async`` over its hooks: a subclass says how to sum a buffer
(``_sum``) and may override how groups are made, buffers cut, and votes
counted.  What the averagings share, the pipeline's and the sharded
collectives' alike, is an ``Averaging``: the communicator's public
``averaging``.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy
from mpi4py import MPI

from mnopt.codecs import grad_buffer
from mnopt.codecs import sign
from mnopt.timeline import step_stats
from mnopt.timeline import recorder as timelines
from mnopt.transport import agreement
from mnopt.transport import cpu_phases
from mnopt.transport import waiting
from mnopt.common.arrays import array_module
from mnopt.averaging.grad_pairs import named_pairs
from mnopt.averaging.background import caller_ready, on_side_stream
from mnopt.averaging.background import thread_setup
from mnopt.averaging.devices import device_of
from mnopt.averaging.group import Group
from mnopt.averaging.janitor import release_collected
from mnopt.averaging.mean_handle import MeanHandle
from mnopt.averaging.wires import Wires, current_wires
from mnopt.stall.monitor import watched


class Averaging(object):
    """What every averaging of one communicator shares: its groups and
    background thread (``resources``, a Resources), the averaging in
    flight, the averaging counter, the time spent (in all, and per step:
    ``stats``, a StepStats), the overflow reporter and the compression
    state (sign or low-rank).  Holds no reference to the
    communicator, so a dropped one is freed at once: ``make_group`` (its
    hook, which makes the background thread's group) is held weakly."""

    def __init__(self, mpi_comm, name, make_group, resources, reporter,
                 signs, low_rank=None):
        self._mpi_comm = mpi_comm
        self._name = name
        self._make_group = weakref.WeakMethod(make_group)
        self.resources = resources
        #: The overflow.Reporter of ``on_overflow``.
        self.overflow = reporter
        #: The SignCompression (compression='sign').
        self.signs = signs
        #: The PowerSGDCompression (compression='powersgd' or 'auto'),
        #: else None.
        self.low_rank = low_rank
        #: The MeanHandle of the last background operation started.
        self.in_flight = MeanHandle()
        #: Averagings so far (warm-up, and the votes' coin).
        self.steps = 0
        #: Seconds spent averaging (in the caller or in the background),
        #: all averagings so far.
        self.seconds = 0.0
        #: Where the averagings are recorded (the communicator's timeline).
        self.timeline = timelines.NULL
        #: The tuning of 'auto' settings (mnopt/averaging/tuning.py),
        #: set by the communicator: the values each averaging runs with.
        self.tuner = None
        #: The communication figures since they were last taken
        #: (mnopt/timeline/step_stats.py): kept whether or not there is a
        #: timeline.
        self.stats = step_stats.StepStats(mpi_comm.size)
        #: ZeRO's parameter all-gathers and the agreements so far (naming
        #: each in ``stats``).
        self.allgathers = self.agreements = 0
        self._lock = threading.Lock()
        #: (duplicate, request) of the background's MPI_Comm_idup while
        #: its wait is unfinished (``_duplicate``).
        self._pending_duplicate = None

    sync_group = property(lambda self: self.resources.sync_group)
    async_group = property(lambda self: self.resources.async_group)

    def groups(self):
        """The groups made so far: the synchronous one, the background's."""
        return [g for g in (self.sync_group, self.async_group)
                if g is not None]

    def label(self, group):
        """'sync' or 'async': which of the two ``group`` is."""
        return 'sync' if group is self.sync_group else 'async'

    def next_step(self):
        """This averaging's number; counts it."""
        step, self.steps = self.steps, self.steps + 1
        return step

    @contextlib.contextmanager
    def timed(self, where='caller'):
        """Count the time spent inside as time spent averaging, and in
        ``stats`` as ``where`` ('caller': the caller blocked on it,
        'background': on the background thread)."""
        start = step_stats.clock()
        try:
            with cpu_phases.phase('bookkeeping'):   # CPU the rest leaves
                yield
        finally:
            seconds = step_stats.clock() - start
            with self._lock:   # the caller's and the background's
                self.seconds += seconds
            self.stats.add_time(where, seconds)

    def where(self, group):
        """'background' for work on the background thread's group, else
        'caller'."""
        return 'background' if group is self.async_group and \
            group is not None else 'caller'

    def background(self):
        """The background thread, and the second MPI communicator its
        work uses, made at first use: one queue for every background
        operation (averaging, the sharded reduce-scatter)."""
        resources = self.resources
        if resources.executor is None:
            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                raise RuntimeError(
                    'asynchronous averaging needs MPI_THREAD_MULTIPLE; this '
                    'MPI was initialised with a lower thread level')
            resources.async_group = self._make_group()(self._duplicate())
            resources.executor = ThreadPoolExecutor(
                1, thread_name_prefix='mnopt-%s' % self._name,
                initializer=_setup_averaging_thread, initargs=(self.timeline,))
        return resources.executor

    def _duplicate(self):
        """A duplicate of the communicator for the background thread,
        made collectively, maybe long after this rank arrives: MPI's Dup
        would hold the caller without a look at Python's signals (Ctrl-C
        ignored) until the last rank arrives; an Idup is waited for
        between polls, and a wait an exception ended is taken up again at
        the next call (the other ranks' duplicate is this one)."""
        if self._pending_duplicate is None:
            self._pending_duplicate = self._mpi_comm.Idup()
        duplicate, request = self._pending_duplicate
        waiting.wait_all([request], pace=waiting.PATIENT)
        self._pending_duplicate = None
        return duplicate


def _setup_averaging_thread(timeline):
    thread_setup()
    timeline.name_thread('averaging')


class AveragingPipeline(object):
    """``mean_grads`` and ``mean_grads_async``.  Needs the host's public
    ``averaging`` (an Averaging), ``size``, ``allreduce_grad_dtype``,
    ``compression``, ``warmup_steps``, ``skip_single_rank``, ``vote``,
    ``vote_stats`` and ``bucket_bytes``, the stall settings of its
    agreements (``_stall_settings``) and the stall monitor ``watched``
    uses.  Subclasses implement ``_sum(buffer, group)``: sum the group's
    buffer in place across all ranks; optionally they override the other
    hooks below."""

    # ----------------------------------------------------------- hooks
    def _make_group(self, comm):
        return Group(comm)

    def _buffer_options(self):
        return {'bucket_bytes': self.bucket_bytes,
                'in_place_min_bytes': grad_buffer.DEFAULT_IN_PLACE_MIN_BYTES}

    def _tunes(self, name, buffer, group):
        """Whether averaging ``buffer`` on ``group`` uses the setting
        ``name`` (a tuning skips one that it does not); the same on every
        rank.  Subclasses say no where a setting goes unused."""
        return True

    def _tuning_exchange(self, group, seconds, op='tuning'):
        """agreement.quickest of a tuning's times over ``group``, in the
        timeline a 'wait' (``op``: 'tuning', or 'compression_guard' for
        compression='auto''s choices), the choice an instant."""
        with self.timeline.span('wait', 'comm', op=op,
                                comm=self.timeline_name):
            best, slowest = agreement.quickest(
                group.comm, seconds, "%s %s (every rank's times)"
                % (op.replace('_', ' '), self.name), **self._stall_settings)
        self.timeline.instant(op, 'comm', candidate=best, seconds=slowest)
        return best, slowest

    def _sum(self, buffer, group):
        raise NotImplementedError

    def _pack_divisor(self):
        """Gradients are divided by this while packed (the world size:
        divide before summing, so that only each gradient / N and the
        partial sums must fit the wire, not a sum of whole gradients)."""
        return self.size

    def _pack_sum_unpack(self, buffer, group, arrays, step=None):
        """Overridden by transports that pack and unpack piece by piece.
        ``step``: the averaging's number (the 'seq' of its 'wire' span)."""
        tl = self.timeline
        # Packing casts to the wire's dtype in the same pass: 'cast' where
        # that dtype differs from a gradient's, else 'pack' (looked at only
        # when recording; off, every span is one shared no-op).
        casts = tl and any(d != buffer.layout.wire
                           for d in buffer.layout.dtypes)
        # The thread's CPU, phase by phase (mnopt/transport/cpu_phases.py).
        with tl.span('cast' if casts else 'pack', 'comm', step=step,
                     bytes=buffer.nbytes), cpu_phases.phase('pack'):
            buffer.pack(arrays, self._pack_divisor())
        with self._wire_span(step, buffer.nbytes), cpu_phases.phase('wire'):
            self._sum(buffer, group)
        with tl.span('unpack', 'comm', step=step), \
                cpu_phases.phase('unpack'):
            buffer.unpack(arrays)

    def _wire_span(self, step, nbytes, op='allreduce'):
        """The 'wire' of averaging ``step`` (this rank's arrival until its
        result is in): timed for the per-step figures (``step_stats``,
        bytes by ``_traffic``), and 'wire' spans of the timeline when it
        is on (``Wires``: one, or one per bucket where the transport sums
        bucket by bucket)."""
        tl = self.timeline
        span = Wires(tl, self.averaging.stats, seq=step, op=op,
                     comm=self.timeline_name, bytes=nbytes) if tl \
            else tl.span('wire')
        return self.averaging.stats.wire_timer(
            span, (self.timeline_name, step), nbytes, op, self._traffic)

    def _bucket_wires(self):
        """The timeline's ``Wires`` of the collective this thread is in
        (a transport that sums bucket by bucket records one 'wire' per
        bucket with it: ``with wires.bucket(i, nbytes)``); None when the
        timeline is off: the transport then runs as it always does."""
        return current_wires() if self.timeline else None

    def _traffic(self, nbytes, op):
        """(bytes sent, bytes received) by this rank for a collective of
        ``nbytes`` of payload: a ring's, or a bandwidth-optimal MPI
        collective's (step_stats.traffic); the sign vote ('vote'): the
        bytes its algorithm says it sent (``vote_stats``), as many
        received (the scales' all-gather, 8 bytes per array and rank, is
        left out).  Overridden where the algorithm moves other amounts."""
        if op == 'vote':
            sent = self.vote_stats.get('bytes_sent', 0)
            return sent, sent
        return step_stats.traffic(op, nbytes, self.size)

    def _vote(self, group, bits, n_elements, step):
        """Element-wise majority of every rank's packed sign bits over the
        group's communicator: the counting ring (in rank order, which for
        ranks numbered node by node crosses each node's link once), or the
        all-to-all.  Says the bytes it sent in ``vote_stats``."""
        self.vote_stats = {}
        vote = sign.counting_ring_vote if self.vote == 'ring' \
            else sign.alltoall_vote
        return vote(group.comm, bits, n_elements, step, self.vote_stats)

    # ----------------------------------------------------------- gradients
    @watched('mean_grads')
    def mean_grads(self, named_grads: Iterable[tuple[str, Any]],
                   iteration: int | None = None) -> None:
        """Average ``[(name, array), ...]`` in place across all ranks.

        Arrays are matched across ranks by position; names, shapes and
        dtypes are checked to agree.  ``iteration``: the training
        iteration these gradients are of, which ``warmup_steps`` counts
        (default: each averaging is an iteration of its own); a caller
        that averages an iteration in pieces passes the same for each.
        """
        release_collected()
        self.timeline.begin_step(self.averaging)   # its window's step
        # The caller is blocked for all of it: exposed communication.
        with self.timeline.span('wait', 'comm'), \
                self.averaging.timed('caller'):
            self._mean(self.averaging.sync_group,
                       named_pairs(named_grads, 'mean_grads'), iteration)

    @watched('mean_grads_async')
    def mean_grads_async(self, named_grads: Iterable[tuple[str, Any]],
                         queue: bool = False,
                         iteration: int | None = None) -> MeanHandle:
        """Start averaging ``named_grads`` in place in the background.

        Returns a MeanHandle.  The arrays must not be touched until its
        ``wait()`` returns.  One averaging runs at a time: starting another
        waits for the previous one first, or with ``queue=True`` queues it
        behind (averagings run in the order they were started; wait for
        each handle to see its errors).  All ranks must call this (and
        ``mean_grads``) in the same order.  ``iteration``: as for
        ``mean_grads``.
        """
        release_collected()
        averaging = self.averaging
        named = named_pairs(named_grads, 'mean_grads_async')
        if not queue:
            averaging.in_flight.wait()
        self.timeline.begin_step(averaging)    # as mean_grads'
        executor = averaging.background()
        xp = array_module([a for _, a in named])
        device, ready = caller_ready(named, xp)
        averaging.in_flight = MeanHandle(executor.submit(
            self._mean_in_background, averaging.async_group, named, xp,
            device, ready, iteration), self.timeline, averaging.stats)
        return averaging.in_flight

    @watched('mean_grads_async.background')
    def _mean_in_background(self, group, named, xp, device, ready,
                            iteration):
        with self.averaging.timed('background'):
            self._mean_in_background_untimed(group, named, xp, device,
                                             ready, iteration)

    def _mean_in_background_untimed(self, group, named, xp, device, ready,
                                    iteration):
        on_side_stream(group, xp, device, ready, self._mean, group, named,
                       iteration)

    def _mean(self, group, named, iteration=None):
        xp = array_module([a for _, a in named])
        if xp is numpy:
            return self._mean_on_device(group, named, xp, iteration)
        # Kernels, buffers and NCCL calls go to the gradients' GPU, whatever
        # GPU is current.
        with xp.cuda.Device(device_of(named, xp)):
            return self._mean_on_device(group, named, xp, iteration)

    def _mean_on_device(self, group, named, xp, iteration=None):
        averaging = self.averaging
        # The ranks first wait for each other in the layout check: a late
        # rank's arrival is there, not at the wire.
        averaging.stats.arrive()
        step = averaging.next_step()
        # Warm-up counts iterations; the votes' coin, averagings.
        warm = step if iteration is None else iteration
        if averaging.comm_hook is not None:
            return averaging.comm_hook.mean(self, group, named, xp, step, iteration)
        if self.compression == 'sign' and warm >= self.warmup_steps:
            return averaging.signs.mean(group, averaging.label(group), named,
                                        xp, step, self._vote, self.timeline,
                                        self._wire_span)
        if averaging.low_rank is not None and warm >= self.warmup_steps:
            # PowerSGD: its Ps and Qs are averaged as any gradient set,
            # each averaging a number of its own (the timeline's 'seq').
            numbers = iter([step])

            def mean_of(pairs):
                number = next(numbers, None)
                if number is None:   # the Qs: arrives at another collective
                    averaging.stats.arrive()
                    number = averaging.next_step()
                self._plain_mean(group, pairs, xp, number)

            return averaging.low_rank.mean(
                averaging.label(group), named, xp, mean_of,
                lambda seconds: self._tuning_exchange(
                    group, seconds, 'compression_guard'))
        self._plain_mean(group, named, xp, step)

    def _plain_mean(self, group, named, xp, step):
        """The mean of ``named`` in place over ``group``: packed in the
        wire dtype, summed by the algorithm, unpacked."""
        averaging = self.averaging
        alone = self.size == 1 and self.skip_single_rank
        # 'auto' settings: while a group tunes, its averagings run with a
        # candidate (the tuner's current values, which the hooks read) and
        # are timed (mnopt/averaging/tuning.py).
        tuner = averaging.tuner
        ticket = tuner.begin(named, averaging.label(group))
        buffer = group.buffer_for(named, self.allreduce_grad_dtype, xp,
                                  **self._buffer_options())
        if alone:
            return  # the mean of one gradient is itself: nothing to move
        buffer.reset_counts()
        start = time.perf_counter()
        self._pack_sum_unpack(buffer, group, [a for _, a in named], step)
        if ticket is not None:
            tuner.end(ticket, time.perf_counter() - start,
                      lambda seconds: self._tuning_exchange(group, seconds),
                      lambda name: self._tunes(name, buffer, group))
        averaging.overflow.check(buffer, group.comm, step)
