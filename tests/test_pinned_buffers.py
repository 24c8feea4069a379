"""Every host buffer a GPU copy touches is pinned (page-locked): a copy
through pageable memory is staged by the driver and cannot overlap.

Without a GPU, a GPU GradBuffer is built over a stand-in device array
module and a recording pinned allocator (``mnopt.gpu.device.pinned_empty``), and the
reduction server's result buffer, which it swaps with the buffer's own
every step, is checked to come from that allocator.  With a GPU, the same
buffers are checked with CUDA's pointer attributes (tests/test_gpu.py's
``MNOPT_REQUIRE_GPU=1`` rule applies: a GPU-only test skips without one).
"""


import numpy
import pytest

import mnopt
from mnopt.codecs import grad_buffer
from mnopt.gpu import codec, device
from mnopt.communicators.reduction_server import ReductionServerCommunicator
from mnopt.communicators.reduction_server import ServerChannel
from conftest import WORLD


class _Device(object):
    id = 0


class FakeDeviceArray(numpy.ndarray):
    """Stands in for a CuPy array: host memory, CuPy's copy methods."""
    device = _Device()

    def get(self, out):
        out[...] = self
        return out

    def set(self, host):
        self[...] = host


class FakeCupy(object):
    """The array module of FakeDeviceArray (GradBuffer calls ``empty``)."""

    @staticmethod
    def empty(n, dtype):
        return numpy.empty(n, dtype).view(FakeDeviceArray)


class FakeCodec(object):
    def __init__(self, wire, sizes, offsets):
        pass

    def reset(self):
        pass


@pytest.fixture
def pinned(monkeypatch):
    """Every array the pinned allocator made (the allocator records them)."""
    made = []

    def pinned_empty(n, dtype):
        a = numpy.empty(n, dtype)
        made.append(a)
        return a
    monkeypatch.setattr(device, 'pinned_empty', pinned_empty)
    monkeypatch.setattr(codec, 'Codec', FakeCodec)
    return made


def _made_by(a, made):
    return any(a is m for m in made)


def _gpu_buffer(n=1000, wire='float16'):
    named = [('/w', numpy.zeros(n, numpy.float32))]
    layout = grad_buffer.make_layout(named, wire)
    return grad_buffer.GradBuffer(layout, FakeCupy, bucket_bytes=1 << 62)


class _Group(object):
    """A reduction_server group: its state holds the result buffer."""

    def __init__(self):
        self.state = ServerChannel(None)


def _exchange_adds_one(group, data, result, wire, digest, step=0,
                       on_push=None, on_result=None):
    """Stands in for the servers: the 'means' are the data plus one."""
    result[...] = data + 1


@pytest.mark.skipif(WORLD.size > 1, reason='no communication')
def test_the_reduction_servers_result_buffer_is_pinned_for_a_gpu_buffer(
        pinned):
    buf = _gpu_buffer()
    buf.wire[...] = 0
    group = _Group()
    # The reduction server's own _sum, its exchange replaced.
    server = ReductionServerCommunicator.__new__(ReductionServerCommunicator)
    server._exchange = _exchange_adds_one
    hosts = set()
    for step in range(4):
        ReductionServerCommunicator._sum(server, buf, group)
        # The GPU copied the means from the buffer's host buffer
        # (from_host), and into it next step (host_parts): both pinned.
        assert _made_by(buf._host, pinned), step
        assert _made_by(group.state.result, pinned), step
        assert buf._host is not group.state.result
        hosts.update((id(buf._host), id(group.state.result)))
        assert (numpy.asarray(buf.wire) == step + 1).all()
    # Two pinned buffers alternate; none is allocated per step.
    assert len(hosts) == 2 and len(pinned) == 2


@pytest.mark.skipif(WORLD.size > 1, reason='no communication')
def test_a_pageable_result_left_by_a_cpu_layout_is_not_reused(pinned):
    """The group's result buffer is shared by layouts: one a CPU layout
    left (plain numpy) is replaced by a pinned one for a GPU buffer."""
    buf = _gpu_buffer()
    buf.wire[...] = 0   # (what empty() left could be NaN: a warning)
    group = _Group()
    group.state.result = numpy.empty(buf.wire.size, buf.dtype)   # same shape
    server = ReductionServerCommunicator.__new__(ReductionServerCommunicator)
    server._exchange = _exchange_adds_one
    ReductionServerCommunicator._sum(server, buf, group)
    assert _made_by(buf._host, pinned) and \
        _made_by(group.state.result, pinned)


@pytest.mark.skipif(WORLD.size > 1, reason='no communication')
def test_a_gpu_buffer_refuses_pageable_host_memory(pinned):
    buf = _gpu_buffer()
    list(buf.host_parts())
    with pytest.raises(ValueError, match='pinned: False'):
        buf.swap_host(numpy.empty(buf.wire.size, buf.dtype))
    assert buf.fits_host(buf.new_host_buffer())
    assert not buf.fits_host(numpy.empty(buf.wire.size, buf.dtype))
    assert not buf.fits_host(buf.new_host_buffer()[:-1])


@pytest.mark.skipif(WORLD.size > 1, reason='no communication')
def test_a_cpu_buffer_takes_plain_host_memory(pinned):
    layout = grad_buffer.make_layout(
        [('/w', numpy.zeros(10, numpy.float32))], 'float16')
    buf = grad_buffer.GradBuffer(layout, numpy)
    spare = buf.new_host_buffer()
    assert not pinned and type(spare) is numpy.ndarray
    assert buf.swap_host(spare) is not spare and buf.wire is spare


# ------------------------------------------------------------ on a GPU



def cuda_host_memory_type(cp, a):
    """CUDA's memory type of host array ``a``: cudaMemoryTypeHost (1) when
    page-locked by CUDA, unregistered (0) when pageable."""
    attrs = cp.cuda.runtime.pointerGetAttributes(a.ctypes.data)
    return attrs.type


def test_host_buffers_of_gpu_copies_are_page_locked_on_the_gpu(cupy):
    page_locked = cupy.cuda.runtime.memoryTypeHost
    # A plain numpy array is not: the check can fail.
    assert cuda_host_memory_type(cupy, numpy.empty(1000)) != page_locked
    named = [('/w', cupy.ones(1000, cupy.float32))]
    buf = grad_buffer.GradBuffer(grad_buffer.make_layout(named, 'float16'),
                                 cupy)
    buf.pack([a for _, a in named], 1)
    list(buf.host_parts())
    assert cuda_host_memory_type(cupy, buf._host) == page_locked
    assert cuda_host_memory_type(cupy, buf.new_host_buffer()) == page_locked
    # The reduction server's result buffer, swapped with the buffer's own
    # every step.
    comm = mnopt.create_communicator('reduction_server',
                                     allreduce_grad_dtype='float16')
    comm.skip_single_rank = False
    grads = [('/w', cupy.ones(1000, cupy.float32)),
             ('/b', cupy.ones(7, cupy.float32))]
    for _ in range(3):
        comm.mean_grads(grads)
        result = comm._sync_group.state.result
        assert result is not None
        assert cuda_host_memory_type(cupy, result) == page_locked
    comm.finalize()


class FakeCupyWithAsarray(FakeCupy):
    @staticmethod
    def asarray(a):
        return numpy.array(a).view(FakeDeviceArray)


@pytest.mark.skipif(WORLD.size > 1, reason='no communication')
def test_sign_compressions_host_copies_go_through_pinned_buffers(pinned):
    """A device codec's bits go to the host (for the vote) and the voted
    bits back to the device through pinned buffers, kept between steps."""
    from mnopt.codecs import sign
    layout = grad_buffer.make_layout(
        [('/w', numpy.zeros(100, numpy.float32))], 'float32')
    codec = sign.SignCodec(layout, numpy, error_feedback=False)
    codec.xp = FakeCupyWithAsarray      # as a CuPy codec would be
    for step in range(3):
        device_bits = numpy.arange(codec.n_bytes, dtype=numpy.uint8).view(
            FakeDeviceArray) + step
        host = codec.bits_to_host(device_bits)
        assert _made_by(host, pinned) and (host == device_bits).all()
        majority = numpy.full(codec.n_bytes, 7 + step, numpy.uint8)
        on_device = codec.majority_to_device(majority)
        assert _made_by(codec._host_majority, pinned)
        assert (numpy.asarray(on_device) == 7 + step).all()
    assert len(pinned) == 2     # one of each, kept


@pytest.mark.skipif(WORLD.size > 1, reason='no communication')
def test_a_host_sign_codec_copies_nothing(pinned):
    from mnopt.codecs import sign
    layout = grad_buffer.make_layout(
        [('/w', numpy.zeros(100, numpy.float32))], 'float32')
    codec = sign.SignCodec(layout, numpy)
    bits = numpy.zeros(codec.n_bytes, numpy.uint8)
    assert codec.bits_to_host(bits) is bits
    assert codec.majority_to_device(bits) is bits
    assert not pinned
