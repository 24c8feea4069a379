"""Overflow on 16-bit wires: reported, not silent.

float16 holds at most 65504.  Dividing before summing (grad_buffer) keeps
a mean finite where every rank's gradient divided by the number of ranks
fits, and so does every partial sum of those on the wire: always when
the gradients agree in sign (each partial sum lies between 0 and the
mean).  Gradients of mixed sign can overflow though their mean fits
(140000 and -20000 on 2 ranks: 70000 does not fit before the sum; 180000,
180000 and -180000 on 3: 60000 each, but two of them sum to 120000).
The counts below are of what goes in and what comes out, not of the
steps between, so a report names both causes.

The codecs count, at no extra pass, how many gradient values
were not finite going in and how many means are not finite coming out
(per array): the host codec's C loops as they convert, the GPU kernels in
device memory (read once per averaging, so a GPU averaging on a 16-bit
wire ends with one small copy to the host; on_overflow='ignore' skips it).
An averaging *overflowed* in an array whose means are not all finite
though no rank's gradients in it were: NaN/Inf that were already in the
gradients pass through unchanged and are not reported.

All ranks hold the same means, so they find the same suspects and decide
together (one small allgather, only when some mean is not finite).
``on_overflow``: 'warn' (default: rank 0 warns, at most once every
``WARNING_INTERVAL_S``, with a count of what it did not say), 'error'
(every rank raises GradientOverflowError) or 'ignore'.  The warning is a
WARNING record of logger ``mnopt.overflow`` (mnopt/common/log.py), by
default on stderr.
"""

import time

from mnopt.transport import agreement
from mnopt.common import log

logger = log.get('mnopt.overflow')   # mnopt/common/log.py's list

CHOICES = ('warn', 'error', 'ignore')
WARNING_INTERVAL_S = 60.0


#: The largest finite value of each 16-bit wire, as the report says it.
LARGEST = {'float16': '65504', 'bfloat16': '3.4e38'}

#: What to do about an overflow, per wire: bfloat16 has float32's range,
#: so only float64 has more.
ADVICE = {
    'float16': "Use allreduce_grad_dtype='bfloat16' or 'float32' "
               "(float32's range), or a smaller loss scale.",
    'bfloat16': "These values are beyond float32's range too: use a "
                "smaller loss scale (or allreduce_grad_dtype='float64').",
}


class GradientOverflowError(FloatingPointError):
    """Averaging on a 16-bit wire turned finite gradients into inf/NaN."""


# Tracebacks name it where users import it from.
GradientOverflowError.__module__ = 'mnopt'


def normalize(on_overflow):
    if on_overflow not in CHOICES:
        raise ValueError('on_overflow must be one of %s, not %r'
                         % (', '.join(CHOICES), on_overflow))
    return on_overflow


class Reporter(object):
    """One communicator's overflow checks and their rate-limited warning."""

    def __init__(self, on_overflow='warn'):
        self.on_overflow = normalize(on_overflow)
        self.overflows = 0      # averagings that overflowed, in all
        self._unsaid = 0        # ... since the last warning
        self._last_warning = None

    def check(self, buffer, comm, step):
        """After an averaging with ``buffer``'s counts, over ``comm``."""
        if self.on_overflow == 'ignore':
            return
        buffer.take_counts()
        suspects = [i for i, n in enumerate(buffer.nonfinite_out) if n]
        if not suspects:
            return
        had = agreement.everyone(
            comm, [bool(buffer.nonfinite_in[i]) for i in suspects],
            'the overflow check')
        overflowed = [i for k, i in enumerate(suspects)
                      if not any(flags[k] for flags in had)]
        if not overflowed:
            return
        self.overflows += 1
        message = self.describe(buffer, overflowed, step)
        if self.on_overflow == 'error':
            raise GradientOverflowError(message)
        now = time.monotonic()
        if self._last_warning is not None and \
                now - self._last_warning < WARNING_INTERVAL_S:
            self._unsaid += 1
            return
        if comm.rank == 0:
            if self._unsaid:
                message += ' (%d more overflowed averaging(s) since the ' \
                    'last warning)' % self._unsaid
            logger.warning('mnopt: warning: %s', message)
        self._last_warning, self._unsaid = now, 0

    @staticmethod
    def describe(buffer, overflowed, step):
        layout = buffer.layout
        first = layout.names[overflowed[0]]
        more = len(overflowed) - 1
        return (
            'averaging #%d on the %s wire overflowed: the mean of %r%s is '
            'not finite though every rank\'s gradients were: a rank\'s '
            'gradient divided by the number of ranks, or a partial sum of '
            'those, went past %s\'s largest value (%s); the mean itself '
            'may be in range (gradients of mixed sign).  %s' % (
                step, layout.wire, first,
                ' and %d more parameter(s)' % more if more else '',
                layout.wire, LARGEST[layout.wire], ADVICE[layout.wire]))
