"""The pure_nccl communicator: one NCCL allreduce of the packed buffer on
the GPU."""

from mnopt.gpu.codec import Codec
from mnopt.gpu.device import cupy, device_id, new_stream
from mnopt.gpu.diagnosis import require_gpu
from mnopt.transport.nccl import (
    nccl_allgather_bytes, nccl_allreduce_sum, nccl_communicator,
    nccl_reduce_scatter_sum)
from mnopt.codecs import grad_buffer
from mnopt.communicators.base import MpiCommunicatorBase
from mnopt.averaging.group import Group


def _refuse_host_arrays(xp, arrays):
    """A TypeError saying what to do where ``xp`` is numpy: NCCL moves GPU
    memory only.  ``arrays``: what the call takes, as its message says."""
    if xp is not cupy():
        raise TypeError(
            "pure_nccl %s but got numpy ones; move the model to the GPU "
            "(model.to_gpu()) or use 'flat'" % arrays)


class NcclState(object):
    """pure_nccl's state of a group (``Group.state``): its NCCL
    communicator and the stream its collectives run on, made at the first
    collective."""

    def __init__(self):
        self.nccl = None
        self.stream = None

    def free(self):
        if self.nccl is not None:
            self.nccl.destroy()
            self.nccl = None


class PureNcclCommunicator(MpiCommunicatorBase):
    """One NCCL allreduce of the packed buffer on a non-blocking CUDA stream,
    ordered after the pack and before the unpack with events (no host
    synchronisation).  One process per GPU.

    The NCCL communicator (one per group: the synchronous and the
    background averaging each have theirs) is created at the first
    averaging, on the GPU holding the gradients, as ChainerMN does: a script
    creates the communicator first and selects its GPU afterwards, from
    ``comm.intra_rank``.  Created in ``__init__``, every rank of a node
    would initialise NCCL on GPU 0, which NCCL refuses.
    """

    name = 'pure_nccl'

    @classmethod
    def check_arguments(cls, **kwargs):
        require_gpu(cls.name)
        return super(PureNcclCommunicator, cls).check_arguments(**kwargs)

    def __init__(self, mpi_comm, **kwargs):
        require_gpu(self.name)
        super(PureNcclCommunicator, self).__init__(mpi_comm, **kwargs)

    def _make_group(self, comm):
        return Group(comm, NcclState())

    def _buffer_options(self):
        # One NCCL call over the whole packed buffer.
        return {'bucket_bytes': 1 << 62}

    # An empty set (overlap's last bucket when backward sent every
    # gradient, stage 2's last reduce-scatter) is a numpy one
    # (array_module([])): nothing to move, so no call and no refusal.

    def _sum(self, buffer, group):
        if not buffer.layout.names:
            return
        _refuse_host_arrays(buffer.xp, 'averages CuPy (GPU) gradients')
        state = group.state
        if state.nccl is None:
            # Collective: every rank reaches its first sum at the same
            # averaging.  The current device is the gradients' (_mean).
            state.nccl = nccl_communicator(group.comm)
            state.stream = new_stream()
        elif state.nccl.device_id() != buffer.device:
            raise RuntimeError(
                'pure_nccl: the gradients moved from GPU %d to GPU %d after '
                'the first averaging; NCCL is bound to the first GPU (create '
                'the communicator again after moving the model)'
                % (state.nccl.device_id(), buffer.device))
        nccl_allreduce_sum(state.nccl, buffer.wire, buffer.layout.wire,
                           state.stream)

    # ZeRO's collectives (mnopt/averaging/sharded.py) on NCCL, on the
    # group's side stream.  NCCL's reduceScatter and allGather move equal
    # counts per rank, so every rank's share is padded to the largest in
    # the device buffers (the padding stays zero); the packing kernels are
    # the averaging's, with the padded offsets (run on an H100 at N=1:
    # docs/gpu.md).

    def _nccl_for(self, group, device):
        state = group.state
        if state.nccl is None:
            state.nccl = nccl_communicator(group.comm)
            state.stream = new_stream()
        elif state.nccl.device_id() != device:
            raise RuntimeError(
                'pure_nccl: the arrays moved from GPU %d to GPU %d after the '
                'first collective; NCCL is bound to the first GPU (create '
                'the communicator again after moving the model)'
                % (state.nccl.device_id(), device))
        return state.nccl

    def _reduce_scatter_mean(self, group, shards, arrays, xp, counted):
        if not arrays:
            return ([], []) if counted else None
        _refuse_host_arrays(xp, 'averages CuPy (GPU) gradients')
        nccl = self._nccl_for(group, device_id(arrays))
        bufs, layout, rank = shards.device, shards.layout, self.rank
        own = list(shards.own(rank))
        if 'wire' not in bufs:
            stride = max(shards.counts)
            offs = layout.offsets
            padded = [r * stride + offs[i] - shards.starts[r]
                      for r in range(self.size) for i in shards.own(r)]
            dtype = grad_buffer.storage_dtype(layout.wire)
            bufs['stride'] = stride
            bufs['wire'] = xp.zeros(self.size * stride, dtype)
            bufs['mine'] = xp.empty(stride, dtype)
            bufs['pack'] = Codec(layout.wire, layout.sizes, padded)
            bufs['unpack'] = Codec(
                layout.wire, [layout.sizes[i] for i in own],
                [offs[i] - shards.starts[rank] for i in own])
        bufs['pack'].reset()
        bufs['unpack'].reset()
        bufs['pack'].pack(arrays, bufs['wire'], self._pack_divisor())
        nccl_reduce_scatter_sum(nccl, bufs['wire'], bufs['mine'],
                                bufs['stride'], layout.wire,
                                group.state.stream)
        bufs['unpack'].unpack(bufs['mine'], [arrays[i] for i in own])
        if not counted:
            return None
        out = [0] * len(layout.sizes)
        for i, c in zip(own, bufs['unpack'].take_counts()[1]):
            out[i] = c or 0
        return bufs['pack'].take_counts()[0], out

    def _allgather_params(self, group, shards, arrays, xp):
        if not arrays:
            return
        _refuse_host_arrays(xp, 'gathers CuPy (GPU) parameters')
        nccl = self._nccl_for(group, device_id(arrays))
        bufs, rank = shards.device, self.rank
        if 'params' not in bufs:
            bufs['byte_stride'] = max(shards.byte_counts)
            bufs['params'] = xp.zeros(self.size * bufs['byte_stride'],
                                      xp.uint8)
        stride, flat = bufs['byte_stride'], bufs['params']
        offs = shards.byte_offsets

        def slot(r, i):
            lo = r * stride + offs[i] - shards.byte_starts[r]
            return flat[lo:lo + shards.nbytes[i]]

        for i in shards.own(rank):
            slot(rank, i)[...] = xp.ascontiguousarray(
                arrays[i]).reshape(-1).view(xp.uint8)
        nccl_allgather_bytes(nccl, flat, stride, rank, group.state.stream)
        for r in range(self.size):
            if r != rank:
                for i in shards.own(r):
                    # Through the destination's bytes: a slot of the byte
                    # buffer need not be aligned for the array's dtype.
                    a = arrays[i]
                    dst = a if a.flags.c_contiguous else xp.empty(a.shape,
                                                                  a.dtype)
                    dst.reshape(-1).view(xp.uint8)[...] = slot(r, i)
                    if dst is not a:
                        a[...] = dst
