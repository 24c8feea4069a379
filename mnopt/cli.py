"""Argument types for mnopt's command lines (``python -m mnopt.check``,
``.benchmark``, ``.launch``, ``.server``, ``.netsim``).

Each is an ``argparse`` ``type=``: a value out of range raises
``argparse.ArgumentTypeError``, so the command ends with its usage and an
``error:`` line (exit status 2) instead of a traceback deep in the run.

Leaf module: imports only the standard library.
"""

import argparse


def _number(kind, text, low, inclusive, what):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError('%r is not %s' % (text, what))
    # NaN compares false with everything: it is never in range.
    if not (value >= low if inclusive else value > low):
        raise argparse.ArgumentTypeError('%r is not %s' % (text, what))
    return value


def positive_int(text):
    """An integer > 0."""
    return _number(int, text, 0, False, 'an integer > 0')


def nonnegative_int(text):
    """An integer >= 0."""
    return _number(int, text, 0, True, 'an integer >= 0')


def positive_float(text):
    """A number > 0."""
    return _number(float, text, 0.0, False, 'a number > 0')


def nonnegative_float(text):
    """A number >= 0 (not NaN)."""
    return _number(float, text, 0.0, True, 'a number >= 0')


def int_range(low, high):
    """A type for an integer in ``low..high``."""
    def parse(text):
        value = _number(int, text, low, True, 'an integer in %d..%d'
                        % (low, high))
        if value > high:
            raise argparse.ArgumentTypeError('%r is not an integer in '
                                             '%d..%d' % (text, low, high))
        return value
    parse.__name__ = 'integer'   # how argparse names the type in errors
    return parse
