"""The checks of the keyword arguments every communicator takes: refused
without communicating, so that the factory can check them on every rank
before any collective."""

import os

import numpy

from mnopt import grad_buffer
from mnopt import overflow
from mnopt import sign
from mnopt import stall_settings
from mnopt.communicators import tuning
from mnopt.communicators.settings import environment_settings


def whole_argument(name, value, minimum):
    """``value`` as an int if it is a whole number >= ``minimum`` (not a
    bool, not a string), else a ValueError naming ``name``."""
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(
            value, (int, numpy.integer)) or value < minimum:
        raise ValueError('%s must be a whole number >= %d, not %r'
                         % (name, minimum, value))
    return int(value)


def tunable_argument(name, value, minimum, allow_none=False):
    """``whole_argument``, or ``'auto'`` (tuned in the first averagings:
    mnopt/communicators/tuning.py), or None where ``allow_none``."""
    if (isinstance(value, str) and value == tuning.AUTO) or \
            (allow_none and value is None):
        return value
    try:
        return whole_argument(name, value, minimum)
    except ValueError:
        raise ValueError("%s must be a whole number >= %d%s or 'auto', not "
                         "%r" % (name, minimum,
                                 ', None' if allow_none else '', value))


def timeline_argument(value):
    """``timeline``: a path (str or os.PathLike, as a str) or None
    (then $MNOPT_TIMELINE), else a ValueError."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError('timeline must be a path (a str; {rank} in it is '
                         'replaced by the rank) or None, not %r' % (value,))
    return value


def check_arguments(kind, options, allreduce_grad_dtype, bucket_bytes,
                    compression, error_feedback, warmup_steps, vote,
                    stall_warning, timeout, on_overflow, batched_copy,
                    timeline=None, segment_bytes=None):
    """The settings of a ``kind`` communicator (its name) made with these
    keyword arguments and ``options`` (those left over: none is known),
    checked and normalized; ValueError/TypeError for what it would refuse
    (MNOPT_* settings included).  CommunicatorBase.check_arguments."""
    if options:
        raise TypeError('%s communicator: unknown option(s) %s'
                        % (kind, ', '.join(sorted(options))))
    compression = sign.normalize_compression(compression)
    settings = {
        'allreduce_grad_dtype': grad_buffer.normalize_wire_dtype(
            allreduce_grad_dtype),
        'bucket_bytes': tunable_argument('bucket_bytes', bucket_bytes, 1),
        'segment_bytes': tunable_argument('segment_bytes', segment_bytes, 1,
                                          allow_none=True),
        'compression': compression,
        'error_feedback': bool(error_feedback),
        'warmup_steps': whole_argument('warmup_steps', warmup_steps, 0),
        'vote': vote, 'stall_warning': stall_warning,
        'timeout': timeout, 'on_overflow': overflow.normalize(on_overflow),
        'batched_copy': bool(batched_copy),
        'timeline': timeline_argument(timeline)}
    if settings['warmup_steps'] and compression is None:
        raise ValueError("warmup_steps=%r only applies with "
                         "compression='sign' (it counts the averagings "
                         "before compression starts)" % (warmup_steps,))
    if vote is not None and compression is None:
        raise ValueError("vote=%r only applies with compression='sign'"
                         % (vote,))
    if compression is not None:  # None is the default vote, 'ring'
        settings['vote'] = sign.normalize_vote(vote)
    tuning.check(kind, settings)
    if settings['segment_bytes'] is not None and kind in (
            'reduction_server', 'pure_nccl'):
        # Taken and ignored would let a user believe it did something.
        raise ValueError('segment_bytes: the %s communicator has no ring to '
                         'cut into segments%s' % (
                             kind, ' (its pieces: chunk_bytes)'
                             if kind == 'reduction_server' else ''))
    stall_settings.settings(stall_warning, timeout)
    environment_settings()
    return settings
