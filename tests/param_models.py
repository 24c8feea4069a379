"""Models and gradients for averaging tests, for the tests and for the
jobs they spawn: it imports no pytest (which a job would pay for in every
rank's start-up, as it would conftest's own set-up)."""

import importlib.util

import numpy

# Before Chainer: a checkout run from PYTHONPATH (no .pth installed) gets
# Chainer's NumPy 2 names from mnopt's import.
import mnopt  # NOQA

# The core stack has no Chainer; elsewhere a Chainer that fails to import
# must fail the run, not skip the Chainer layer's tests.
if importlib.util.find_spec('chainer') is None:
    chainer = None
else:
    import chainer


class _Param(object):
    def __init__(self, array):
        self.array, self.grad = array, None

    @property
    def shape(self):
        return self.array.shape


class _Model(object):
    """What communicators read of a Chainer Link: ``namedparams()``, and
    each parameter as an attribute."""

    def __init__(self, params):
        self._params = params
        for name, param in params:
            setattr(self, name.lstrip('/'), param)

    def namedparams(self):
        return iter(self._params)


def make_model(shapes, dtype=numpy.float32):
    """A Link with one parameter per shape, named p000, p001, ...; without
    Chainer, an object with the same ``namedparams()``."""
    if chainer is None:
        return _Model([('/p%03d' % i, _Param(numpy.zeros(s, dtype=dtype)))
                       for i, s in enumerate(shapes)])
    link = chainer.Link()
    with link.init_scope():
        for i, shape in enumerate(shapes):
            setattr(link, 'p%03d' % i,
                    chainer.Parameter(numpy.zeros(shape, dtype=dtype)))
    return link


def rank_grads(shapes, dtype, rank):
    """Gradient k of parameter i on ``rank``: rank + a per-element pattern,
    so the mean over ranks is (size - 1) / 2 + pattern."""
    return [(numpy.arange(int(numpy.prod(s))).reshape(s) % 13 * 0.25 - 1.5
             + i + rank).astype(dtype) for i, s in enumerate(shapes)]


def expected_mean(shapes, size):
    return [g + (size - 1) / 2.0 for g in rank_grads(shapes, numpy.float64, 0)]
