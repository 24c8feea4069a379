"""A typed user of mnopt's public API, for mypy only (never run; not a
test module): the hints mnopt ships (mnopt/py.typed) must accept what a
correct ChainerMN-style script does.  tests/test_packaging.py runs mypy on
it (``python -m mypy``, configured in pyproject.toml) and checks that each
signature also rejects a wrong call."""

from __future__ import annotations

from typing import Any

import chainer
import numpy
from mpi4py import MPI

import mnopt
import mnopt as chainermn
from mnopt.communicators.base import CommunicatorBase, MeanHandle


def core(grads: list[tuple[str, numpy.ndarray]]) -> CommunicatorBase:
    """The Chainer-free core: a communicator, and averaging."""
    comm = mnopt.create_communicator(
        'flat', MPI.COMM_WORLD, allreduce_grad_dtype='float16',
        bucket_bytes=1 << 20, stall_warning=30.0, timeout=600,
        on_overflow='error')
    signs = mnopt.create_communicator('flat', compression='sign',
                                      warmup_steps=10, vote='ring')
    signs.finalize()
    comm.mean_grads(grads)
    comm.mean_grads(iter(grads), iteration=7)
    handle: MeanHandle = comm.mean_grads_async(grads, queue=True,
                                               iteration=8)
    finished: bool = handle.done()
    handle.wait()
    ranks: int = (comm.rank + comm.size + comm.intra_rank + comm.intra_size
                  + comm.inter_rank + comm.inter_size)
    comm.set_config('allreduce_grad_dtype', numpy.float32)
    config: Any = comm.get_config()
    settings: dict[str, Any] = comm.check_arguments(bucket_bytes=4096)
    shared: dict[str, Any] = comm.shared_settings(settings)
    values: list[Any] = comm.everyone(ranks, 'the ranks')
    comm.raise_together(None if finished else ValueError('no'), 'a check')
    comm.same({'seed': 0}, 'seeds')
    files: list[Any] = comm.common(['a.npz', 'b.npz'], 'snapshots')
    problem: str | None = comm.sharding_problem()
    owned = [1] * comm.size
    comm.reduce_scatter_mean(grads, owned)
    comm.reduce_scatter_mean_async(grads, owned).wait()
    comm.allgather_params(grads, owned)
    nbytes: int = comm.shard_buffer_nbytes()
    print(config, shared, values, files, problem, nbytes)
    return comm.split(comm.rank % 2, comm.rank)


def collectives(comm: CommunicatorBase, x: numpy.ndarray) -> None:
    """ChainerMN's array and object collectives."""
    if comm.rank == 0:
        comm.send(x, dest=1, tag=0)
        comm.send_obj({'a': 1}, 1)
    else:
        y: Any = comm.recv(0, tag=0)
        status = MPI.Status()
        print(y, comm.recv_obj(0, status=status, tag=MPI.ANY_TAG))
    gathered: tuple[Any, ...] | None = comm.gather(x, root=0)
    everyone: tuple[Any, ...] = comm.allgather(x)
    mine: Any = comm.scatter([x] * comm.size if comm.rank == 0 else None)
    swapped: tuple[Any, ...] = comm.alltoall([x] * comm.size)
    total: Any = comm.allreduce(comm.bcast(x, root=0))
    objects: list[Any] | None = comm.gather_obj('o', root=0)
    print(gathered, everyone, mine, swapped, total, objects,
          comm.bcast_obj(None, max_buf_len=None, root=0),
          comm.allgather_obj(1), comm.allreduce_obj(1),
          comm.scatter_obj(None if comm.rank else list(range(comm.size))))


def chainer_layer(model: chainer.Chain,
                  serializer: chainer.Serializer) -> None:
    """ChainerMN's names for the Chainer layer (``import mnopt as
    chainermn``)."""
    comm = chainermn.create_communicator('naive')
    comm.bcast_data(model)
    comm.broadcast_data(model, root=0)
    optimizer = chainermn.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(), comm, double_buffering=False,
        zero_fill=True, overlap=True, shard_state=False,
        accumulation_steps=1)
    optimizer.setup(model)
    comm.multi_node_mean_grad(model, zero_fill=True)
    comm.allreduce_grad(model)
    comm.serialize_compression(serializer, shared=True, local=False)
    comm.finalize()
