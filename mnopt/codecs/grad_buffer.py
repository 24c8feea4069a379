"""Packing, casting and bucketing of gradients: the one place it happens.

Every communicator averages gradients the same way:

1. ``pack``: each gradient is divided by the world size and cast to the wire
   dtype in a single pass into one flat, persistent buffer.  Dividing *before*
   summing keeps the mean finite wherever every rank's gradient / N and
   every partial sum of those fit the wire dtype, as they do whenever the
   gradients agree in sign (ChainerMN's FP16 path sums first and returns
   inf for gradients of 60000 on 2 ranks); mixed signs can still overflow
   a partial sum (mnopt/codecs/overflow.py).
2. the communicator sums the buffer across ranks, bucket by bucket.
3. ``unpack``: the summed buffer is cast back into each gradient's own dtype.

The wire dtypes are float16, bfloat16, float32 and float64.  NumPy has no
bfloat16, so bfloat16 travels as its raw bits in uint16 storage, rounded to
nearest-even from float32.

Buffers live where the gradients live: numpy arrays for CPU gradients, CuPy
arrays (with a pinned host mirror for MPI staging) for GPU gradients.

One idea, over 400 lines: a gradient set's wire buffer, packed, cast,
bucketed and unpacked (``GradBuffer``), with what it alone needs (its
layout, pinned host memory, and ``HostCodec``, its cast on the host that
the reduction servers share).
"""

import bisect
import hashlib
import weakref

import numpy

from mnopt.wire.dtypes import WIRE_DTYPES  # NOQA: re-exported
from mnopt.wire.dtypes import bfloat16_bits_to_float32  # NOQA: re-exported
from mnopt.wire.dtypes import float32_to_bfloat16_bits  # NOQA: re-exported
from mnopt.wire.dtypes import halfcast as _halfcast
from mnopt.wire.dtypes import storage_dtype  # NOQA: re-exported

#: Default bucket: 1 MiB of wire data.  Measured (docs/benchmarks.md): on
#: 1 Gbit/s links between 4 nodes, MPICH reduces 1 MiB pieces 18-25% faster
#: than 4 MiB ones; in shared memory 1 MiB costs 2-4% more than 4 MiB, and
#: one 100 MiB call is 1.7x slower than either.
DEFAULT_BUCKET_BYTES = 1 << 20

#: Gradients at least this large that need no cast are reduced in place
#: rather than packed (smaller ones are cheaper to batch into buckets).
DEFAULT_IN_PLACE_MIN_BYTES = 64 << 10


def normalize_wire_dtype(dtype):
    """Return the wire dtype's name, or None for "the gradients' own"."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = numpy.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    if name not in WIRE_DTYPES:
        raise ValueError(
            'allreduce_grad_dtype must be one of %s or None, not %r'
            % (', '.join(WIRE_DTYPES), dtype))
    return name


def default_wire_dtype(grad_dtypes):
    """With allreduce_grad_dtype=None, gradients travel in their own dtype;
    a mixed set travels in the widest of them."""
    if not grad_dtypes:
        return 'float32'
    return numpy.result_type(*grad_dtypes).name


# --------------------------------------------------------------- layout

class Layout(object):
    """The names, shapes and dtypes of a set of gradients, in order.

    ``digest`` is a 63-bit hash of everything that must agree across ranks
    before their buffers can be summed element by element.
    """

    def __init__(self, names, shapes, dtypes, wire):
        self.names = tuple(names)
        self.shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        self.dtypes = tuple(numpy.dtype(d).name for d in dtypes)
        self.wire = wire
        self.sizes = [int(numpy.prod(s, dtype=numpy.int64))
                      for s in self.shapes]
        self.offsets = [0]
        for size in self.sizes:
            self.offsets.append(self.offsets[-1] + size)
        self.total = self.offsets[-1]
        self.key = (self.names, self.shapes, self.dtypes, wire)
        h = hashlib.blake2b(repr(self.key).encode(), digest_size=8)
        self.digest = int.from_bytes(h.digest(), 'little') >> 1

    def describe(self, i):
        return '%r %s %s' % (self.names[i], self.shapes[i], self.dtypes[i])

    def first_difference(self, other):
        """A sentence naming the first entry where two layouts differ."""
        for i in range(min(len(self.names), len(other.names))):
            if (self.names[i], self.shapes[i], self.dtypes[i]) != (
                    other.names[i], other.shapes[i], other.dtypes[i]):
                return 'gradient #%d is %s vs %s' % (
                    i, self.describe(i), other.describe(i))
        if len(self.names) != len(other.names):
            n = min(len(self.names), len(other.names))
            extra = self if len(self.names) > n else other
            return '%d vs %d gradients; the first extra one is %s' % (
                len(self.names), len(other.names), extra.describe(n))
        return 'wire dtype %s vs %s' % (self.wire, other.wire)


def make_layout(named_arrays, wire):
    names = [n for n, _ in named_arrays]
    shapes = [a.shape for _, a in named_arrays]
    dtypes = [a.dtype for _, a in named_arrays]
    if wire is None:
        wire = default_wire_dtype(dtypes)
    for name, dtype in zip(names, dtypes):
        if numpy.dtype(dtype).kind != 'f':
            raise TypeError(
                'gradient %r has dtype %s; only float16, float32 and '
                'float64 gradients can be averaged' % (name, dtype))
    return Layout(names, shapes, dtypes, wire)


# --------------------------------------------------------------- host memory

#: The host arrays pinned_host_empty allocated (id -> array), while alive.
_pinned = weakref.WeakValueDictionary()


def pinned_host_empty(n, dtype):
    """A page-locked host array: the host side of every copy to or from a
    GPU buffer, so that the copy runs at full speed and can overlap (a copy
    through pageable memory is staged by the driver and cannot)."""
    from mnopt.gpu.device import pinned_empty
    a = pinned_empty(n, dtype)
    _pinned[id(a)] = a
    return a


def is_pinned_host(a):
    """Whether ``a`` came from pinned_host_empty."""
    return _pinned.get(id(a)) is a


# --------------------------------------------------------------- buffer

class GradBuffer(object):
    """A persistent flat buffer for one gradient layout.

    Each iteration: ``pack`` the gradients, sum ``host_parts()`` across
    ranks in place (one call per part), ``from_host()``, ``unpack``.

    Parts are bucket-sized pieces of the packed buffer (arrays may straddle
    two buckets), or one piece per array (``per_array=True``, the naive
    reference).  With ``in_place_min_bytes``, numpy gradients at least that
    large whose dtype already is the wire dtype skip the buffer: they are
    scaled and summed where they are, in bucket-sized slices, which saves
    the two full copies that packing and unpacking cost.
    """

    def __init__(self, layout, xp=numpy, bucket_bytes=DEFAULT_BUCKET_BYTES,
                 per_array=False, in_place_min_bytes=None):
        self.layout = layout
        self.xp = xp
        self.dtype = storage_dtype(layout.wire)
        self.bucket_elems = max(1, bucket_bytes // self.dtype.itemsize)
        self.in_place = [
            in_place_min_bytes is not None and xp is numpy
            and layout.dtypes[i] == layout.wire
            and size * self.dtype.itemsize >= in_place_min_bytes
            for i, size in enumerate(layout.sizes)]
        # Offsets of the packed arrays inside the buffer.
        self.offsets = [0]
        for size, skip in zip(layout.sizes, self.in_place):
            self.offsets.append(self.offsets[-1] + (0 if skip else size))
        self.wire = xp.empty(self.offsets[-1], dtype=self.dtype)
        if per_array:
            offs = self.offsets
            self.buckets = [slice(offs[i], offs[i + 1])
                            for i in range(len(layout.sizes))
                            if offs[i] != offs[i + 1]]
        else:
            self.buckets = self._slices(self.wire.size)
        self._host = None
        self._in_place_arrays = []
        if xp is not numpy:
            from mnopt.gpu.codec import Codec
            self._codec = Codec(layout.wire, layout.sizes, self.offsets)
            self.device = self.wire.device.id
        else:
            self.device = None
            self._codec = HostCodec(layout.wire)
        self.reset_counts()

    def _count(self, counts, i, n):
        if n is not None:
            counts[i] = n + (counts[i] or 0)

    def reset_counts(self):
        """Per array: gradient values (``nonfinite_in``), and averaged
        values (``nonfinite_out``), that were not finite in the averaging
        since the last reset (16-bit wires on the host; None where not
        counted).  GPU buffers count on the device: ``take_counts`` first."""
        self.nonfinite_in = [None] * len(self.layout.sizes)
        self.nonfinite_out = [None] * len(self.layout.sizes)
        if self.xp is not numpy:
            self._codec.reset()

    def take_counts(self):
        """Bring the counts of a GPU averaging to the host (waits for its
        kernels; the host codec counts as it goes)."""
        if self.xp is not numpy:
            self.nonfinite_in, self.nonfinite_out = \
                self._codec.take_counts()

    def _slices(self, n):
        step = self.bucket_elems
        return [slice(s, min(s + step, n)) for s in range(0, n, step)]

    @property
    def nbytes(self):
        return self.layout.total * self.dtype.itemsize

    def pack(self, arrays, divisor):
        """Packed: wire[...] = cast(array / divisor).  In place: the arrays
        are divided slice by slice in ``host_parts``."""
        offs = self.offsets
        self._in_place_arrays = []
        self._divisor = divisor
        if self.xp is not numpy:  # one batched kernel (mnopt/gpu/codec.py)
            return self._codec.pack(arrays, self.wire, divisor)
        for i, a in enumerate(arrays):
            if self.in_place[i]:
                # A non-contiguous gradient is reduced in a contiguous copy
                # that unpack copies back.
                flat = a.reshape(-1) if a.flags.c_contiguous \
                    else numpy.ascontiguousarray(a).reshape(-1)
                self._in_place_arrays.append(flat)
            elif offs[i] != offs[i + 1]:
                self._count(self.nonfinite_in, i, self._codec.encode(
                    a.reshape(-1), self.wire[offs[i]:offs[i + 1]], divisor))

    # Ranges: a transport that moves the packed buffer piece by piece packs
    # each piece just before it leaves and unpacks each sum as it arrives,
    # hiding both copies behind the network.  numpy, all arrays packed.

    def can_stream(self, arrays):
        return (self.xp is numpy and not any(self.in_place)
                and all(a.flags.c_contiguous for a in arrays))

    def _overlaps(self, lo, hi):
        """(array index, [lo, hi) inside the array, [lo, hi) in the buffer)
        for every array overlapping buffer range [lo, hi)."""
        offs = self.offsets
        i = bisect.bisect_right(offs, lo) - 1
        while i < len(self.layout.sizes) and offs[i] < hi:
            a, b = max(lo, offs[i]), min(hi, offs[i + 1])
            if a < b:
                yield i, slice(a - offs[i], b - offs[i]), slice(a, b)
            i += 1

    def pack_range(self, arrays, lo, hi, divisor):
        for i, inside, packed in self._overlaps(lo, hi):
            self._count(self.nonfinite_in, i, self._codec.encode(
                arrays[i].reshape(-1)[inside], self.wire[packed], divisor))

    def unpack_range(self, arrays, sums, lo, hi):
        """Decode ``sums`` (holding buffer range [lo, hi)) into the arrays."""
        for i, inside, packed in self._overlaps(lo, hi):
            self._count(self.nonfinite_out, i, self._codec.decode(
                sums[packed.start - lo:packed.stop - lo],
                arrays[i].reshape(-1)[inside]))

    def host_parts(self):
        """Yield the contiguous numpy arrays to sum across ranks, in order.

        GPU buffers are first copied to a pinned host mirror (``from_host``
        copies the sums back).  In-place slices are divided just before
        they are yielded, so the reduction finds them still in cache."""
        for part, divide in self._host_parts():
            if divide:
                self.divide(part)
            yield part

    def parts_to_divide(self):
        """(parts, divided): ``host_parts()``'s arrays with the in-place
        slices not yet divided, and per part whether ``divide`` must still
        run on it.  For a sum that first touches each piece of a part at
        another time (mnopt's ring): each piece is divided just before,
        spread over the sum instead of one pass in front of it."""
        parts, divided = [], []
        for part, divide in self._host_parts():
            parts.append(part)
            divided.append(not divide)
        return parts, divided

    def divide(self, part):
        """Divide (a view of) an in-place part by the packing's divisor,
        in place: what ``pack`` does to the packed ones while it casts."""
        numpy.divide(part, self._divisor, out=part)

    def _host_parts(self):
        host = self.wire
        if self.xp is not numpy:
            if self._host is None:
                self._host = self.new_host_buffer()
            self.wire.get(out=self._host)
            host = self._host
        for b in self.buckets:
            yield host[b], False
        for flat in self._in_place_arrays:
            for b in self._slices(flat.size):
                yield flat[b], True

    def from_host(self):
        if self.xp is not numpy:
            self.wire.set(self._host)

    def new_host_buffer(self):
        """An empty host array shaped like the host buffer and allocated as
        it is: pinned for a GPU buffer (the GPU copies to and from it)."""
        if self.xp is numpy:
            return numpy.empty(self.wire.size, self.dtype)
        return pinned_host_empty(self.wire.size, self.dtype)

    def fits_host(self, other):
        """Whether ``other`` can become the host buffer (swap_host)."""
        return (other.shape == (self.wire.size,) and other.dtype == self.dtype
                and (self.xp is numpy or is_pinned_host(other)))

    def swap_host(self, other):
        """Adopt ``other`` (from ``new_host_buffer``, or returned by an
        earlier swap) as the host buffer, for transports whose sums arrive
        in a second buffer; returns the previous one for reuse.  A GPU
        buffer takes only pinned memory: a copy through pageable memory
        cannot overlap."""
        if not self.fits_host(other):
            raise ValueError(
                'swap_host takes a host buffer made by new_host_buffer() '
                '(pinned for a GPU buffer), shaped (%d,) %s; got %s %s%s'
                % (self.wire.size, self.dtype, other.shape, other.dtype,
                   '' if self.xp is numpy else ' (pinned: %s)'
                   % is_pinned_host(other)))
        if self.xp is numpy:
            old, self.wire = self.wire, other
        else:
            old, self._host = self._host, other
        return old

    def unpack(self, arrays):
        """arrays[i][...] = cast back from the wire (in place)."""
        offs = self.offsets
        if self.xp is not numpy:
            return self._codec.unpack(self.wire, arrays)
        in_place = iter(self._in_place_arrays)
        for i, a in enumerate(arrays):
            if self.in_place[i]:
                flat = next(in_place)
                if not numpy.shares_memory(flat, a):
                    a[...] = flat.reshape(a.shape)
            elif offs[i] != offs[i + 1]:
                src = self.wire[offs[i]:offs[i + 1]]
                if a.flags.c_contiguous:
                    n = self._codec.decode(src, a.reshape(-1))
                else:  # reshape(-1) would be a copy: decode, then assign
                    flat = self.xp.empty(a.size, dtype=a.dtype)
                    n = self._codec.decode(src, flat)
                    a[...] = flat.reshape(a.shape)
                self._count(self.nonfinite_out, i, n)
        # The gradients reduced in place are the caller's: keeping them
        # until the next pack held a whole model's gradients alive between
        # updates (102 MB for ResNet-50, docs/zero.md).
        self._in_place_arrays = []


def _fast_path(src, dst):
    """The C loops take contiguous float32 on one side."""
    return (_halfcast is not None and src.flags.c_contiguous
            and dst.flags.c_contiguous)


def _count_nonfinite(a):
    return int(a.size - numpy.count_nonzero(numpy.isfinite(a)))


class HostCodec(object):
    """Casts between gradients and the wire, on the host.

    On the 16-bit wires (the ones a mean can overflow) ``encode`` returns
    how many source values are not finite and ``decode`` how many results
    are not; the C loops count while they convert.  Other wires return
    None (nothing counted)."""

    def __init__(self, wire):
        self.wire = wire
        self.storage = storage_dtype(wire)
        self.counts = wire in ('float16', 'bfloat16')
        self.fast = None
        if _halfcast is not None and self.counts:
            self.fast = (getattr(_halfcast, 'encode_' + wire),
                         getattr(_halfcast, 'decode_' + wire))

    def encode(self, src, dst, divisor):
        if self.fast and src.dtype == numpy.float32 and _fast_path(src, dst):
            return self.fast[0](src, dst.view(numpy.uint16), float(divisor))
        if self.wire == 'bfloat16':
            scaled = numpy.divide(src, divisor, dtype=numpy.float32)
            dst[...] = float32_to_bfloat16_bits(scaled)
        else:
            # Compute in the wider of the two dtypes (never below float32),
            # then round once into the wire dtype.
            compute = numpy.promote_types(
                numpy.promote_types(src.dtype, self.storage), numpy.float32)
            # Overflow into a 16-bit wire is counted and reported by mnopt
            # (mnopt/codecs/overflow.py), not warned about by numpy.
            with numpy.errstate(over='ignore'):
                numpy.divide(src, divisor, out=dst, dtype=compute,
                             casting='unsafe')
        return _count_nonfinite(src) if self.counts else None

    def decode(self, src, dst):
        if self.fast and dst.dtype == numpy.float32 and _fast_path(src, dst):
            return self.fast[1](src.view(numpy.uint16), dst)
        if self.wire == 'bfloat16':
            src = bfloat16_bits_to_float32(src)
        numpy.copyto(dst, src, casting='unsafe')
        return _count_nonfinite(dst) if self.counts else None
