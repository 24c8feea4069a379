"""The GPU codec: gradients to a wire buffer and back, one launch per dtype."""

from mnopt.gpu.device import cupy
from mnopt.gpu.kernels import CHUNK_BITS, VEC, kernel, kernel_name


class Codec(object):
    """GPU twin of grad_buffer.HostCodec: packs a whole gradient set into a
    wire buffer (``offsets[k]``: where array k starts in it) and unpacks
    it, one kernel launch per gradient dtype.

    On 16-bit wires it counts non-finite values per array in device memory
    (slots 0..n-1 for the gradients going in, n..2n-1 for the means coming
    out); ``take_counts`` brings them to the host.  Other wires count
    nothing."""

    def __init__(self, wire, sizes, offsets):
        cp = cupy()
        self.wire = wire
        self.n = len(sizes)
        self.sizes = list(sizes)
        self.offsets = list(offsets)
        self.counted = wire in ('float16', 'bfloat16')
        self.counts = cp.zeros(2 * self.n if self.counted else 0,
                               dtype='int32')
        self._tables = {}   # (dtype, slot base) -> device index tables
        self._ptrs = {}     # dtype -> (pointers, their device copy)

    def reset(self):
        self.counts.fill(0)

    def _launch(self, direction, arrays, wire, extra=()):
        """Run the pack or unpack kernel over ``arrays`` (contiguous, all
        non-empty ones) grouped by dtype."""
        import numpy
        cp = cupy()
        groups = {}
        for k, a in enumerate(arrays):
            if self.sizes[k]:
                groups.setdefault(a.dtype, []).append(k)
        base = 0 if direction == 'pack' else self.n
        for dtype, ks in groups.items():
            key = (dtype, base, tuple(ks))
            tables = self._tables.get(key)
            if tables is None:
                tables = self._tables[key] = self._make_tables(ks, base)
            ptrs = tuple(arrays[k].data.ptr for k in ks)
            cached = self._ptrs.get((dtype, base))
            if cached is None or cached[0] != ptrs:
                # Pageable to device: staged at once, no synchronisation.
                cached = self._ptrs[(dtype, base)] = (
                    ptrs, cp.asarray(numpy.array(ptrs, numpy.uint64)))
            kernel(kernel_name(direction, self.wire))(
                cached[1], *(tables[:-1] + (arrays[ks[0]],) + tuple(extra)
                             + (self.counts, wire)), size=tables[-1] // VEC)

    def _make_tables(self, ks, base):
        """The device tables of the arrays ``ks`` (see KERNELS), and the
        launch's size."""
        import numpy
        cp = cupy()
        sizes = numpy.array([self.sizes[k] for k in ks], numpy.int64)
        chunks = (sizes + (1 << CHUNK_BITS) - 1) >> CHUNK_BITS
        vstarts = numpy.concatenate([[0], numpy.cumsum(chunks)[:-1]]) \
            << CHUNK_BITS
        chunk_entry = numpy.repeat(numpy.arange(len(ks), dtype=numpy.int32),
                                   chunks)
        return (cp.asarray(chunk_entry), cp.asarray(vstarts),
                cp.asarray(sizes),
                cp.asarray(numpy.array([self.offsets[k] for k in ks],
                                       numpy.int64)),
                cp.asarray(numpy.array([base + k for k in ks], numpy.int32)),
                int(chunks.sum()) << CHUNK_BITS)

    def pack(self, arrays, wire, divisor):
        """wire[offsets[k]:] = cast(arrays[k] / divisor), for every k."""
        cp = cupy()
        arrays = [cp.ascontiguousarray(a) for a in arrays]
        self._launch('pack', arrays, wire, (float(divisor),))

    def unpack(self, wire, arrays):
        """arrays[k][...] = cast back from the wire, for every k."""
        cp = cupy()
        flat = [a if a.flags.c_contiguous else cp.empty(a.shape, a.dtype)
                for a in arrays]
        self._launch('unpack', flat, wire)
        for a, f in zip(arrays, flat):
            if f is not a:
                a[...] = f

    def take_counts(self):
        """(non-finite gradient values in, non-finite means out) per array
        as host lists, None where not counted.  Waits for the kernels."""
        if not self.counted:
            return [None] * self.n, [None] * self.n
        counts = [c if size else None   # as the host codec: empty arrays
                  for c, size in zip(self.counts.get().tolist(),
                                     self.sizes * 2)]   # are not counted
        return counts[:self.n], counts[self.n:]

