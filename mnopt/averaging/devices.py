"""Which GPU a set of named arrays lives on, and entering it."""

import contextlib

import numpy


def device_of(named, xp):
    """The GPU holding the arrays of ``named``, None for numpy ones."""
    if xp is numpy:
        return None
    from mnopt.gpu.device import device_id
    return device_id([a for _, a in named])


def on_device(xp, named):
    """The context of the arrays' GPU (a no-op for numpy arrays)."""
    if xp is numpy:
        return contextlib.nullcontext()
    return xp.cuda.Device(device_of(named, xp))
