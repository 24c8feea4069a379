"""The ImageNet example's table of the log, as rank 0 prints it: one line
per log entry, within 80 columns, in readable units (the log itself keeps
the raw values: seconds, bytes per second, the straggler's rank or -1).

Chainer's PrintReport gives every column at least 10 characters and
prints numbers with ``g``: its lines of the example were 178 characters
(wrapped on an 80-column terminal), the bus bandwidth read ``1.23457e+08``
and who arrived last ``-1``.
"""

import sys

from chainer import training


def _number(spec):
    return lambda value: spec % value


def _milliseconds(seconds):
    return '%.1f' % (seconds * 1e3)


def bytes_per_second(value):
    """123456789 -> '123MB/s': the bus bandwidth, in 7 characters."""
    for unit, scale in (('GB/s', 1e9), ('MB/s', 1e6), ('kB/s', 1e3)):
        if value >= scale:
            return '%.3g%s' % (value / scale, unit)
    return '%.0fB/s' % value


def straggler(value):
    """The rank that arrived last at the most collectives, in words: 'r1',
    'none' (-1: no rank was late by 0.1 ms); a mean of several reports
    (not a rank) is 'mixed'."""
    if value == -1:
        return 'none'
    if value == int(value):
        return 'r%d' % value
    return 'mixed'


#: (header, width, log key, format), in the order printed.  The header
#: holds the unit; the widths with the spaces between sum to 80 or less.
COLUMNS = (
    ('epoch', 5, 'epoch', _number('%d')),
    ('iter', 5, 'iteration', _number('%d')),
    ('loss', 6, 'main/loss', _number('%.3f')),
    ('v.loss', 6, 'validation/main/loss', _number('%.3f')),
    ('acc', 5, 'main/accuracy', _number('%.3f')),
    ('v.acc', 5, 'validation/main/accuracy', _number('%.3f')),
    ('img/s', 6, 'images/sec', _number('%.0f')),
    ('exp.ms', 6, 'comm/exposed', _milliseconds),
    ('hid.ms', 6, 'comm/hidden', _milliseconds),
    ('busbw', 8, 'comm/busbw', bytes_per_second),
    ('last', 5, 'comm/straggler', straggler),
    ('time.s', 6, 'elapsed_time', _number('%.1f')),
)

#: What the headers mean, printed once above them.
LEGEND = ('v. validation; exp/hid: communication exposed / hidden behind '
          'compute per step;\nbusbw: bus bandwidth; last: the rank that '
          'arrived last at the collectives')


def header():
    return ' '.join('%*s' % (w, name) for name, w, _, _ in COLUMNS)


def row(entry):
    """One log entry as a line of the table (blank where it has no
    value)."""
    cells = []
    for _, width, key, show in COLUMNS:
        cells.append('%*s' % (width, show(entry[key]) if key in entry
                              else ''))
    return ' '.join(cells)


class Table(training.Extension):
    """Prints the LogReport's new entries, as PrintReport does, in
    COLUMNS.  After a resume it prints only this run's entries."""

    def __init__(self, log_report='LogReport', out=sys.stdout):
        self._log_report = log_report
        self._out = out
        self._printed = None

    def initialize(self, trainer):
        if self._printed is None:
            self._printed = len(trainer.get_extension(self._log_report).log)
            self._out.write(LEGEND + '\n' + header() + '\n')

    def __call__(self, trainer):
        log = trainer.get_extension(self._log_report).log
        for entry in log[self._printed:]:
            self._out.write(row(entry) + '\n')
        self._printed = len(log)
        self._out.flush()
