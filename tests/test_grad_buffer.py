"""The packing/casting module, on one process."""

import numpy
import pytest

from mnopt.codecs import grad_buffer as gb

# The same at any number of ranks: the serial pass only (see the Makefile).
pytestmark = pytest.mark.one_rank


def test_bfloat16_rounds_to_nearest_even():
    # 1 + 2^-8 is halfway between bfloat16 neighbours 1 and 1 + 2^-7: ties
    # go to the even one (1.0); just above halfway rounds up.
    x = numpy.array([1.0, 1 + 2 ** -8, 1 + 2 ** -8 + 2 ** -20,
                     1 + 3 * 2 ** -8, -2.5, 65504.0, numpy.inf, -numpy.inf],
                    dtype=numpy.float32)
    y = gb.bfloat16_bits_to_float32(gb.float32_to_bfloat16_bits(x))
    numpy.testing.assert_array_equal(
        y, numpy.array([1.0, 1.0, 1 + 2 ** -7, 1 + 2 ** -6, -2.5,
                        65536.0,
                        numpy.inf, -numpy.inf], dtype=numpy.float32))


def test_bfloat16_keeps_nan():
    x = numpy.array([numpy.nan, -numpy.nan], dtype=numpy.float32)
    x.view(numpy.uint32)[1] = 0x7F800001  # signalling NaN, tiny payload
    y = gb.bfloat16_bits_to_float32(gb.float32_to_bfloat16_bits(x))
    assert numpy.isnan(y).all()


def test_bfloat16_round_trip_is_exact_for_representable_values():
    bits = numpy.arange(0, 0x7F80, dtype=numpy.uint16)  # all finite >= 0
    f = gb.bfloat16_bits_to_float32(bits)
    numpy.testing.assert_array_equal(gb.float32_to_bfloat16_bits(f), bits)


@pytest.mark.parametrize('bad', ['float8', 'int32', numpy.int64, 'fp16', 3])
def test_unknown_wire_dtype_lists_choices(bad):
    with pytest.raises(ValueError, match='float16, bfloat16, float32, float64'):
        gb.normalize_wire_dtype(bad)


@pytest.mark.parametrize('given,name', [
    (numpy.float16, 'float16'), ('bfloat16', 'bfloat16'),
    (numpy.dtype('float32'), 'float32'), (None, None)])
def test_wire_dtype_spellings(given, name):
    assert gb.normalize_wire_dtype(given) == name


def test_default_wire_dtype_is_the_widest_gradient_dtype():
    assert gb.default_wire_dtype([numpy.float16]) == 'float16'
    assert gb.default_wire_dtype([numpy.float16, numpy.float32]) == 'float32'
    assert gb.default_wire_dtype([numpy.float64, numpy.float32]) == 'float64'


def test_integer_gradients_are_refused():
    with pytest.raises(TypeError, match="'w' has dtype int32"):
        gb.make_layout([('w', numpy.zeros(3, numpy.int32))], None)


@pytest.mark.parametrize('wire', gb.WIRE_DTYPES)
@pytest.mark.parametrize('grad_dtype', ['float16', 'float32', 'float64'])
@pytest.mark.parametrize('opts', [
    {'per_array': True}, {'bucket_bytes': 6}, {'bucket_bytes': 1 << 20},
    {'bucket_bytes': 10, 'in_place_min_bytes': 16}],
    ids=['per-array', 'tiny-buckets', 'one-bucket', 'in-place'])
def test_pack_then_unpack_yields_scaled_gradients(wire, grad_dtype, opts):
    shapes = [(3, 5), (1,), (0,), (7, 1, 2), (4, 6)]
    arrays = [(numpy.arange(numpy.prod(s)).reshape(s) * 0.5 - 2)
              .astype(grad_dtype) for s in shapes]
    arrays[4] = numpy.asfortranarray(arrays[4])  # not C-contiguous
    original = [a.copy() for a in arrays]
    layout = gb.make_layout([('a%d' % i, a) for i, a in enumerate(arrays)],
                            wire)
    buf = gb.GradBuffer(layout, **opts)
    buf.pack(arrays, 2)
    parts = list(buf.host_parts())
    # Every element is in exactly one part (so is summed exactly once).
    assert sum(p.size for p in parts) == layout.total
    in_place = opts.get('in_place_min_bytes') and grad_dtype == wire
    assert any(buf.in_place) == bool(in_place)
    packed = numpy.concatenate(
        [a.ravel() / 2 for a, ip in zip(original, buf.in_place) if not ip]
        + [numpy.zeros(0)])
    decoded = buf.wire if wire != 'bfloat16' else \
        gb.bfloat16_bits_to_float32(buf.wire)
    numpy.testing.assert_array_equal(decoded, packed.astype(decoded.dtype))
    buf.from_host()
    buf.unpack(arrays)
    for a, o in zip(original, arrays):
        # Every value here (k/4 - 1) is exact in every dtype.
        numpy.testing.assert_array_equal(a / 2, o)
        assert o.dtype == a.dtype


def test_a_buffer_lets_go_of_gradients_reduced_in_place():
    # Kept until the next pack, they held a model's gradients alive
    # between updates.
    import gc
    import weakref
    grad = numpy.ones(64, numpy.float32)
    buf = gb.GradBuffer(gb.make_layout([('w', grad)], 'float32'),
                        in_place_min_bytes=16)
    buf.pack([grad], 2)
    list(buf.host_parts())
    buf.unpack([grad])
    assert (grad == 0.5).all()
    held = weakref.ref(grad)
    del grad
    gc.collect()
    assert held() is None


@pytest.mark.parametrize('wire', gb.WIRE_DTYPES)
def test_packing_by_ranges_equals_packing_at_once(wire):
    rng = numpy.random.RandomState(0)
    shapes = [(3, 5), (1,), (0,), (7, 1, 2), (40,)]
    arrays = [rng.standard_normal(s).astype(numpy.float32) for s in shapes]
    layout = gb.make_layout([('a%d' % i, a) for i, a in enumerate(arrays)],
                            wire)
    whole, ranged = gb.GradBuffer(layout), gb.GradBuffer(layout)
    assert ranged.can_stream(arrays)
    assert not ranged.can_stream(arrays[:4] + [arrays[4][::2]])
    whole.pack(arrays, 3)
    cuts = [0, 1, 2, 9, 15, 16, 30, 31, layout.total]  # across arrays too
    for lo, hi in zip(cuts, cuts[1:]):
        ranged.pack_range(arrays, lo, hi, 3)
    numpy.testing.assert_array_equal(ranged.wire, whole.wire)
    sums = numpy.flip(whole.wire).copy()  # any values will do
    want = [a.copy() for a in arrays]
    whole.swap_host(sums.copy())
    whole.unpack(want)
    got = [numpy.zeros_like(a) for a in arrays]
    for lo, hi in zip(cuts[::-1][1:], cuts[::-1]):  # any order
        ranged.unpack_range(got, sums[lo:hi], lo, hi)
    for g, w in zip(got, want):
        numpy.testing.assert_array_equal(g, w)


def test_fp16_wire_does_not_overflow_where_the_mean_fits():
    # ChainerMN sums first: 2 x 60000 overflows float16 (max 65504).
    named = [('g', numpy.full(4, 60000, numpy.float32))]
    buf = gb.GradBuffer(gb.make_layout(named, 'float16'))
    buf.pack([named[0][1]], 2)
    total = buf.wire + buf.wire  # what the sum over two ranks computes
    assert numpy.isfinite(total).all()
    numpy.testing.assert_array_equal(total, 60000)


def test_layout_first_difference_names_the_entry():
    a = gb.make_layout([('x', numpy.zeros((2, 3))), ('y', numpy.zeros(4))],
                       'float32')
    b = gb.make_layout([('x', numpy.zeros((2, 3))), ('y', numpy.zeros(5))],
                       'float32')
    c = gb.make_layout([('x', numpy.zeros((2, 3)))], 'float32')
    assert a.digest != b.digest
    assert "'y' (4,) float64 vs 'y' (5,) float64" in a.first_difference(b)
    assert "2 vs 1 gradients; the first extra one is 'y'" in \
        a.first_difference(c)
