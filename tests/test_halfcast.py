"""The C float16/bfloat16 loops are bit-identical to the numpy reference,
on the F16C path and on the portable one."""

import numpy
import pytest

from mnopt.codecs import grad_buffer as gb

# The same at any number of ranks: the serial pass only (see the Makefile).
pytestmark = pytest.mark.one_rank

halfcast = pytest.importorskip(
    'mnopt.wire._halfcast', reason='the optional C extension was not built')


@pytest.fixture(params=['f16c', 'portable'])
def path(request):
    on = halfcast.use_f16c(request.param == 'f16c')
    if request.param == 'f16c' and not on:
        pytest.skip('this CPU has no F16C')
    yield request.param
    halfcast.use_f16c(True)


def float32_samples():
    rng = numpy.random.RandomState(0)
    bits = rng.randint(0, 2 ** 32, size=1 << 20, dtype=numpy.uint64)
    x = bits.astype(numpy.uint32).view(numpy.float32)
    special = numpy.array(
        [0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, 1e9, numpy.inf,
         -numpy.inf, numpy.nan, 2 ** -14, 2 ** -24, 2 ** -25, 1.5 * 2 ** -25,
         2 ** -26, 3e-39, 1 + 2 ** -11, 1 + 3 * 2 ** -11, 1 + 2 ** -8,
         1 + 3 * 2 ** -8], dtype=numpy.float32)
    # Ties and their neighbours in every float16 binade.
    ties = (numpy.arange(-24, 16, dtype=numpy.float32)[:, None],
            numpy.array([1 + 2 ** -11, 1 + 3 * 2 ** -11], numpy.float32))
    ties = (2.0 ** ties[0] * ties[1]).ravel()
    return numpy.concatenate([x, special, -special, ties,
                              numpy.nextafter(ties, 0), numpy.nextafter(
                                  ties, numpy.inf)]).astype(numpy.float32)


def reference_encode(x, wire, divisor):
    scaled = numpy.divide(x, divisor, dtype=numpy.float32)
    if wire == 'float16':
        with numpy.errstate(over='ignore', invalid='ignore'):
            return scaled.astype(numpy.float16).view(numpy.uint16)
    return gb.float32_to_bfloat16_bits(scaled)


def reference_decode(bits, wire):
    if wire == 'float16':
        return bits.view(numpy.float16).astype(numpy.float32)
    return gb.bfloat16_bits_to_float32(bits)


def same_bits_or_both_nan(got, want, wire):
    nan = numpy.isnan(reference_decode(want, wire))
    numpy.testing.assert_array_equal(numpy.isnan(reference_decode(got, wire)),
                                     nan)
    numpy.testing.assert_array_equal(got[~nan], want[~nan])


@pytest.mark.parametrize('wire', ['float16', 'bfloat16'])
@pytest.mark.parametrize('divisor', [1, 2, 3, 7])
def test_encode_matches_numpy(path, wire, divisor):
    x = float32_samples()
    got = numpy.empty(x.size, numpy.uint16)
    with numpy.errstate(over='ignore', invalid='ignore'):
        getattr(halfcast, 'encode_' + wire)(x, got, float(divisor))
        want = reference_encode(x, wire, divisor)
    same_bits_or_both_nan(got, want, wire)


@pytest.mark.parametrize('wire', ['float16', 'bfloat16'])
def test_decode_matches_numpy_for_every_bit_pattern(path, wire):
    bits = numpy.arange(1 << 16, dtype=numpy.uint32).astype(numpy.uint16)
    got = numpy.empty(bits.size, numpy.float32)
    getattr(halfcast, 'decode_' + wire)(bits, got)
    numpy.testing.assert_array_equal(got, reference_decode(bits, wire))


@pytest.mark.parametrize('wire', ['float16', 'bfloat16'])
def test_sum_matches_numpy(path, wire):
    rng = numpy.random.RandomState(1)
    a = rng.randint(0, 1 << 16, size=1 << 18).astype(numpy.uint16)
    b = rng.randint(0, 1 << 16, size=1 << 18).astype(numpy.uint16)
    with numpy.errstate(over='ignore', invalid='ignore'):
        total = reference_decode(a, wire) + reference_decode(b, wire)
        want = reference_encode(total, wire, 1)
    got = b.copy()
    getattr(halfcast, 'sum_' + wire)(a, got)
    same_bits_or_both_nan(got, want, wire)


def test_mismatched_buffers_are_refused():
    with pytest.raises(ValueError, match='same number of elements'):
        halfcast.encode_float16(numpy.zeros(4, numpy.float32),
                                numpy.zeros(3, numpy.uint16), 1.0)
