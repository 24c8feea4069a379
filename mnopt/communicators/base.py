"""What every communicator shares; a subclass only says how to sum a buffer.

A communicator averages gradients through a *group*: a private duplicate of
the user's MPI communicator (plus whatever sub-communicators the algorithm
needs) and the persistent GradBuffer for the current gradient layout.  The
synchronous path and the asynchronous one (double buffering) each have their
own group, so two threads never share an MPI communicator.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy
from mpi4py import MPI

from mnopt import _env
from mnopt.transport import allreduce
from mnopt.transport import buffers
from mnopt.transport import layouts
from mnopt import _sched
from mnopt.transport import agreement
from mnopt import cores
from mnopt import grad_buffer
from mnopt import log
from mnopt import overflow
from mnopt.transport import ring
from mnopt import sign
from mnopt import stall
from mnopt.arrays import array_module, named_grads, to_host
from mnopt.communicators.background import caller_ready, on_side_stream
from mnopt.communicators.chainermn_collectives import ChainerMNCollectives
from mnopt.communicators.settings import SHARED_SETTINGS
from mnopt.communicators.settings import environment_settings
from mnopt.communicators.sharded import ShardedCollectives
from mnopt.stall import watched

if TYPE_CHECKING:
    import chainer
    from numpy.typing import DTypeLike


def node_split(comm):
    """(intra-node communicator, leaders communicator, node index, nodes).

    Nodes come from MPI's shared-memory split; ``MNOPT_RANKS_PER_NODE=k``
    overrides it (ranks 0..k-1 form node 0, ...) so tests can fake several
    nodes on one machine.  The leaders communicator joins the ranks with
    intra rank 0 (on other ranks it joins the ranks of equal intra rank and
    goes unused).
    """
    k = _env.whole_number('MNOPT_RANKS_PER_NODE', None, 1)
    if k:
        intra = comm.Split(comm.rank // k, comm.rank)
    else:
        intra = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    leaders = comm.Split(intra.rank, comm.rank)
    node, n_nodes = intra.bcast((leaders.rank, leaders.size), root=0)
    return intra, leaders, node, n_nodes


class _Group(object):
    """A private MPI communicator and the gradient buffer used over it."""

    def __init__(self, comm):
        self.comm = comm
        self.sign_codec = None  # compression='sign': the last one used
        self._buffers, self._sign_codecs = {}, {}
        self.subcomms = []  # algorithm-specific communicators, freed with it
        self.side_streams = {}  # GPU id -> stream of background averaging
        self.nccl = None  # pure_nccl: NCCL communicator, made at first sum

    #: Buffers (and sign codecs) kept per gradient set: the overlapped
    #: optimizer averages its buckets in turn, each with its own.
    MAX_KEPT = 256

    def _kept(self, kept, named, xp):
        key = (tuple(n for n, _ in named), xp.__name__,
               _device_of(named, xp))
        return key, kept.get(key)

    def _keep(self, kept, key, holder):
        if key not in kept and len(kept) >= self.MAX_KEPT:
            kept.clear()
        kept[key] = holder
        return holder

    def buffer_for(self, named, wire, xp, **buffer_options):
        """The GradBuffer for this gradient set; rebuilt when it changes
        (or moves to another device).

        The cross-rank layout check runs on every call (one 8-byte
        Allgather) and before any buffer is built, so a rank whose parameter
        set changed alone gets an error instead of a hang or a corrupted sum.
        """
        key, buffer = self._kept(self._buffers, named, xp)
        layout = self._checked_layout(named, wire, buffer)
        if buffer is None or buffer.layout is not layout:
            buffer = self._keep(self._buffers, key, grad_buffer.GradBuffer(
                layout, xp, **buffer_options))
        return buffer

    def sign_codec_for(self, named, xp, error_feedback):
        """The SignCodec (and its residuals) for this gradient set; rebuilt,
        residuals zeroed, when the set changes.  Checked as buffer_for."""
        key, codec = self._kept(self._sign_codecs, named, xp)
        layout = self._checked_layout(named, 'float32', codec)
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

    def _checked_layout(self, named, wire, holder):
        """``holder``'s layout (a buffer's or codec's) while it still fits
        ``named`` and ``wire``, else a new one; checked across ranks."""
        key = (tuple(n for n, _ in named), tuple(a.shape for _, a in named),
               tuple(a.dtype.name for _, a in named))
        if (holder is not None and holder.layout.key[:3] == key
                and (wire is None or holder.layout.wire == wire)):
            layout = holder.layout
        else:
            layout = grad_buffer.make_layout(named, wire)
        layouts.check_layouts(self.comm, layout)
        return layout

    def free(self):
        self.sign_codec = None
        self._buffers, self._sign_codecs = {}, {}
        if self.nccl is not None:
            self.nccl.destroy()
            self.nccl = None
        for c in self.subcomms + [self.comm]:
            if c != MPI.COMM_NULL:
                c.Free()
        self.subcomms = []
        self.comm = MPI.COMM_NULL


#: What garbage-collected communicators left to give back, released by
#: the janitor thread or at the next of mnopt's entry points
#: (release_collected), never in the collection itself: a collection runs
#: wherever an allocation triggers it, also inside an mpi4py call that
#: holds mpi4py's lock table (its pickling collectives allocate a lock
#: there), where freeing an MPI communicator on that same thread waits for
#: that lock for ever (seen at -n 2: a rank stuck in bcast -> gc ->
#: Comm.Free); and on the background thread.
_collected = collections.deque()
_collected_waiting = threading.Event()
_janitor = None
#: Where the janitor reports a release that failed (mnopt/log.py).
logger = log.get(__name__)


def release_after_collection(release):
    """A finalizer for ``weakref.finalize``: ``release()`` is called soon
    after, on another thread, not during the garbage collection."""
    _collected.append(release)
    _collected_waiting.set()


def release_collected():
    """Release what collected communicators left (``_collected``) on this
    thread; called where mnopt is not inside an MPI call (a communicator is
    made, averages or is finalized)."""
    while _collected:
        try:
            release = _collected.popleft()
        except IndexError:   # the janitor took the last one
            return
        try:
            release()
        except Exception:
            if MPI.Is_finalized():   # at exit, under the janitor
                return
            # As Python does for an error in a finalizer: said, not
            # raised into whatever call this entry point serves, and the
            # rest is still released.
            # (A record of logger mnopt.communicators.base, mnopt/log.py:
            # the message, then the traceback, as before on stderr.)
            logger.error('mnopt: releasing what a garbage-collected '
                         'communicator left failed (ignored):', exc_info=True)


def _janitor_run(waiting=_collected_waiting):
    # ``waiting`` is bound once, here: the janitor always waits on the
    # event the module made (a test swaps the module's to keep it asleep).
    while True:
        waiting.wait()
        waiting.clear()
        if MPI.Is_finalized():
            return
        release_collected()


def _start_janitor():
    """The thread that releases what collections left, as soon as they
    leave it: with MPI_THREAD_MULTIPLE only (else the entry points do)."""
    global _janitor
    if _janitor is not None or MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        return
    _janitor = threading.Thread(target=_janitor_run, name='mnopt-janitor',
                                daemon=True)
    _janitor.start()


def _background_thread_setup():
    """The background thread is latency-bound (mnopt/_sched.py): a short
    scheduler slice, and with it the ring's waits yield the core instead
    of napping (mnopt/transport/ring.py)."""
    ring.yield_while_waiting(_sched.prefer_low_latency())


class _Resources(object):
    """What a communicator must give back: its groups' MPI communicators,
    its monitor's, and its background thread.  Holds no reference to the
    communicator, so it can be released when the communicator is
    garbage-collected (communicators are local handles in MPI: freeing
    one on each rank at different times is sound)."""

    def __init__(self):
        self.sync_group = self.async_group = None
        self.executor = None
        self.monitor = None

    def release(self):
        """Free everything (once; later calls do nothing)."""
        executor, self.executor = self.executor, None
        if executor is not None:
            # Not from the executor's own thread (a collection may run
            # there): that thread is idle, it ends by itself.
            executor.shutdown(wait=not any(
                t is threading.current_thread()
                for t in getattr(executor, '_threads', ())))
        groups = (self.sync_group, self.async_group)
        self.sync_group = self.async_group = None
        if not MPI.Is_finalized():
            for group in groups:
                if group is not None:
                    group.free()
        monitor, self.monitor = self.monitor, None
        if monitor is not None:
            monitor.free()


def whole_argument(name, value, minimum):
    """``value`` as an int if it is a whole number >= ``minimum`` (not a
    bool, not a string), else a ValueError naming ``name``."""
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(
            value, (int, numpy.integer)) or value < minimum:
        raise ValueError('%s must be a whole number >= %d, not %r'
                         % (name, minimum, value))
    return int(value)


def _chainer_debug():
    """Whether Chainer is in use and in debug mode (``chainer.set_debug``);
    the core does not import Chainer for it."""
    import sys
    chainer = sys.modules.get('chainer')
    return chainer is not None and chainer.is_debug()


class MeanHandle(object):
    """An averaging in progress; ``wait()`` returns when it is done and
    raises any exception it ended with."""

    def __init__(self, future: Future[Any] | None = None) -> None:
        self._future = future

    def done(self) -> bool:
        future = self._future
        return future is None or future.done()

    def wait(self) -> None:
        # An exception is raised once, to the first caller that waits.
        future, self._future = self._future, None
        if future is not None:
            future.result()


def _device_of(named, xp):
    """The GPU holding the arrays of ``named``, None for numpy ones."""
    if xp is numpy:
        return None
    from mnopt import _cuda
    return _cuda.device_id([a for _, a in named])


class CommunicatorBase(ChainerMNCollectives, ShardedCollectives):
    """A data-parallel communicator (ChainerMN's API).

    Subclasses set ``name`` and implement ``_sum(buffer, group)``: sum the
    group's buffer in place across all ranks.  Optionally they override
    ``_make_group`` (extra sub-communicators) and ``_buffer_options``.
    """

    name = None
    _created = 0  # communicators made by this process: their labels

    @classmethod
    def check_arguments(cls, allreduce_grad_dtype: DTypeLike | None = None,
                        bucket_bytes: int =
                        grad_buffer.DEFAULT_BUCKET_BYTES,
                        compression: str | None = None,
                        error_feedback: bool = True, warmup_steps: int = 0,
                        vote: str | None = None,
                        stall_warning: float | None = None,
                        timeout: float | None = None,
                        on_overflow: str = 'warn', batched_copy: bool = True,
                        **options: Any) -> dict[str, Any]:
        """Raise ValueError/TypeError for arguments (and MNOPT_* settings)
        this communicator would refuse, without communicating: the
        factory checks them on every rank before any collective, so a bad
        setting is an error on every rank, never a hang.

        Returns the settings: every keyword argument, checked, normalized
        and with its default filled in.  A communicator keeps them
        (``settings``) and ``split`` makes its sub-communicators from
        exactly them.  Subclasses with options of their own check those,
        pass the rest up and add theirs to what comes back."""
        if options:
            raise TypeError('%s communicator: unknown option(s) %s'
                            % (cls.name, ', '.join(sorted(options))))
        compression = sign.normalize_compression(compression)
        settings = {
            'allreduce_grad_dtype': grad_buffer.normalize_wire_dtype(
                allreduce_grad_dtype),
            'bucket_bytes': whole_argument('bucket_bytes', bucket_bytes, 1),
            'compression': compression,
            'error_feedback': bool(error_feedback),
            'warmup_steps': whole_argument('warmup_steps', warmup_steps, 0),
            'vote': vote, 'stall_warning': stall_warning,
            'timeout': timeout, 'on_overflow': overflow.normalize(on_overflow),
            'batched_copy': bool(batched_copy)}
        if settings['warmup_steps'] and compression is None:
            raise ValueError("warmup_steps=%r only applies with "
                             "compression='sign' (it counts the averagings "
                             "before compression starts)" % (warmup_steps,))
        if vote is not None and compression is None:
            raise ValueError("vote=%r only applies with compression='sign'"
                             % (vote,))
        if compression is not None:  # None is the default vote, 'ring'
            settings['vote'] = sign.normalize_vote(vote)
        stall.settings(stall_warning, timeout)
        environment_settings()
        return settings

    @classmethod
    def shared_settings(cls, settings: dict[str, Any]) -> dict[str, Any]:
        """What every rank must share (SHARED_SETTINGS) of ``settings``
        (check_arguments' result), the kind and the environment; the
        start-up exchange compares them.  Unset ones are left out."""
        everything = dict(settings, communicator=cls.name,
                          **environment_settings())
        return {name: everything[name] for name in SHARED_SETTINGS
                if everything.get(name) is not None}

    def __init__(self, mpi_comm: MPI.Comm, **settings: Any) -> None:
        #: The keyword arguments it was made with, checked and normalized
        #: (check_arguments): a split is made from exactly these.
        self.settings = settings = self.check_arguments(**settings)
        release_collected()
        _start_janitor()
        self.mpi_comm = mpi_comm
        #: At one rank the mean of a gradient is itself, so averaging moves
        #: nothing.  False (or MNOPT_SINGLE_RANK_AVERAGING=1) runs the whole
        #: path anyway: pack, cast, sum, unpack, as N > 1 does; for
        #: benchmarks and tests on one GPU.
        self.skip_single_rank = not _env.flag('MNOPT_SINGLE_RANK_AVERAGING',
                                              False)
        self._overflow = overflow.Reporter(settings['on_overflow'])
        self._stall_settings = {'stall_warning': settings['stall_warning'],
                                'timeout': settings['timeout']}
        self.allreduce_grad_dtype = settings['allreduce_grad_dtype']
        self.compression = settings['compression']
        self.error_feedback = settings['error_feedback']
        self.warmup_steps = settings['warmup_steps']
        self.vote = sign.normalize_vote(settings['vote'])
        self.steps = 0  # averagings so far (warm-up, and the votes' coin)
        #: Residuals from a loaded snapshot ({('sync' or 'async', parameter
        #: names): numpy array}) kept until their codec is built.
        self._loaded_residuals = {}
        #: Seconds spent averaging (in the caller or in the background),
        #: all averagings so far: against the time a caller was blocked,
        #: what double buffering or overlap hid.
        self.averaging_seconds = 0.0
        self._averaging_lock = threading.Lock()
        #: Bytes this rank sent for its last vote (sign compression).
        self.vote_stats = {}
        self.bucket_bytes = settings['bucket_bytes']
        self.batched_copy = settings['batched_copy']  # ChainerMN's
        #: 'auto', 'ring' or 'mpi': $MNOPT_ALLREDUCE when it was made.
        self.allreduce_algorithm = allreduce.allreduce_algorithm()
        #: The MPI communicators and thread this communicator holds: freed
        #: by finalize(), or when the communicator is garbage-collected
        #: (MPI has a few thousand communicators per process).
        self._resources = _Resources()
        weakref.finalize(self, release_after_collection,
                         self._resources.release).atexit = False
        label = '%s#%d' % (self.name, CommunicatorBase._created)
        CommunicatorBase._created += 1
        self._monitor = self._make_monitor(mpi_comm, label,
                                           **self._stall_settings)
        cores.limit_blas_threads(buffers.ranks_on_node(mpi_comm))
        if self._owns_monitor():
            self._resources.monitor = self._monitor
        intra, leaders, node, n_nodes = node_split(mpi_comm)
        self._intra_rank, self._intra_size = intra.rank, intra.size
        self._inter_rank, self._inter_size = node, n_nodes
        intra.Free()
        leaders.Free()
        self._resources.sync_group = self._make_group(mpi_comm.Dup())
        self._in_flight = MeanHandle()

    # The resources, by their old names (subclasses read the groups).
    _sync_group = property(lambda self: self._resources.sync_group)
    _async_group = property(lambda self: self._resources.async_group)
    _executor = property(lambda self: self._resources.executor)

    # ----------------------------------------------------------- ranks
    @property
    def rank(self) -> int:
        return self.mpi_comm.rank

    @property
    def size(self) -> int:
        return self.mpi_comm.size

    @property
    def intra_rank(self) -> int:
        return self._intra_rank

    @property
    def intra_size(self) -> int:
        return self._intra_size

    @property
    def inter_rank(self) -> int:
        return self._inter_rank

    @property
    def inter_size(self) -> int:
        return self._inter_size

    def __deepcopy__(self, memo):
        # A communicator is a handle on MPI communicators, threads and
        # buffers shared with the other ranks: a deep copy of a model that
        # holds one (link.copy(mode='copy'), copy.deepcopy) talks to the
        # same ranks through the same communicator.
        return self

    def __copy__(self):
        return self

    def __repr__(self):
        return '<%s rank %d/%d, allreduce_grad_dtype=%s%s>' % (
            type(self).__name__, self.rank, self.size,
            self.allreduce_grad_dtype,
            ', compression=%s' % self.compression if self.compression
            else '')

    # ----------------------------------------------------------- config
    def set_config(self, name: str, value: Any = True,
                   **kwargs: Any) -> None:
        """ChainerMN's run-time settings, per communicator:
        ``'allreduce_grad_dtype'`` (a dtype, its name, or None; every rank
        must set the same, which the next averaging checks) and
        ``'batched_copy'`` (kept and reported as ChainerMN does; mnopt
        always packs in one batched pass, which gives the same bits)."""
        self.get_config(name)  # an unknown name raises
        value = kwargs.get('dtype', value)
        # Kept in ``settings`` too: a split takes what is in force now.
        if name == 'allreduce_grad_dtype':
            self.allreduce_grad_dtype = self.settings[name] = \
                grad_buffer.normalize_wire_dtype(value)
        else:
            self.batched_copy = self.settings[name] = bool(value)

    def get_config(self, name: str | None = None) -> Any:
        """The setting ``name`` (a numpy dtype, or the string 'bfloat16',
        or None), or all of them as a dict."""
        wire = self.allreduce_grad_dtype
        config = {'allreduce_grad_dtype': None if wire is None else
                  wire if wire == 'bfloat16' else numpy.dtype(wire),
                  'batched_copy': self.batched_copy}
        if name is None:
            return config
        if name not in config:
            raise ValueError('unknown config %r: allreduce_grad_dtype or '
                             'batched_copy' % (name,))
        return config[name]

    # ----------------------------------------------------------- hooks
    def _make_group(self, comm):
        return _Group(comm)

    def _make_monitor(self, mpi_comm, label, **settings):
        """The stall-detection Monitor of this communicator's operations
        (mnopt/stall.py)."""
        return stall.Monitor(mpi_comm, label, **settings)

    def _buffer_options(self):
        return {'bucket_bytes': self.bucket_bytes,
                'in_place_min_bytes': grad_buffer.DEFAULT_IN_PLACE_MIN_BYTES}

    def _sum(self, buffer, group):
        raise NotImplementedError

    def _pack_divisor(self):
        """Gradients are divided by this while packed (the world size:
        divide before summing, so that only each gradient / N and the
        partial sums must fit the wire, not a sum of whole gradients)."""
        return self.size

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
        with self._averaging_timed():
            self._mean(self._sync_group, list(named_grads), iteration)

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
        named = list(named_grads)
        if not queue:
            self._in_flight.wait()
        executor = self._background()
        xp = array_module([a for _, a in named])
        device, ready = caller_ready(named, xp)
        self._in_flight = MeanHandle(executor.submit(
            self._mean_in_background, self._async_group, named, xp, device,
            ready, iteration))
        return self._in_flight

    def _background(self):
        """The background thread, and the second MPI communicator its
        work uses, made at first use: one queue for every background
        operation (averaging, the sharded reduce-scatter)."""
        resources = self._resources
        if resources.executor is None:
            if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                raise RuntimeError(
                    'asynchronous averaging needs MPI_THREAD_MULTIPLE; this '
                    'MPI was initialised with a lower thread level')
            # Dup is collective: every rank reaches this at the same call.
            resources.async_group = self._make_group(self.mpi_comm.Dup())
            resources.executor = ThreadPoolExecutor(
                1, thread_name_prefix='mnopt-%s' % self.name,
                initializer=_background_thread_setup)
        return resources.executor

    @watched('mean_grads_async.background')
    def _mean_in_background(self, group, named, xp, device, ready,
                            iteration):
        with self._averaging_timed():
            self._mean_in_background_untimed(group, named, xp, device,
                                             ready, iteration)

    def _mean_in_background_untimed(self, group, named, xp, device, ready,
                                    iteration):
        on_side_stream(group, xp, device, ready, self._mean, group, named,
                       iteration)

    @contextlib.contextmanager
    def _averaging_timed(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            with self._averaging_lock:   # the caller's and the background's
                self.averaging_seconds += time.perf_counter() - start

    def _mean(self, group, named, iteration=None):
        xp = array_module([a for _, a in named])
        if xp is numpy:
            return self._mean_on_device(group, named, xp, iteration)
        # Kernels, buffers and NCCL calls go to the gradients' GPU, whatever
        # GPU is current.
        with xp.cuda.Device(_device_of(named, xp)):
            return self._mean_on_device(group, named, xp, iteration)

    def _mean_on_device(self, group, named, xp, iteration=None):
        step, self.steps = self.steps, self.steps + 1
        # Warm-up counts iterations; the votes' coin, averagings.
        warm = step if iteration is None else iteration
        if self.compression == 'sign' and warm >= self.warmup_steps:
            return self._mean_of_signs(group, named, xp, step)
        buffer = group.buffer_for(named, self.allreduce_grad_dtype, xp,
                                  **self._buffer_options())
        if self.size == 1 and self.skip_single_rank:
            return  # the mean of one gradient is itself: nothing to move
        buffer.reset_counts()
        self._pack_sum_unpack(buffer, group, [a for _, a in named])
        self._overflow.check(buffer, group.comm, step)

    def _mean_of_signs(self, group, named, xp, step):
        """The sign-compressed 'mean': majority vote times the mean scale
        (mnopt/sign.py).  Runs at N=1 too: one worker's vote is its sign."""
        codec = group.sign_codec_for(named, xp, self.error_feedback)
        if self._loaded_residuals:
            residual = self._loaded_residuals.pop(
                (self._group_label(group), tuple(n for n, _ in named)), None)
            if residual is not None and codec.residual is not None \
                    and residual.size == codec.total:
                codec.residual[...] = xp.asarray(residual)
        arrays = [a for _, a in named]
        bits, scales = codec.encode(arrays, step)
        bits = codec.bits_to_host(bits)
        scales = sign.mean_scales(group.comm, scales)
        self.vote_stats = {}
        majority = self._vote(group, bits, codec.total, step)
        codec.decode(codec.majority_to_device(majority), scales, arrays)

    def _group_label(self, group):
        return 'sync' if group is self._sync_group else 'async'

    def serialize_compression(self, serializer: chainer.AbstractSerializer,
                              shared: bool = True,
                              local: bool = True) -> None:
        """Save (a Chainer Serializer) or load (a Deserializer) the state
        of gradient compression, so that a run resumed from a snapshot
        continues bit for bit.  Nothing without ``compression='sign'``.
        Waits for a background averaging first.

        ``shared``: the averaging counter ``steps`` (warm-up, and the
        votes' coin), the same on every rank.  ``local``: with
        ``error_feedback``, this rank's residuals, one per gradient layout
        averaged (per bucket with overlap; those averaged in the
        background apart).  The multi-node optimizer's snapshot holds both;
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
        if self.compression != 'sign':
            return
        import chainer   # the Chainer layer's call
        self._in_flight.wait()
        if isinstance(serializer, chainer.serializer.Deserializer):
            self._load_compression(serializer, shared, local)
            return
        if shared:
            serializer('steps', numpy.int64(self.steps))
        if not local:
            return
        entries = dict(self._loaded_residuals)   # loaded, not yet used
        for group in self._groups():
            label = self._group_label(group)
            for names, residual in group.sign_residuals().items():
                entries[(label, names)] = numpy.array(to_host(residual),
                                                      numpy.float32)
        serializer('rank', numpy.int64(self.rank))
        serializer('size', numpy.int64(self.size))
        serializer('n_residuals', numpy.int64(len(entries)))
        for i, (label, names) in enumerate(sorted(entries)):
            serializer('group%d' % i, numpy.array(label))
            serializer('names%d' % i, numpy.array(names, dtype=str))
            serializer('residual%d' % i, entries[(label, names)])

    def _load_compression(self, serializer, shared, local):
        def read(key):   # None where absent (a strict one raises KeyError)
            try:
                return serializer(key, None)
            except KeyError:
                return None

        steps = read('steps') if shared else None
        if steps is not None:
            self.steps = int(steps)
        rank, size = (read('rank'), read('size')) if local else (None, None)
        if rank is None or size is None:
            return   # a snapshot without it: nothing changes
        loaded = {}
        if (int(rank), int(size)) != (self.rank, self.size):
            if self.error_feedback and int(serializer('n_residuals', None)):
                logger.warning(
                    'mnopt: warning: rank %d loaded the snapshot of rank %d '
                    'of %d: its sign compression residuals restart at zero, '
                    'so the resumed run is not the uninterrupted one bit for '
                    'bit (give each rank a replica set of its own for an '
                    'exact resume)', self.rank, int(rank), int(size))
        else:
            for i in range(int(serializer('n_residuals', None))):
                key = (str(serializer('group%d' % i, None)),
                       tuple(str(n) for n in serializer('names%d' % i, None)))
                loaded[key] = numpy.array(serializer('residual%d' % i, None),
                                          numpy.float32).reshape(-1)
        self._loaded_residuals = loaded
        for group in self._groups():
            group.forget_sign_codecs()

    def _groups(self):
        return [g for g in (self._sync_group, self._async_group)
                if g is not None]

    def _vote(self, group, bits, n_elements, step):
        """Element-wise majority of every rank's packed sign bits over the
        group's communicator: the counting ring (in rank order, which for
        ranks numbered node by node crosses each node's link once), or the
        all-to-all."""
        vote = sign.counting_ring_vote if self.vote == 'ring' \
            else sign.alltoall_vote
        return vote(group.comm, bits, n_elements, step, self.vote_stats)

    def _pack_sum_unpack(self, buffer, group, arrays):
        """Overridden by transports that pack and unpack piece by piece."""
        buffer.pack(arrays, self._pack_divisor())
        self._sum(buffer, group)
        buffer.unpack(arrays)

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
        comm = self._sync_group.comm
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

    # ----------------------------------------------------------- lifecycle
    def finalize(self) -> None:
        """Wait for background work and free this communicator's MPI
        resources.  Safe to call more than once."""
        try:
            self._in_flight.wait()
        finally:
            self._resources.release()
            release_collected()

    def _owns_monitor(self):
        """Whether the stall-detection Monitor is this communicator's own
        (freed with it), not shared with others."""
        return True

    # ----------------------------------------------------------- agreement
    # mnopt's own decisions that every rank must make alike (mnopt/
    # agreement.py), over mnopt's private duplicate of the user's
    # communicator: never in the user's message or tag space.  Watched
    # like every collective, so a rank that exited or finalized is seen
    # at once (one name for all four: ranks call them in the same order).
    @watched('agreement')
    def everyone(self, value: Any, what: str) -> list[Any]:
        """``[rank 0's value, rank 1's, ...]`` on every rank."""
        return agreement.everyone(self._sync_group.comm, value, what,
                                  **self._stall_settings)

    @watched('agreement')
    def raise_together(self, problem: BaseException | None,
                       what: str) -> None:
        """Raise on every rank if any rank's ``problem`` is an exception
        (agreement.raise_together)."""
        agreement.raise_together(self._sync_group.comm, problem, what,
                                 **self._stall_settings)

    @watched('agreement')
    def same(self, settings: dict[str, Any], what: str
             ) -> dict[str, Any]:
        """ValueError on every rank unless every rank's ``settings`` dict
        is equal, naming what differs (agreement.same)."""
        return agreement.same(self._sync_group.comm, settings, what,
                              **self._stall_settings)

    @watched('agreement')
    def common(self, items: Iterable[Any], what: str) -> list[Any]:
        """The items every rank holds, sorted (agreement.common)."""
        return agreement.common(self._sync_group.comm, items, what,
                                **self._stall_settings)

    # ----------------------------------------------------------- collectives
    @watched('split')
    def split(self, color: int, key: int) -> CommunicatorBase:
        """A communicator of the same kind over ``mpi_comm.Split``."""
        sub = self.mpi_comm.Split(color, key)
        # Every setting, from the one record of them: a new setting
        # cannot be forgotten here.
        return type(self)(sub, **self.settings)

    # ChainerMN's array and object collectives: chainermn_collectives.py.
