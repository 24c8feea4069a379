"""Argument types for mnopt's command lines (``python -m mnopt.check``,
``.benchmark``, ``.launch``, ``.server``, ``.netsim``).

Each is an ``argparse`` ``type=``: a value out of range raises
``argparse.ArgumentTypeError``, so the command ends with its usage and an
``error:`` line (exit status 2) instead of a traceback deep in the run.

``parse_args`` parses as argparse does, and in a process of an MPI job
(MPI started, more than one process) a bad command line aborts the whole
job: argparse exits with SystemExit, which no excepthook sees, and the
other processes would wait for this one until their timeout.

Imports only the standard library (and mnopt.global_except_hook, on a
bad command line).
"""

import argparse
import math


def _number(kind, text, low, inclusive, what):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError('%r is not %s' % (text, what))
    # NaN compares false with everything: it is never in range; nor is
    # infinity a number of seconds, bytes or repetitions.
    if not math.isfinite(value) or \
            not (value >= low if inclusive else value > low):
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


#: How a paragraph of a command's docstring meant for mnopt's developers
#: begins (the architecture rule's note on a file over 400 lines): left
#: out of the command's --help, which is for its users.
DEVELOPER_NOTE = 'One idea'


def help_epilog(docstring):
    """A command module's docstring as its --help epilog: all but the
    first line (the description), without the developers' notes, as plain
    text (reST's ``literal`` quotes dropped)."""
    body = docstring.split('\n', 1)[1].strip().replace('``', '')
    paragraphs = body.split('\n\n')
    return '\n\n'.join(p for p in paragraphs
                       if not p.lstrip().startswith(DEVELOPER_NOTE))


def parse_args(parser, argv=None):
    """``parser.parse_args(argv)``; where this process is one of an MPI
    job's, a bad command line (argparse's exit status 2) aborts the job
    with it, so the other processes do not wait for this one."""
    try:
        return parser.parse_args(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            from mnopt import global_except_hook
            global_except_hook.abort('a bad command line for %s'
                                     % parser.prog, code=2)
        raise
