"""Communicators by name; ``create_communicator`` is the entry point.

This folder holds the communicator itself: the interface
(communicator_base.py), the kinds (naive, flat, hierarchical, pure_nccl,
reduction_server with colocated.py), what every kind is put together from
(base.py with its ChainerMN-facing methods: chainer_glue.py,
chainermn_collectives.py, timeline_calls.py), the factory's arguments and
settings (arguments.py, settings.py), a communicator's resources
(resources.py), your own comm hook: the types it sees (comm_hooks.py)
and the registered hook at work (registered_hook.py), and the agreements of pieces that take any ChainerMN-like
communicator (any_communicator.py).  The averaging the kinds share is in
mnopt/averaging/.  Layer 5 (communicators) of docs/architecture.md."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpi4py import MPI
    from numpy.typing import DTypeLike

    from mnopt.communicators.base import CommunicatorBase

_REGISTRY = {
    'naive': ('mnopt.communicators.naive', 'NaiveCommunicator'),
    'flat': ('mnopt.communicators.flat', 'FlatCommunicator'),
    'hierarchical': ('mnopt.communicators.hierarchical',
                     'HierarchicalCommunicator'),
    'pure_nccl': ('mnopt.communicators.pure_nccl', 'PureNcclCommunicator'),
    'reduction_server': ('mnopt.communicators.reduction_server',
                         'ReductionServerCommunicator'),
}
NAMES = tuple(_REGISTRY) + ('auto',)
#: ChainerMN's communicator names that mnopt has no communicator of, and
#: what to use instead (docs/chainermn.md).
CHAINERMN_NAMES = {
    'two_dimensional': "use 'hierarchical' (within each node, then across "
                       'nodes, as two_dimensional does)',
    'single_node': "use 'pure_nccl' on GPUs (NCCL, as single_node), 'flat' "
                   "otherwise; 'auto' picks between them",
    'non_cuda_aware': "use 'hierarchical' (mnopt stages GPU arrays through "
                      'host memory itself: no CUDA-aware MPI needed), or '
                      "'pure_nccl'",
    'dummy': 'mnopt has none that skips the communication (as dummy '
             'does): python -m mnopt.benchmark times the averaging apart '
             'from training',
}


def communicator_class(name):
    if name == 'auto':
        from mnopt.gpu.diagnosis import gpu_available
        name = 'pure_nccl' if gpu_available() else 'flat'
    if name in CHAINERMN_NAMES:
        raise ValueError("ChainerMN's %r communicator is not in mnopt: %s"
                         % (name, CHAINERMN_NAMES[name]))
    if name not in _REGISTRY:
        raise ValueError('unknown communicator %r; choose one of %s'
                         % (name, ', '.join(NAMES)))
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)


def create_communicator(communicator_name: str = 'auto',
                        mpi_comm: MPI.Comm | None = None,
                        allreduce_grad_dtype: DTypeLike | None = None,
                        batched_copy: bool = True,
                        bucket_bytes: int | str | None = None,
                        abort_on_exception: bool = True,
                        compression: str | None = None,
                        error_feedback: bool = True, warmup_steps: int = 0,
                        vote: str | None = None,
                        stall_warning: float | None = None,
                        timeout: float | None = None,
                        on_overflow: str = 'warn',
                        timeline: str | None = None,
                        segment_bytes: int | str | None = None,
                        powersgd_rank: int | None = None,
                        min_compression_rate: float | None = None,
                        warm_start: bool | None = None,
                        **options: Any) -> CommunicatorBase:
    """Create a communicator.

    Args:
        communicator_name: ``'naive'``, ``'flat'``, ``'hierarchical'``,
            ``'pure_nccl'``, ``'reduction_server'``, or ``'auto'``
            (``pure_nccl`` where CuPy, NCCL and a GPU are present, ``flat``
            otherwise).
        mpi_comm: the mpi4py communicator to run over (COMM_WORLD).
        allreduce_grad_dtype: dtype gradients travel in: ``'float16'``,
            ``'bfloat16'``, ``'float32'``, ``'float64'`` or None (their own).
        batched_copy: ChainerMN's setting, kept (``get_config``); mnopt
            always packs in one batched pass.
        bucket_bytes: bytes of wire data per reduction call (default 1 MiB),
            or ``'auto'`` (``flat``, ``hierarchical``): the first
            averagings time candidates and every rank takes the quickest
            (mnopt/averaging/tuning.py, docs/tuning.md;
            ``comm.tuned_settings`` says what was chosen).
        abort_on_exception: install a hook that aborts the whole MPI job
            when any rank dies of an uncaught exception (instead of leaving
            the other ranks hanging); ``import mnopt`` already installs it
            in a process an MPI launcher started as one of several, and
            False removes it.
        compression: None; ``'sign'``: signSGD with majority vote (see
            mnopt/codecs/sign.py): every rank's gradients become signs and one
            scale per array; the result is the element-wise majority sign
            times the mean scale.  Ring communicators count votes on a ring
            (ceil(log2(i+1)) bits per element), ``reduction_server`` on the
            servers (1 bit each way).  ``'powersgd'``: PowerSGD's low-rank
            mean (mnopt/codecs/powersgd.py): each gradient matrix (a conv
            kernel as (out, in*kh*kw)) is sent as two factors of
            ``powersgd_rank`` columns; vectors and small matrices whole.
            ``'auto'``: PowerSGD on each gradient set (bucket) where its
            first averagings, timed both ways, show that it pays, plain
            averaging elsewhere.  See docs/compression.md.
        error_feedback: with ``compression``, carry each rank's compression
            error into its next gradient (default True).
        warmup_steps: with ``compression``, the first this many averagings
            (iterations: see ``mean_grads``) are uncompressed means (in
            ``allreduce_grad_dtype``); PyTorch's ``start_powerSGD_iter``.
        vote: with ``compression='sign'`` on a ring communicator, how the
            votes are counted: ``'ring'`` (default; the counting ring, each
            rank talks to its neighbours only) or ``'alltoall'`` (1-bit
            Adam's all-to-all + all-gather: fewer bits and rounds, but
            every pair of ranks talks; see docs/sign_compression.md).
        stall_warning: seconds a rank waits in an mnopt operation before
            it prints which ranks have not arrived (default
            $MNOPT_STALL_WARNING, else 60; 0 disables); see
            mnopt/stall/monitor.py.
        timeout: seconds after which a rank still waiting aborts the whole
            MPI job with that report (default $MNOPT_TIMEOUT, else 600;
            0 disables).
        on_overflow: what happens when averaging on a 16-bit wire turns
            finite gradients into inf/NaN (mnopt/codecs/overflow.py):
            ``'warn'`` (rank 0, rate-limited), ``'error'``
            (GradientOverflowError on every rank) or ``'ignore'``.
        timeline: a file to record this rank's timeline in (Chrome trace
            / Perfetto JSON; ``{rank}`` in it is replaced by the rank in
            COMM_WORLD, else ``.rank<N>`` goes before the extension), or
            None: $MNOPT_TIMELINE, else off.  Each rank's own setting; see
            docs/observability.md.
        segment_bytes: the size of each message of mnopt's ring (None:
            its own rule, 32 to 256 KiB), or ``'auto'`` (``flat``,
            ``hierarchical``), tuned as ``bucket_bytes``; not on
            ``reduction_server`` or ``pure_nccl`` (no ring).
        powersgd_rank: with ``compression='powersgd'``/``'auto'``, the
            rank of the approximation (default 1; PyTorch's
            ``matrix_approximation_rank``).
        min_compression_rate: with PowerSGD, a matrix is compressed only
            where its elements exceed this many times those of its
            factors (default 2.0, PyTorch's); others go whole.
        warm_start: with PowerSGD, start each step's power iteration from
            the last step's Q (default True) rather than a fresh draw.
        **options: the communicator's own; ``reduction_server`` takes
            ``chunk_bytes`` (256 KiB), ``window`` (chunks in flight per
            server, 6) (either may be ``'auto'``, tuned as
            ``bucket_bytes``), ``server_memory`` (staging bytes per
            channel of a colocated server, 64 MiB) and ``stats`` (collect
            per-phase timings in ``comm.stats``).

    Every rank must pass the settings the ranks share (communicator kind,
    wire, bucket and chunk sizes, compression, ..., $MNOPT_ALLREDUCE: see
    ``SHARED_SETTINGS`` in mnopt/communicators/settings.py) alike: a
    difference is a ValueError on every rank naming the setting and each
    rank's value.  The communicator keeps its settings (``comm.settings``);
    ``comm.split`` makes one of the same kind with the same.
    """
    from mnopt import global_except_hook
    if abort_on_exception:
        # First: whatever fails below (a bad setting on one rank) must end
        # the job, not leave the other ranks waiting for this one.
        global_except_hook.add_hook()
    else:   # the hook import mnopt installed in a launched process
        global_except_hook.remove_hook()
    from mnopt.stall import launched
    # MPI's start waits for every rank (one that exited before it would
    # keep this one there for ever): under the stall warning and timeout.
    launched.start_mpi('create_communicator', stall_warning, timeout)
    from mpi4py import MPI
    launched.warn_if_alone(MPI.COMM_WORLD.Get_size())
    mpi_comm = _intracommunicator(MPI.COMM_WORLD if mpi_comm is None
                                  else mpi_comm)
    kwargs = dict({'allreduce_grad_dtype': allreduce_grad_dtype,
                   'compression': compression,
                   'error_feedback': error_feedback,
                   'warmup_steps': warmup_steps, 'vote': vote,
                   'on_overflow': on_overflow,
                   'batched_copy': batched_copy, 'timeline': timeline,
                   'segment_bytes': segment_bytes,
                   'powersgd_rank': powersgd_rank,
                   'min_compression_rate': min_compression_rate,
                   'warm_start': warm_start},
                  **options)
    if stall_warning is not None or timeout is not None:
        kwargs.update(stall_warning=stall_warning, timeout=timeout)
    if bucket_bytes is not None:
        kwargs['bucket_bytes'] = bucket_bytes
    # Every setting, keyword or MNOPT_*, is checked before the first
    # collective: a bad one on one rank is reported by the exchange below.
    cls = settings = shared = tl = None
    try:
        cls = communicator_class(communicator_name)
        settings = cls.check_arguments(**kwargs)
        shared = cls.shared_settings(settings)
        tl = _open_timeline(settings['timeline'])
        problem = None
    except (TypeError, ValueError, RuntimeError) as e:
        problem = e
    from mnopt.server import job as server_job
    servers = server_job.job(stall_warning=stall_warning,
                             timeout=timeout).servers \
        if mpi_comm == MPI.COMM_WORLD else []
    if servers and problem is None:
        problem = _problem_with_servers(cls, servers, kwargs)
    # The start-up exchange, this call's first collective of its own (the
    # job's, above, is watched too): every rank learns every rank's problem
    # and shared settings before any collective that needs them.
    job = _agree_to_start(
        server_job.job().channels()[0] if servers else mpi_comm, problem,
        shared, communicator_name, stall_warning, timeout)
    if mpi_comm == MPI.COMM_WORLD:
        from mnopt.timeline import recorder as timeline
        tl.mark_job(timeline.name_job(job))   # also start_timeline's files
    return cls(mpi_comm, **settings)


def _open_timeline(path):
    """This rank's timeline (``timeline=``, else $MNOPT_TIMELINE; NULL
    when off), opened before the start-up exchange, so that a file a rank
    cannot write is a ValueError on every rank, not an exception on that
    rank alone; the communicator then finds it open."""
    from mpi4py import MPI
    from mnopt.timeline import recorder as timeline
    try:
        return timeline.open_from_environment(MPI.COMM_WORLD.rank, path)
    except OSError as e:
        raise ValueError('the timeline file cannot be written (timeline=%r, '
                         '$%s=%r): %s' % (path, timeline.ENV,
                                          os.environ.get(timeline.ENV), e))


def _problem_with_servers(cls, servers, kwargs):
    """What is wrong with making a ``cls`` communicator in a job launched
    with reduction ``servers`` (a ValueError), or None."""
    if cls.name != 'reduction_server':
        return ValueError(
            'this job was launched with %d reduction server process(es) '
            '(python -m mnopt.server) but asks for the %r communicator: '
            "use 'reduction_server', or launch without servers"
            % (len(servers), cls.name))
    from mnopt.server import job as server_job
    return server_job.stall_settings_problem(kwargs.get('stall_warning'),
                                             kwargs.get('timeout'))


def _intracommunicator(mpi_comm):
    from mpi4py import MPI
    if not isinstance(mpi_comm, MPI.Intracomm) or mpi_comm == MPI.COMM_NULL:
        raise TypeError('mpi_comm must be an mpi4py intracommunicator '
                        '(MPI.COMM_WORLD or one made from it), not %r'
                        % (mpi_comm,))
    return mpi_comm


def _agree_to_start(comm, problem, shared, name, stall_warning, timeout):
    """The start-up exchange over ``comm``: each rank's problem (an
    exception, or None) and its shared settings (``shared_settings``), in
    one exchange waited for with stall detection.  If any rank had a
    problem, every rank raises (that rank its own exception, the others a
    RuntimeError naming it); else if the shared settings differ, every
    rank raises the same ValueError naming each setting and every rank's
    value.  Returns rank 0's token: one id of the exchange on every rank
    (a timeline names its job with the first one over COMM_WORLD)."""
    import secrets
    from mnopt.transport import agreement
    what = 'create_communicator(%r)' % (name,)
    # One exchange whatever the kind: ranks creating different kinds are
    # told so by the settings' comparison below, naming the setting.
    said = agreement.everyone(
        comm, (agreement.describe(problem), shared, secrets.token_hex(6)),
        '%s (waiting for every rank to create it)' % what, stall_warning,
        timeout, exchange='create_communicator')
    agreement.settle(problem, [p for p, _, _ in said], what)
    message = agreement.disagreement([s for _, s, _ in said],
                                     'the settings of %s' % what)
    if message:
        raise ValueError(message)
    return said[0][2]


def __getattr__(name):
    # Imported on first use: importing mpi4py.MPI starts MPI, which
    # ``import mnopt.communicators`` must not (see mnopt/__init__.py).
    if name == 'CommunicatorBase':
        from mnopt.communicators.base import CommunicatorBase
        return CommunicatorBase
    raise AttributeError('module %r has no attribute %r' % (__name__, name))
