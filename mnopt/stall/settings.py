"""Stall detection's settings: the warning time and the timeout, from the
arguments, else the environment (MNOPT_STALL_WARNING, MNOPT_TIMEOUT), else
the defaults."""

import os

import numpy

DEFAULT_WARNING_S = 60.0
DEFAULT_TIMEOUT_S = 600.0


def _seconds(value, name, env):
    if isinstance(value, (bool, numpy.bool_)):
        # float(True) is 1.0: a switch is not a number of seconds.
        raise ValueError('%s=%r: a number of seconds >= 0 (0 disables) was '
                         'expected, not a bool' % (name, value))
    if value is None:
        value = os.environ.get(env)
        if value is None or value == '':
            return None
        where = '%s=%r' % (env, value)
    else:
        where = '%s=%r' % (name, value)
    try:
        seconds = float(value)
        if not seconds >= 0:
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError('%s: a number of seconds >= 0 (0 disables) was '
                         'expected' % where)
    return seconds


def settings(stall_warning=None, timeout=None):
    """(warning, timeout) in seconds, None where disabled: the arguments,
    else $MNOPT_STALL_WARNING / $MNOPT_TIMEOUT, else the defaults."""
    warning = _seconds(stall_warning, 'stall_warning', 'MNOPT_STALL_WARNING')
    timeout = _seconds(timeout, 'timeout', 'MNOPT_TIMEOUT')
    warning = DEFAULT_WARNING_S if warning is None else warning
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    return warning or None, timeout or None


def settings_or_defaults(stall_warning=None, timeout=None):
    """``settings()``, or the defaults where they are invalid: for the
    waits and exchanges through which a bad setting gets reported (where
    the arguments are checked), which must not fail on one rank first."""
    try:
        return settings(stall_warning, timeout)
    except ValueError:
        return DEFAULT_WARNING_S, DEFAULT_TIMEOUT_S
