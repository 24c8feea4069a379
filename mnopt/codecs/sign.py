"""Sign compression: signSGD with majority vote and error feedback.

Every worker turns its gradient ``g`` (plus its error-feedback residual
``e``) into one sign bit per element and one scale per array:

    p = g + e;  scale_w = mean(|p|) per array;  bits = p > 0
    e <- p - scale_w * sign(p)                 (error feedback, local)

The workers then *vote*: element by element, the majority of their signs.
Every rank ends with the same result, ``mean_w(scale_w) * majority``.

Ties (only possible for an even number of workers) and exact zeros are
decided by a coin: a hash of the element's index in the packed buffer and
the step number.  It is the same on every rank and every communicator,
changes from step to step (no element drifts one way), and needs no extra
bits on the wire.

How the vote travels is the communicator's business:

- ``counting_ring_vote`` (flat, hierarchical): the all-reducible signSGD
  ring.  The reduce-scatter passes per-element counts bit-packed with
  ceil(log2(i+1)) bits when they cover i workers; the all-gather passes the
  majority, 1 bit per element.
- ``alltoall_vote`` (``vote='alltoall'``): 1-bit Adam's scheme (Tang et
  al.).  An all-to-all hands every rank one segment of everyone's bits, it
  counts them, and an all-gather spreads the majority bits: about 2 bits
  per element and 2 message rounds for any N, but every rank talks to
  every other, so a slow link between two halves of the job carries
  O(N K) bits where the ring's two crossings carry O(K log N).
- the reduction server (mnopt/server/process.py, wire 'sign'): workers
  push their packed bits, servers count and push back the majority bits.

Bits are packed 8 elements per byte (numpy/cupy ``packbits``, big-endian
bit order within a byte), so buffers of K elements are ceil(K/8) bytes.

One idea, over 400 lines: sign compression, the codec that turns
gradients into sign bits and back and the votes that combine every
worker's bits (mnopt/averaging/compression.py calls them).
"""

import math

import numpy
from mpi4py import MPI

from mnopt.codecs import grad_buffer
from mnopt.transport import waiting

try:  # optional one-pass C loops (mnopt/codecs/_signbits.c), bit-identical
    from mnopt.codecs import _signbits
except ImportError:  # pragma: no cover - built without a C compiler
    _signbits = None


VOTES = ('ring', 'alltoall')  # how ring communicators vote; see above


def normalize_vote(vote):
    if vote is None:
        return 'ring'
    if vote not in VOTES:
        raise ValueError('unknown vote %r; choose one of %s'
                         % (vote, ', '.join(repr(v) for v in VOTES)))
    return vote


# ------------------------------------------------------------------ coin

def coin(index, step):
    """Pseudo-random bits (0/1, uint8) for element indices ``index`` (uint64
    array) at ``step``: splitmix64 of index and step, top bit.  Any array
    module."""
    xp = _xp(index)
    with numpy.errstate(over='ignore'):
        z = index.astype(xp.uint64) + xp.uint64(
            (0x9E3779B97F4A7C15 * (step + 1)) & 0xFFFFFFFFFFFFFFFF)
        z = (z ^ (z >> xp.uint64(30))) * xp.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> xp.uint64(27))) * xp.uint64(0x94D049BB133111EB)
        z = z ^ (z >> xp.uint64(31))
    return (z >> xp.uint64(63)).astype(xp.uint8)


def to_host(array):
    """A device array as numpy (CuPy: one copy, waiting for the work that
    makes it); numpy arrays as they are."""
    get = getattr(array, 'get', None)
    return numpy.asarray(array if get is None else get())


def _xp(array):
    if type(array).__module__.split('.')[0] == 'cupy':
        import cupy
        return cupy
    return numpy


def majority_bits(counts, n_voters, first_index, step):
    """Majority of ``n_voters`` from per-element counts of positive votes
    (elements ``first_index`` onward): uint8 0/1, ties by the coin."""
    xp = _xp(counts)
    twice = counts.astype(xp.int32) * 2
    out = (twice > n_voters).astype(xp.uint8)
    if n_voters % 2 == 0:
        tie = xp.nonzero(twice == n_voters)[0]
        if tie.size:
            out[tie] = coin(tie.astype(xp.uint64) + xp.uint64(first_index),
                            step)
    return out


# ------------------------------------------------------------------ codec

class SignCodec(object):
    """One worker's side of the vote for one gradient layout: the residual
    (error feedback), signs and scales in, the voted gradients out."""

    def __init__(self, layout, xp=numpy, error_feedback=True):
        self.layout = layout
        self.xp = xp
        self.error_feedback = error_feedback
        self.offsets = numpy.cumsum([0] + list(layout.sizes))
        self.total = int(self.offsets[-1])
        self.n_bytes = (self.total + 7) // 8
        self.p = xp.zeros(self.total, dtype=xp.float32)
        self.residual = xp.zeros(self.total, dtype=xp.float32) \
            if error_feedback else None
        self._bits = None
        # A device codec's bits and majority pass through host memory (the
        # vote is MPI's): pinned buffers, kept, so the copies run at full
        # speed (a pageable one is staged by the driver).
        self._host_bits = self._host_majority = None

    def bits_to_host(self, bits):
        """``encode``'s bits in host memory: themselves for a numpy codec,
        else copied into this codec's pinned buffer (overwritten by the
        next call)."""
        if self.xp is numpy:
            return bits
        if self._host_bits is None:
            self._host_bits = grad_buffer.pinned_host_empty(self.n_bytes,
                                                            numpy.uint8)
        return bits.get(out=self._host_bits)

    def majority_to_device(self, majority):
        """The voted bits (host) where ``decode`` reads them: themselves
        for a numpy codec, else copied to the device through this codec's
        pinned buffer."""
        if self.xp is numpy:
            return majority
        if self._host_majority is None:
            self._host_majority = grad_buffer.pinned_host_empty(
                self.n_bytes, numpy.uint8)
        self._host_majority[...] = majority
        return self.xp.asarray(self._host_majority)

    def encode(self, arrays, step):
        """(packed sign bits, per-array scales as float64 numpy)."""
        xp, p, offs = self.xp, self.p, self.offsets
        if xp is not numpy:
            return self._encode_on_device(arrays, step)
        fast = xp is numpy and _signbits is not None
        if fast and self._bits is None:  # each step writes every element's
            # bit; the padding after the last stays 0, as packbits makes it
            self._bits = numpy.zeros(self.n_bytes, numpy.uint8)
        scales = numpy.zeros(len(arrays), numpy.float64)
        # Array by array, so each is still in cache for its next pass.
        for i, a in enumerate(arrays):
            lo, hi = offs[i], offs[i + 1]
            if hi == lo:
                continue
            p[lo:hi] = a.reshape(-1)
            residual = None if self.residual is None else self.residual[lo:hi]
            if residual is not None:
                p[lo:hi] += residual
            scales[i] = float(xp.abs(p[lo:hi]).sum(dtype=xp.float64)) \
                / (hi - lo)
            if fast:
                _signbits.encode(p[lo:hi], scales[i], self._bits, lo, step,
                                 residual)
        if fast:
            return self._bits, scales
        positive = (p > 0).view(xp.uint8)
        zero = xp.nonzero(p == 0)[0]
        if zero.size:
            positive[zero] = coin(zero.astype(xp.uint64), step)
        if self.residual is not None:
            for i in range(len(arrays)):
                lo, hi = offs[i], offs[i + 1]
                # e = p - scale * sign(p), the sign being the bit voted.
                both = xp.array([-scales[i], scales[i]], xp.float32)
                xp.subtract(p[lo:hi], both[positive[lo:hi]],
                            out=self.residual[lo:hi])
        return xp.packbits(positive), scales

    def _encode_on_device(self, arrays, step):
        """encode for device arrays: whole-buffer passes where numpy goes
        array by array (for its cache), and every array's scale brought to
        the host at once (one synchronisation, not one per array).  The
        numbers are numpy's: the same sums of |p| over the same slices."""
        xp, p, offs = self.xp, self.p, self.offsets
        for i, a in enumerate(arrays):
            if offs[i + 1] > offs[i]:
                p[offs[i]:offs[i + 1]] = a.reshape(-1)
        if self.residual is not None:
            p += self.residual
        filled = [i for i in range(len(arrays)) if offs[i + 1] > offs[i]]
        scales = numpy.zeros(len(arrays), numpy.float64)
        if filled:
            magnitude = xp.abs(p)
            sums = xp.stack([magnitude[offs[i]:offs[i + 1]].sum(
                dtype=xp.float64) for i in filled])
            # float(sum) / size, as the host path divides.
            scales[filled] = to_host(sums) / (offs[1:] - offs[:-1])[filled]
        positive = (p > 0).view(xp.uint8)
        zero = xp.nonzero(p == 0)[0]
        if zero.size:
            positive[zero] = coin(zero.astype(xp.uint64), step)
        if self.residual is not None:
            # e = p - scale * sign(p), the sign being the bit voted; every
            # array's (-scale, +scale) in one copy to the device.
            both = xp.asarray(numpy.stack([-scales, scales], axis=1)
                              .astype(numpy.float32))
            for i in filled:
                lo, hi = offs[i], offs[i + 1]
                xp.subtract(p[lo:hi], both[i][positive[lo:hi]],
                            out=self.residual[lo:hi])
        return xp.packbits(positive), scales

    def decode(self, majority, mean_scales, arrays):
        """arrays[i][...] = mean_scales[i] * (+1 or -1 as voted)."""
        xp, offs = self.xp, self.offsets
        bits = None
        for i, a in enumerate(arrays):
            if _signbits is not None and isinstance(a, numpy.ndarray) \
                    and a.dtype == numpy.float32 and a.flags.c_contiguous:
                _signbits.decode(majority, offs[i], mean_scales[i], a)
                continue
            if bits is None:
                bits = xp.unpackbits(majority)
            both = xp.array([-mean_scales[i], mean_scales[i]], xp.float32)
            a[...] = both[bits[offs[i]:offs[i + 1]]].reshape(a.shape)


def mean_scales(comm, scales):
    """Every rank's per-array scales, averaged identically on every rank
    (gathered, then summed in rank order)."""
    gathered = numpy.empty((comm.size, scales.size), numpy.float64)
    mine = numpy.ascontiguousarray(scales, numpy.float64)
    waiting.wait_all([comm.Iallgather(mine, gathered)])
    total = numpy.zeros(scales.size, numpy.float64)
    for row in gathered:
        total += row
    return (total / comm.size).astype(numpy.float32)


# ------------------------------------------------------------------ ring

def count_bits(n_counted):
    """Bits to carry a count of positive votes among ``n_counted`` workers
    (0..n_counted): ceil(log2(n_counted + 1))."""
    return max(1, int(math.ceil(math.log2(n_counted + 1))))


def pack_counts(counts, bits):
    """Counts (< 2**bits) as ``bits`` bit-planes, each packed 8 per byte."""
    xp = _xp(counts)
    if _fast_counts(counts):
        out = numpy.empty(bits * ((counts.size + 7) // 8), numpy.uint8)
        _signbits.pack_counts(counts, bits, out)
        return out
    planes = [xp.packbits(((counts >> k) & 1).astype(xp.uint8))
              for k in range(bits)]
    return xp.concatenate(planes) if planes else xp.zeros(0, xp.uint8)


def unpack_counts(packed, bits, n, dtype):
    xp = _xp(packed)
    counts = xp.zeros(n, dtype)
    if _fast_counts(counts):
        _signbits.unpack_counts(packed, bits, counts)
        return counts
    plane_bytes = (n + 7) // 8
    for k in range(bits):
        plane = xp.unpackbits(packed[k * plane_bytes:(k + 1) * plane_bytes])
        counts += plane[:n].astype(dtype) << k
    return counts


def add_bits(counts, bits, first):
    """counts += the 0/1 bits of elements first.. of packed ``bits``."""
    if _fast_counts(counts):
        _signbits.add_bits(bits, first, counts)
        return
    xp = _xp(counts)
    lo = first // 8
    plane = xp.unpackbits(bits[lo:(first + counts.size + 7) // 8 + 1])
    counts += plane[first - 8 * lo:first - 8 * lo + counts.size]


def _fast_counts(counts):
    return (_signbits is not None and isinstance(counts, numpy.ndarray)
            and counts.dtype == numpy.uint8)


def segment_bounds(n_elements, n_segments):
    """Near-equal segments whose starts are multiples of 8 elements, so each
    starts on a byte of the packed bits."""
    n_bytes = (n_elements + 7) // 8
    return [min(n_elements, 8 * (n_bytes * i // n_segments))
            for i in range(n_segments + 1)]


def counting_ring_vote(comm, bits, n_elements, step, stats=None):
    """Majority of every rank's packed sign ``bits`` (numpy uint8, ceil(n/8)
    bytes) over ``comm``, on a ring: returns the packed majority bits, the
    same on every rank.  ``stats`` (a dict), if given, gets the bytes this
    rank sent."""
    size, rank = comm.size, comm.rank
    if size == 1 or n_elements == 0:
        return bits.copy()
    bounds = segment_bounds(n_elements, size)
    count_dtype = numpy.uint8 if size < 256 else numpy.uint16
    right, left = (rank + 1) % size, (rank - 1) % size
    tag = 0x516
    sent = 0

    def seg(i):
        i %= size
        return bounds[i], bounds[i + 1]

    # Reduce-scatter: at step s the counts passed on cover s + 1 workers.
    lo, hi = seg(rank)
    counts = numpy.zeros(hi - lo, count_dtype)
    add_bits(counts, bits, lo)
    for s in range(size - 1):
        out = pack_counts(counts, count_bits(s + 1))
        lo, hi = seg(rank - s - 1)
        got = numpy.empty(count_bits(s + 1) * ((hi - lo + 7) // 8), numpy.uint8)
        comm.Sendrecv([out, MPI.BYTE], right, tag,
                      [got, MPI.BYTE], left, tag)
        sent += out.size
        counts = unpack_counts(got, count_bits(s + 1), hi - lo, count_dtype)
        add_bits(counts, bits, lo)
    # This rank now holds every worker's count for segment rank + 1.
    lo, hi = seg(rank + 1)
    majority = numpy.empty((n_elements + 7) // 8, numpy.uint8)
    majority[lo // 8:(hi + 7) // 8] = numpy.packbits(
        majority_bits(counts, size, lo, step))
    # All-gather: 1 bit per element.
    for s in range(size - 1):
        out_lo, out_hi = seg(rank + 1 - s)
        in_lo, in_hi = seg(rank - s)
        out = majority[out_lo // 8:(out_hi + 7) // 8]
        into = majority[in_lo // 8:(in_hi + 7) // 8]
        comm.Sendrecv([out, MPI.BYTE], right, tag,
                      [into, MPI.BYTE], left, tag)
        sent += out.size
    if stats is not None:
        stats['bytes_sent'] = stats.get('bytes_sent', 0) + sent
    return majority


# ------------------------------------------------------------------ all-to-all

def alltoall_vote(comm, bits, n_elements, step, stats=None):
    """Majority of every rank's packed sign ``bits`` over ``comm`` as 1-bit
    Adam does it: rank r gets segment r of everyone's bits (all-to-all),
    counts them, and the majority segments are all-gathered.  Same result
    as ``counting_ring_vote``.  ``stats['bytes_sent']`` gets the bytes of
    this rank's own data that leave it: its other ranks' segments, then its
    majority segment to each other rank (MPICH picks the paths)."""
    size, rank = comm.size, comm.rank
    if size == 1 or n_elements == 0:
        return bits.copy()
    bounds = segment_bounds(n_elements, size)
    # Segments start on multiples of 8 elements: byte ranges do not overlap.
    first = [b // 8 for b in bounds[:-1]]
    nbytes = [(hi + 7) // 8 - lo // 8 for lo, hi in zip(bounds, bounds[1:])]
    mine = nbytes[rank]
    gathered = numpy.empty((size, mine), numpy.uint8)
    comm.Alltoallv([bits, (nbytes, first), MPI.BYTE],
                   [gathered, ([mine] * size, [mine * r for r in range(size)]),
                    MPI.BYTE])
    lo, hi = bounds[rank], bounds[rank + 1]
    count_dtype = numpy.uint8 if size < 256 else numpy.uint16
    counts = numpy.zeros(hi - lo, count_dtype)
    for row in gathered:
        add_bits(counts, row, 0)
    majority = numpy.empty((n_elements + 7) // 8, numpy.uint8)
    majority[first[rank]:first[rank] + mine] = numpy.packbits(
        majority_bits(counts, size, lo, step))
    comm.Allgatherv(MPI.IN_PLACE,
                    [majority, (nbytes, first), MPI.BYTE])
    if stats is not None:
        sent = sum(nbytes) - mine + mine * (size - 1)
        stats['bytes_sent'] = stats.get('bytes_sent', 0) + sent
    return majority
