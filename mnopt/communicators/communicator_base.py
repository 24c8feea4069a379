"""CommunicatorBase: the interface every communicator implements
(ChainerMN's, and mnopt's own averaging, agreement and sharded operations).

As ChainerMN's ``communicator_base.py``: what a communicator offers, not how.
mnopt's communicators implement it on MPI (``MpiCommunicatorBase``,
mnopt/communicators/base.py, and one module per algorithm); the Chainer
layer talks to a communicator through these methods only.  The keyword
arguments every communicator takes, and which of them every rank must
share, are described here (``check_arguments``, ``shared_settings``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from mpi4py import MPI

from mnopt.codecs import grad_buffer
from mnopt.timeline import recorder as timelines
from mnopt.communicators import arguments
from mnopt.averaging.mean_handle import MeanHandle
from mnopt.communicators.settings import shared_settings as settings_of

if TYPE_CHECKING:
    import chainer
    from numpy.typing import DTypeLike


def _refuse_arguments(communicator, args, kwargs):
    # Before 0.1.0's layers, mnopt's CommunicatorBase was the
    # implementation a new communicator subclassed; say where it went.
    if args or kwargs:
        raise TypeError(
            '%s(...): CommunicatorBase is the interface and takes no '
            'arguments; a communicator that says how to sum a buffer '
            'subclasses mnopt.communicators.base.MpiCommunicatorBase '
            '(docs/architecture.md)' % type(communicator).__name__)


class CommunicatorBase(object):
    """A data-parallel communicator (ChainerMN's API and mnopt's).

    ``name``: the kind ('flat', 'pure_nccl', ...), as
    ``create_communicator`` takes it.  Every method not marked otherwise
    is collective: every rank calls it, in the same order.
    """

    name: str | None = None
    #: Where this rank records its timeline (mnopt/timeline/recorder.py): a
    #: Timeline, or timeline.NULL (false) when off.  Per rank, not shared.
    timeline: Any = timelines.NULL
    #: MNOPT_DEBUG=detail's check of each collective across ranks before
    #: it runs (mnopt/transport/collective_check.py), or None: off.
    check_calls: Any = None

    if TYPE_CHECKING:
        # For type checkers the interface takes no arguments.
        def __init__(self) -> None: ...
    else:
        def __init__(self, *args, **kwargs):
            _refuse_arguments(self, args, kwargs)


    # ----------------------------------------------------------- settings
    @classmethod
    def check_arguments(cls, allreduce_grad_dtype: DTypeLike | None = None,
                        bucket_bytes: int | str =
                        grad_buffer.DEFAULT_BUCKET_BYTES,
                        compression: str | None = None,
                        error_feedback: bool = True, warmup_steps: int = 0,
                        vote: str | None = None,
                        stall_warning: float | None = None,
                        timeout: float | None = None,
                        on_overflow: str = 'warn', batched_copy: bool = True,
                        timeline: str | None = None,
                        segment_bytes: int | str | None = None,
                        powersgd_rank: int | None = None,
                        min_compression_rate: float | None = None,
                        warm_start: bool | None = None,
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
        return arguments.check_arguments(
            cls.name, options, allreduce_grad_dtype=allreduce_grad_dtype,
            bucket_bytes=bucket_bytes, compression=compression,
            error_feedback=error_feedback, warmup_steps=warmup_steps,
            vote=vote, stall_warning=stall_warning, timeout=timeout,
            on_overflow=on_overflow, batched_copy=batched_copy,
            timeline=timeline, segment_bytes=segment_bytes,
            powersgd_rank=powersgd_rank,
            min_compression_rate=min_compression_rate,
            warm_start=warm_start)

    @classmethod
    def shared_settings(cls, settings: dict[str, Any]) -> dict[str, Any]:
        """What every rank must share (SHARED_SETTINGS) of ``settings``
        (check_arguments' result), the kind and the environment; the
        start-up exchange compares them.  Unset ones are left out."""
        return settings_of(cls.name, settings)

    # ----------------------------------------------------------- ranks
    @property
    def rank(self) -> int:
        """This process's rank."""
        raise NotImplementedError

    @property
    def size(self) -> int:
        """The number of ranks."""
        raise NotImplementedError

    @property
    def intra_rank(self) -> int:
        """This process's rank among those of its node."""
        raise NotImplementedError

    @property
    def intra_size(self) -> int:
        """The number of ranks on this process's node."""
        raise NotImplementedError

    @property
    def inter_rank(self) -> int:
        """This process's node's index."""
        raise NotImplementedError

    @property
    def inter_size(self) -> int:
        """The number of nodes."""
        raise NotImplementedError

    # ----------------------------------------------------------- config
    def set_config(self, name: str, value: Any = True,
                   **kwargs: Any) -> None:
        """Set ChainerMN's run-time setting ``name`` (local)."""
        raise NotImplementedError

    def get_config(self, name: str | None = None) -> Any:
        """The run-time setting ``name``, or all of them (local)."""
        raise NotImplementedError

    # ----------------------------------------------------------- gradients
    def mean_grads(self, named_grads: Iterable[tuple[str, Any]],
                   iteration: int | None = None) -> None:
        """Average ``[(name, array), ...]`` in place across all ranks."""
        raise NotImplementedError

    def mean_grads_async(self, named_grads: Iterable[tuple[str, Any]],
                         queue: bool = False,
                         iteration: int | None = None) -> MeanHandle:
        """Start averaging ``named_grads`` in place in the background."""
        raise NotImplementedError

    def multi_node_mean_grad(self, model: chainer.Link,
                             zero_fill: bool = False) -> None:
        """Replace each parameter's gradient by its mean over all ranks."""
        raise NotImplementedError

    def allreduce_grad(self, model: chainer.Link,
                       zero_fill: bool = False) -> None:
        """Deprecated ChainerMN name of multi_node_mean_grad."""
        raise NotImplementedError

    def bcast_data(self, model: chainer.Link, root: int = 0) -> None:
        """Broadcast every parameter's data from ``root``."""
        raise NotImplementedError

    broadcast_data = bcast_data

    def serialize_compression(self, serializer: chainer.AbstractSerializer,
                              shared: bool = True,
                              local: bool = True) -> None:
        """Save or load the state of gradient compression (local)."""
        raise NotImplementedError

    # ----------------------------------------------------------- tuning
    @property
    def tuned_settings(self) -> dict[str, Any] | None:
        """The values chosen for the settings passed as 'auto' once the
        tuning is done (the same on every rank); None while it runs, {}
        where nothing is tuned (local)."""
        raise NotImplementedError

    def tuning_problem(self, mode: str) -> str | None:
        """Why this communicator's 'auto' settings cannot be tuned under
        an optimizer that averages as ``mode`` says ('overlap',
        'shard_state'), or None (local)."""
        raise NotImplementedError

    # ----------------------------------------------------------- figures
    def communication_stats(self) -> dict[str, Any]:
        """This rank's communication figures since the last call (local;
        mnopt/timeline/step_stats.py says what each is): exposed and hidden
        seconds, wire seconds, bytes sent and received, bus bandwidth,
        and each collective's wait (who arrived last).  Starts them
        again from zero."""
        raise NotImplementedError

    # ----------------------------------------------------------- sharded
    def sharding_problem(self) -> str | None:
        """Why this communicator cannot run a sharded optimizer, or None
        (local)."""
        raise NotImplementedError

    def background_collectives_problem(self) -> str | None:
        """Why collectives cannot run on a background thread (a
        sentence), or None (local)."""
        raise NotImplementedError

    def shard_buffer_nbytes(self) -> int:
        """Bytes of the buffers the sharded collectives keep (local)."""
        raise NotImplementedError

    def reduce_scatter_mean(self, named_grads: Iterable[tuple[str, Any]],
                            arrays_per_rank: Sequence[int]) -> None:
        """Give this rank the mean of its share of ``named_grads``."""
        raise NotImplementedError

    def reduce_scatter_mean_async(
            self, named_grads: Iterable[tuple[str, Any]],
            arrays_per_rank: Sequence[int]) -> MeanHandle:
        """``reduce_scatter_mean`` in the background."""
        raise NotImplementedError

    def allgather_params(self, named_params: Iterable[tuple[str, Any]],
                         arrays_per_rank: Sequence[int]) -> None:
        """Give every rank every rank's share of ``named_params``."""
        raise NotImplementedError

    # ----------------------------------------------------------- agreement
    def everyone(self, value: Any, what: str) -> list[Any]:
        """``[rank 0's value, rank 1's, ...]`` on every rank."""
        raise NotImplementedError

    def raise_together(self, problem: BaseException | None,
                       what: str) -> None:
        """Raise on every rank if any rank's ``problem`` is an exception."""
        raise NotImplementedError

    def same(self, settings: dict[str, Any], what: str,
             problem: BaseException | None = None) -> dict[str, Any]:
        """ValueError on every rank unless every rank's ``settings`` dict
        is equal; any rank's ``problem`` (an exception) first, raised on
        every rank as ``raise_together`` does."""
        raise NotImplementedError

    def common(self, items: Iterable[Any], what: str) -> list[Any]:
        """The items every rank holds, sorted."""
        raise NotImplementedError

    # ----------------------------------------------------------- collectives
    def split(self, color: int, key: int) -> CommunicatorBase:
        """A communicator of the same kind over ``mpi_comm.Split``."""
        raise NotImplementedError

    def send(self, data: Any, dest: int, tag: int) -> None:
        """Send an array (or a tuple of them) to ``dest`` (point to
        point)."""
        raise NotImplementedError

    def recv(self, source: int, tag: int) -> Any:
        """Receive what ``send`` sent (point to point)."""
        raise NotImplementedError

    def bcast(self, x: Any, root: int = 0) -> Any:
        """``root``'s array on every rank."""
        raise NotImplementedError

    def gather(self, x: Any, root: int = 0) -> tuple[Any, ...] | None:
        """Every rank's array on ``root`` (None elsewhere)."""
        raise NotImplementedError

    def allgather(self, x: Any) -> tuple[Any, ...]:
        """Every rank's array on every rank."""
        raise NotImplementedError

    def scatter(self, xs: Sequence[Any] | None, root: int = 0) -> Any:
        """Rank r gets ``root``'s ``xs[r]``."""
        raise NotImplementedError

    def alltoall(self, xs: Sequence[Any]) -> tuple[Any, ...]:
        """Rank r gets every rank's ``xs[r]``."""
        raise NotImplementedError

    def allreduce(self, x: Any) -> Any:
        """Element-wise sum of ``x`` over all ranks (a new array)."""
        raise NotImplementedError

    def send_obj(self, obj: Any, dest: int, tag: int = 0) -> None:
        """Send a picklable object to ``dest`` (point to point)."""
        raise NotImplementedError

    def recv_obj(self, source: int, status: MPI.Status | None = None,
                 tag: int = MPI.ANY_TAG) -> Any:
        """Receive what ``send_obj`` sent (point to point)."""
        raise NotImplementedError

    def bcast_obj(self, obj: Any, max_buf_len: int | None = None,
                  root: int = 0) -> Any:
        """``root``'s object on every rank."""
        raise NotImplementedError

    def gather_obj(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's object on ``root`` (None elsewhere)."""
        raise NotImplementedError

    def allgather_obj(self, obj: Any) -> list[Any]:
        """Every rank's object on every rank."""
        raise NotImplementedError

    def allreduce_obj(self, obj: Any) -> Any:
        """Sum of ``obj`` over ranks with ``+``, in rank order."""
        raise NotImplementedError

    def scatter_obj(self, objs: Sequence[Any] | None, root: int = 0
                    ) -> Any:
        """Rank r gets ``root``'s ``objs[r]``."""
        raise NotImplementedError

    # ----------------------------------------------------------- lifecycle
    def finalize(self) -> None:
        """Wait for background work and free this communicator's
        resources.  Safe to call more than once."""
        raise NotImplementedError
