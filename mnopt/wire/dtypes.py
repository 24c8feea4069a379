"""The wire dtypes: their names, storage, bfloat16 bits, the C loops.

The wire dtypes are float16, bfloat16, float32 and float64.  NumPy has no
bfloat16, so bfloat16 travels as its raw bits in uint16 storage, rounded to
nearest-even from float32.  ``halfcast`` is the optional C loops
(mnopt/wire/_halfcast.c), None where they were not built.  A leaf: the codecs
(mnopt/codecs/grad_buffer.py) and the transport (mnopt/transport/) build on it.
"""

import numpy

try:  # optional C loops for float16/bfloat16 (mnopt/wire/_halfcast.c)
    from mnopt.wire import _halfcast as halfcast
except ImportError:  # no compiler at install time: numpy does it, slower
    halfcast = None
if halfcast is not None and getattr(halfcast, 'API', 1) != 2:
    import warnings
    warnings.warn('mnopt/wire/_halfcast was built from older sources; using '
                  'numpy instead (pip install -e . rebuilds it)')
    halfcast = None

WIRE_DTYPES = ('float16', 'bfloat16', 'float32', 'float64')


def storage_dtype(wire):
    """The numpy dtype that holds ``wire`` values in memory."""
    return numpy.dtype(numpy.uint16 if wire == 'bfloat16' else wire)


# --------------------------------------------------------------- bfloat16

def float32_to_bfloat16_bits(x):
    """Round float32 ``x`` to nearest-even bfloat16; returns uint16 bits."""
    x = numpy.ascontiguousarray(x, dtype=numpy.float32)
    bits = x.view(numpy.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    out = rounded.astype(numpy.uint16)
    # Rounding can carry a NaN's payload into the exponent: keep it NaN.
    nan = numpy.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def bfloat16_bits_to_float32(bits):
    return (numpy.asarray(bits, dtype=numpy.uint16).astype(numpy.uint32)
            << 16).view(numpy.float32)
