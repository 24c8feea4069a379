"""MpiCommunicatorBase: what every communicator shares, on MPI, put
together from the modules beside it; a subclass only says how to sum a
buffer.

The parts, one idea each: the interface (communicator_base.py), the
averaging pipeline and its state (averaging.py), sign compression
(compression.py), the sharded collectives (sharded.py), ChainerMN's array
and object collectives (chainermn_collectives.py), the Chainer glue
(chainer_glue.py), the groups (group.py), what a communicator gives back
and the janitor that gives it back after a garbage collection
(resources.py, janitor.py).  Here: making a communicator, its ranks and
configuration, its agreement methods, ``split`` and ``finalize``.

``CommunicatorBase`` and ``MeanHandle`` are importable from here, as they
always were.
"""

from __future__ import annotations

import collections
import hashlib
import weakref
from collections.abc import Iterable
from typing import Any

import numpy
from mpi4py import MPI

from mnopt.common import _env
from mnopt.transport import allreduce, buffers
from mnopt.transport import agreement
from mnopt.transport import collective_check
from mnopt.common import cores
from mnopt.codecs import grad_buffer
from mnopt.codecs import overflow
from mnopt.codecs import sign
from mnopt.stall import monitor as stall
from mnopt.timeline import step_stats
from mnopt.timeline import recorder as timelines
from mnopt.averaging.pipeline import Averaging, AveragingPipeline
from mnopt.communicators.chainer_glue import ChainerGlue
from mnopt.communicators.chainermn_collectives import ChainerMNCollectives
from mnopt.communicators.communicator_base import CommunicatorBase
from mnopt.averaging.compression import SignCompression
from mnopt.communicators.registered_hook import CommHookRegistration
from mnopt.averaging.low_rank import PowerSGDCompression
from mnopt.averaging.janitor import release_after_collection
from mnopt.averaging.janitor import release_collected, start_janitor
from mnopt.averaging.mean_handle import MeanHandle
from mnopt.communicators.node_split import node_split
from mnopt.communicators.resources import Resources
from mnopt.communicators.resources import hold_timeline, let_go_of_timeline
from mnopt.averaging.sharded import ShardedCollectives
from mnopt.communicators.timeline_calls import TimelineCalls
from mnopt.averaging.tuning import Tuner
from mnopt.stall.monitor import watched

__all__ = ['CommunicatorBase', 'MeanHandle', 'MpiCommunicatorBase']


#: {the COMM_WORLD ranks of a group: communicators made over it here}.
_made_over = collections.Counter()


def _label(kind, mpi_comm):
    """``kind#n``: the n-th communicator this process made over the ranks
    of ``mpi_comm``.  Making one is collective over those ranks, so n is
    the same on each of them whatever else a rank made (a communicator
    of its own over COMM_SELF, say); a group short of COMM_WORLD adds a
    digest of its ranks (``flat#0@3f2a9c``), telling communicators over
    different groups apart within one process."""
    group, world = mpi_comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        ranks = tuple(MPI.Group.Translate_ranks(
            group, list(range(mpi_comm.size)), world))
    finally:
        group.Free()
        world.Free()
    n = _made_over[ranks]
    _made_over[ranks] += 1
    if len(ranks) == MPI.COMM_WORLD.size and ranks == tuple(sorted(ranks)):
        return '%s#%d' % (kind, n)
    digest = hashlib.sha1(repr(ranks).encode()).hexdigest()[:6]
    return '%s#%d@%s' % (kind, n, digest)


class MpiCommunicatorBase(AveragingPipeline, ShardedCollectives,
                          ChainerMNCollectives, ChainerGlue,
                          CommHookRegistration, TimelineCalls,
                          CommunicatorBase):
    """A data-parallel communicator on MPI (ChainerMN's API).

    Subclasses set ``name`` and implement ``_sum(buffer, group)``: sum the
    group's buffer in place across all ranks (averaging.py's hooks).
    Optionally they override ``_make_group`` (a group with state of their
    own) and ``_buffer_options``, and give themselves a sharded path
    (sharded.py's transports).
    """

    def __init__(self, mpi_comm: MPI.Comm, **settings: Any) -> None:
        #: The keyword arguments it was made with, checked and normalized
        #: (check_arguments): a split is made from exactly these.
        self.settings = settings = self.check_arguments(**settings)
        release_collected()
        start_janitor()
        self.mpi_comm = mpi_comm
        #: At one rank the mean of a gradient is itself, so averaging moves
        #: nothing.  False (or MNOPT_SINGLE_RANK_AVERAGING=1) runs the whole
        #: path anyway: pack, cast, sum, unpack, as N > 1 does; for
        #: benchmarks and tests on one GPU.
        self.skip_single_rank = not _env.flag('MNOPT_SINGLE_RANK_AVERAGING',
                                              False)
        self._stall_settings = {'stall_warning': settings['stall_warning'],
                                'timeout': settings['timeout']}
        self.allreduce_grad_dtype = settings['allreduce_grad_dtype']
        self.compression = settings['compression']
        self.error_feedback = settings['error_feedback']
        self.warmup_steps = settings['warmup_steps']
        self.vote = sign.normalize_vote(settings['vote'])
        #: Bytes this rank sent for its last vote (sign compression).
        self.vote_stats = {}
        self.batched_copy = settings['batched_copy']  # ChainerMN's
        #: 'auto', 'ring' or 'mpi': $MNOPT_ALLREDUCE when it was made.
        self.allreduce_algorithm = allreduce.allreduce_algorithm()
        #: The MPI communicators and thread this communicator holds: freed
        #: by finalize(), or when the communicator is garbage-collected
        #: (MPI has a few thousand communicators per process).
        self._resources = resources = Resources()
        weakref.finalize(self, release_after_collection,
                         resources.release).atexit = False
        #: This rank's timeline (``timeline=`` or $MNOPT_TIMELINE; NULL
        #: when off): one file per process, named by the rank in
        #: COMM_WORLD, shared by every communicator of the process and
        #: closed when the last of them is finalized.
        self.timeline = resources.timeline = hold_timeline(
            timelines.open_from_environment(MPI.COMM_WORLD.rank,
                                            settings['timeline']))
        #: What its averagings share (averaging.py): the groups, the
        #: background thread, the averaging in flight, the averaging
        #: counter, the time spent, overflow and sign compression.
        self.averaging = Averaging(
            mpi_comm, self.name, self._make_group, resources,
            overflow.Reporter(settings['on_overflow']),
            SignCompression(self.error_feedback), PowerSGDCompression(
                settings['powersgd_rank'], settings['min_compression_rate'],
                self.error_feedback, settings['warm_start'],
                guarded=self.compression == 'auto')
            if self.compression in ('powersgd', 'auto') else None)
        label = _label(self.name, mpi_comm)
        #: This communicator in the timeline (the 'comm' of its 'wire'
        #: spans), in stall reports and in the per-step figures' matching
        #: of collectives across ranks: the same on each of its ranks.
        self.timeline_name = label
        self.averaging.timeline = self.timeline
        #: register_comm_hook's RegisteredHook, or None: plain averaging.
        self.averaging.comm_hook = None
        #: The tuning of the settings passed as 'auto' (tuning.py); the
        #: values every averaging runs with, tuned or not.
        self.averaging.tuner = Tuner(
            self.name, settings, mpi_comm.rank,
            alone=mpi_comm.size == 1 and self.skip_single_rank)
        self._monitor = self._make_monitor(mpi_comm, label,
                                           **self._stall_settings)
        cores.limit_blas_threads(buffers.ranks_on_node(mpi_comm))
        if self._owns_monitor():
            resources.monitor = self._monitor
        intra, leaders, node, n_nodes = node_split(mpi_comm)
        self._intra_rank, self._intra_size = intra.rank, intra.size
        self._inter_rank, self._inter_size = node, n_nodes
        intra.Free()
        leaders.Free()
        resources.sync_group = self._make_group(mpi_comm.Dup())
        if collective_check.mode() == 'detail' and mpi_comm.size > 1:
            self.check_calls = resources.call_check = \
                collective_check.CollectiveCheck(mpi_comm.Dup())

    #: Averagings so far (warm-up, and the votes' coin).
    steps = property(lambda self: self.averaging.steps,
                     lambda self, steps: setattr(self.averaging, 'steps',
                                                 steps))
    #: Seconds spent averaging (in the caller or in the background), all
    #: averagings so far: against the time a caller was blocked, what
    #: double buffering or overlap hid.
    averaging_seconds = property(lambda self: self.averaging.seconds)
    #: The communication figures since they were last taken (a StepStats,
    #: mnopt/timeline/step_stats.py): kept with the timeline on or off.
    step_stats = property(lambda self: self.averaging.stats)

    def communication_stats(self) -> dict[str, Any]:
        """This rank's communication figures since the last call, and
        zero again (``step_stats.take()``; mnopt/timeline/step_stats.py says
        what each is).  Local: no communication.  Each figure is handed out
        once: beside a CommunicationReport, which calls this every
        iteration, a call takes what the report would have shown."""
        return self.averaging.stats.take()

    #: Wire bytes per reduction call now: ``bucket_bytes``, or with
    #: 'auto' the candidate being timed, then the choice.
    bucket_bytes = property(
        lambda self: self.averaging.tuner.current()['bucket_bytes'])
    #: The ring's message size now (None: the ring's own rule), as
    #: ``bucket_bytes``.
    segment_bytes = property(
        lambda self: self.averaging.tuner.current()['segment_bytes'])

    @property
    def tuned_settings(self) -> dict[str, Any] | None:
        """The values chosen for the settings passed as 'auto' (the same
        on every rank), once the tuning is done: None while it runs, {}
        where nothing is tuned.  Pass them as keywords to skip the tuning
        in a later run of the same job."""
        result = self.averaging.tuner.result
        return None if result is None else dict(result)

    def tuning_problem(self, mode: str) -> str | None:
        """Why this communicator's 'auto' settings cannot be tuned under
        an optimizer that averages as ``mode`` says (``'overlap'``,
        ``'shard_state'``), or None (local: every rank says the same)."""
        tuned = [n for n, _ in self.averaging.tuner.plan]
        if not tuned:
            return None
        return ("%s='auto' tunes by timing whole averagings of the "
                'gradients; %s averages %s, which it cannot time as one: '
                'pass numbers (a tuned run without %s says which: '
                'comm.tuned_settings, docs/tuning.md)' % (
                    tuned[0], mode,
                    'bucket by bucket during backward' if mode == 'overlap'
                    else 'by reduce-scatter and all-gather', mode))

    # What the parts hold, by their old names (tests read them).
    _sync_group = property(lambda self: self._resources.sync_group)
    _async_group = property(lambda self: self._resources.async_group)
    _executor = property(lambda self: self._resources.executor)
    _overflow = property(lambda self: self.averaging.overflow)

    def _background(self):
        return self.averaging.background()

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
    def _make_monitor(self, mpi_comm, label, **settings):
        """The stall-detection Monitor of this communicator's operations
        (mnopt/stall/monitor.py)."""
        return stall.Monitor(mpi_comm, label, **settings)

    def _owns_monitor(self):
        """Whether the stall-detection Monitor is this communicator's own
        (freed with it), not shared with others."""
        return True

    def background_collectives_problem(self) -> str | None:
        """Why collectives cannot run on a background thread (a sentence),
        or None: MPI initialised below MPI_THREAD_MULTIPLE."""
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            return ('collectives on a background thread need '
                    'MPI_THREAD_MULTIPLE; this MPI was initialised with a '
                    'lower thread level')
        return None

    # ----------------------------------------------------------- lifecycle
    def finalize(self) -> None:
        """Wait for background work and free this communicator's MPI
        resources.  Safe to call more than once."""
        try:
            self.averaging.in_flight.wait()
        finally:
            self._resources.release()
            release_collected()

    # ----------------------------------------------------------- agreement
    # mnopt's own decisions that every rank must make alike (mnopt/
    # agreement.py), over mnopt's private duplicate of the user's
    # communicator: never in the user's message or tag space.  Watched
    # like every collective, so a rank that exited or finalized is seen
    # at once (one name for all four: ranks call them in the same order).
    # Each is also a point where the ranks wait for each other: its wait
    # is kept for the per-step figures (who arrived last: a rank late to
    # a step is waited for at the step's first agreement).
    def _agree(self, run, *args):
        averaging = self.averaging
        averaging.agreements += 1
        key = (self.timeline_name, 'agreement', averaging.agreements)
        start = step_stats.clock()
        try:
            # In the timeline a 'wait' (the caller blocked on the other
            # ranks: a rank late to the step is waited for here).
            with self.timeline.span('wait', 'comm', op='agreement',
                                    comm=self.timeline_name):
                return run(self._sync_group.comm, *args,
                           **self._stall_settings)
        finally:
            averaging.stats.add_arrival(key, step_stats.clock() - start)

    @watched('agreement')
    def everyone(self, value: Any, what: str) -> list[Any]:
        """``[rank 0's value, rank 1's, ...]`` on every rank."""
        return self._agree(agreement.everyone, value, what)

    @watched('agreement')
    def raise_together(self, problem: BaseException | None,
                       what: str) -> None:
        """Raise on every rank if any rank's ``problem`` is an exception
        (agreement.raise_together)."""
        self._agree(agreement.raise_together, problem, what)

    @watched('agreement')
    def same(self, settings: dict[str, Any], what: str,
             problem: BaseException | None = None) -> dict[str, Any]:
        """ValueError on every rank unless every rank's ``settings`` dict
        is equal, naming what differs; a rank's ``problem`` raised on
        every rank first, in the same exchange (agreement.same)."""
        return self._agree(agreement.same, settings, what, problem)

    @watched('agreement')
    def common(self, items: Iterable[Any], what: str) -> list[Any]:
        """The items every rank holds, sorted (agreement.common)."""
        return self._agree(agreement.common, items, what)

    # ----------------------------------------------------------- collectives
    @watched('split')
    def split(self, color: int, key: int) -> CommunicatorBase:
        """A communicator of the same kind over ``mpi_comm.Split``."""
        # Every rank arrives first at an exchange, waited for between
        # polls (a late rank is reported, Ctrl-C ends the job): MPI's
        # Split blocks the caller's thread without a look at Python's
        # signals, so it must not be where the ranks wait for a late one.
        self._agree(agreement.everyone, (color, key), 'split')
        sub = self.mpi_comm.Split(color, key)
        # Every setting, from the one record of them: a new setting
        # cannot be forgotten here.
        child = type(self)(sub, **self.settings)
        # The parent's timeline (the same file: one per process), whatever
        # $MNOPT_TIMELINE says now; its collectives named apart from those
        # of the other colors.
        if child.timeline is not self.timeline:
            let_go_of_timeline(child.timeline)
            child.timeline = child._resources.timeline = \
                child.averaging.timeline = hold_timeline(self.timeline)
        child.timeline_name = '%s/%s' % (self.timeline_name, color)
        return child

    # ChainerMN's array and object collectives: chainermn_collectives.py.
