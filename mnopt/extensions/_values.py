"""Reported values (floats, numpy or CuPy scalars, Chainer Variables) as
Python floats, for the object collectives."""


def to_float(value):
    array = getattr(value, 'array', value)   # a chainer.Variable
    if hasattr(array, 'get'):                # a CuPy array
        array = array.get()
    return float(array)
