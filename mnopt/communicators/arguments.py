"""The checks of the keyword arguments every communicator takes: refused
without communicating, so that the factory can check them on every rank
before any collective."""

import os

import numpy

from mnopt.codecs import grad_buffer
from mnopt.codecs import overflow
from mnopt.codecs import sign
from mnopt.stall import settings as stall_settings
from mnopt.averaging import tuning
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
    mnopt/averaging/tuning.py), or None where ``allow_none``."""
    if (isinstance(value, str) and value == tuning.AUTO) or \
            (allow_none and value is None):
        return value
    try:
        return whole_argument(name, value, minimum)
    except ValueError:
        raise ValueError("%s must be a whole number >= %d%s or 'auto', not "
                         "%r" % (name, minimum,
                                 ', None' if allow_none else '', value))


#: ``compression``: sign votes (mnopt/codecs/sign.py), PowerSGD
#: (mnopt/codecs/powersgd.py), or PowerSGD where it pays ('auto':
#: mnopt/averaging/compression_guard.py).
COMPRESSIONS = (None, 'sign', 'powersgd', 'auto')
LOW_RANK = ('powersgd', 'auto')
#: The PowerSGD settings, with their defaults (PyTorch's, but for the
#: start: ``warmup_steps``).
LOW_RANK_DEFAULTS = {'powersgd_rank': 1, 'min_compression_rate': 2.0,
                     'warm_start': True}


def compression_argument(name):
    """``compression`` normalized ('none' is None), else a ValueError."""
    if name is None or (isinstance(name, str) and name == 'none'):
        return None
    if not isinstance(name, str) or name not in COMPRESSIONS:
        raise ValueError('unknown compression %r; choose one of %s'
                         % (name, ', '.join(repr(c) for c in COMPRESSIONS)))
    return name


def low_rank_arguments(compression, powersgd_rank, min_compression_rate,
                       warm_start):
    """The PowerSGD settings, checked: their defaults with
    ``compression='powersgd'`` or ``'auto'``, None without (where setting
    one is a ValueError: taken and ignored, it would look like it did
    something)."""
    given = {'powersgd_rank': powersgd_rank,
             'min_compression_rate': min_compression_rate,
             'warm_start': warm_start}
    if compression not in LOW_RANK:
        for name, value in sorted(given.items()):
            if value is not None:
                raise ValueError(
                    "%s=%r only applies with compression='powersgd' or "
                    "'auto'" % (name, value))
        return dict.fromkeys(given)
    out = {name: LOW_RANK_DEFAULTS[name] if value is None else value
           for name, value in given.items()}
    out['powersgd_rank'] = whole_argument('powersgd_rank',
                                          out['powersgd_rank'], 1)
    rate = out['min_compression_rate']
    if isinstance(rate, (bool, numpy.bool_)) or not isinstance(
            rate, (int, float, numpy.integer, numpy.floating)) or \
            not rate >= 0 or rate == float('inf'):
        raise ValueError('min_compression_rate must be a finite number >= '
                         '0, not %r' % (rate,))
    out['min_compression_rate'] = float(rate)
    if not isinstance(out['warm_start'], (bool, numpy.bool_)):
        raise ValueError('warm_start must be True or False, not %r'
                         % (out['warm_start'],))
    out['warm_start'] = bool(out['warm_start'])
    return out


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
                    timeline=None, segment_bytes=None, powersgd_rank=None,
                    min_compression_rate=None, warm_start=None):
    """The settings of a ``kind`` communicator (its name) made with these
    keyword arguments and ``options`` (those left over: none is known),
    checked and normalized; ValueError/TypeError for what it would refuse
    (MNOPT_* settings included).  CommunicatorBase.check_arguments."""
    if options:
        raise TypeError('%s communicator: unknown option(s) %s'
                        % (kind, ', '.join(sorted(options))))
    compression = compression_argument(compression)
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
    settings.update(low_rank_arguments(compression, powersgd_rank,
                                       min_compression_rate, warm_start))
    if settings['warmup_steps'] and compression is None:
        raise ValueError("warmup_steps=%r only applies with a compression "
                         "(it counts the averagings before compression "
                         "starts)" % (warmup_steps,))
    if vote is not None and compression != 'sign':
        raise ValueError("vote=%r only applies with compression='sign'"
                         % (vote,))
    if compression == 'sign':  # None is the default vote, 'ring'
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

