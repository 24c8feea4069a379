"""How wire values are summed: MPI's datatypes and ops for each wire, and
the 16-bit sum loops that MPI's user ops and the ring share.

MPI has no 16-bit float types: float16 and bfloat16 travel as 16-bit
integers and are summed by mnopt's loops (the C loops of
mnopt/wire/_halfcast.c where built, else numpy), each pairwise sum computed in
float32 and rounded once.
"""

import numpy
from mpi4py import MPI

from mnopt.wire import dtypes as wire_dtypes


def _float16_sum(inbuf, inoutbuf, datatype):
    a = numpy.frombuffer(inbuf, numpy.float16)
    b = numpy.frombuffer(inoutbuf, numpy.float16)
    numpy.add(a, b, out=b)


def _bfloat16_sum(inbuf, inoutbuf, datatype):
    a = wire_dtypes.bfloat16_bits_to_float32(
        numpy.frombuffer(inbuf, numpy.uint16))
    b = numpy.frombuffer(inoutbuf, numpy.uint16)
    total = a + wire_dtypes.bfloat16_bits_to_float32(b)
    b[...] = wire_dtypes.float32_to_bfloat16_bits(total)


def _fast_sum(name):
    fn = getattr(wire_dtypes.halfcast, 'sum_' + name)
    return lambda inbuf, inoutbuf, datatype: fn(inbuf, inoutbuf)


#: The MPI datatype each wire travels as.
MPI_TYPES = {'float32': MPI.FLOAT, 'float64': MPI.DOUBLE,
             'float16': MPI.UINT16_T, 'bfloat16': MPI.UINT16_T}
#: MPI user-op functions ``fn(inbuf, inoutbuf, datatype)`` for the wires
#: MPI cannot sum itself.  Each pairwise sum is computed in float32 and
#: rounded once; the C loops (when built) and numpy give bit-identical
#: results.
SUM_FUNCS = ({'float16': _fast_sum('float16'),
              'bfloat16': _fast_sum('bfloat16')}
             if wire_dtypes.halfcast is not None else
             {'float16': _float16_sum, 'bfloat16': _bfloat16_sum})
_sum_ops = {}


def wire_sum(wire):
    """(MPI datatype, MPI op) that sum ``wire`` values.

    MPI has no 16-bit float types, so float16 and bfloat16 travel as 16-bit
    integers and are summed by a user op (each pairwise sum rounded once).
    """
    if wire not in SUM_FUNCS:
        return MPI_TYPES[wire], MPI.SUM
    if wire not in _sum_ops:
        _sum_ops[wire] = MPI.Op.Create(SUM_FUNCS[wire], commute=True)
    return MPI_TYPES[wire], _sum_ops[wire]


def sum_into(wire):
    """fn(a, b): b += a for numpy arrays of the wire's storage dtype."""
    fn = SUM_FUNCS[wire]
    return lambda a, b: fn(a, b, None)

