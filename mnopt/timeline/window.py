"""Which steps a timeline records (Horovod's ``start_timeline()`` /
``stop_timeline()``), and the cap on its file's size.

A window is set by ``MNOPT_TIMELINE_STEPS=START:STOP`` (Python's slice:
steps START to STOP-1; either end may be left out) or by the calls
``comm.start_timeline()`` / ``comm.stop_timeline()``, not both.  A step
is what one owner counts, the same on every rank: each ``update()`` of the
multi-node optimizer that updates first (0, 1, 2, ... over the whole job:
the first, which broadcasts rank 0's parameters, is step 0, and a job
resumed from a snapshot goes on from the count the snapshot holds), else
each ``mean_grads`` / ``mean_grads_async`` call of the communicator that
averages first (the core without Chainer; from 0 in each process).  An
optimizer takes the count over from a communicator's averagings.

``MNOPT_TIMELINE_MAX_BYTES`` caps each rank's file (default 1 GiB, 0: no
cap): past it the timeline records nothing more and says so, in the file
(an ``mnopt_truncated`` metadata event) and once in the log.

Leaf module: imports only the standard library and mnopt.common._env.
"""

import os
import weakref

from mnopt.common import _env

#: The environment variables: the window, the cap.
STEPS_ENV = 'MNOPT_TIMELINE_STEPS'
MAX_BYTES_ENV = 'MNOPT_TIMELINE_MAX_BYTES'
#: Each rank's file at most (bytes) unless MNOPT_TIMELINE_MAX_BYTES says.
DEFAULT_MAX_BYTES = 1 << 30
#: Who counts the steps: an optimizer's updates beat averagings.
OWNER_RANK = {'averaging': 0, 'optimizer': 1}


def parse_steps(text, name=STEPS_ENV):
    """'100:120' -> (100, 120); '100:' -> (100, None); ':20' -> (0, 20);
    '' -> None.  Anything else is a ValueError saying what to write."""
    text = (text or '').strip()
    if not text:
        return None
    start, colon, stop = text.partition(':')
    try:
        if not colon:
            raise ValueError
        first = int(start) if start.strip() else 0
        last = int(stop) if stop.strip() else None
        if first < 0 or (last is not None and last <= first):
            raise ValueError
    except ValueError:
        raise ValueError(
            '%s=%r: START:STOP was expected, the steps to record as a '
            "Python slice (e.g. '100:120' records steps 100 to 119; "
            "'100:' from step 100 on), 0 <= START < STOP" % (name, text))
    return first, last


def steps_setting():
    """$MNOPT_TIMELINE_STEPS as (start, stop or None), None where unset."""
    return parse_steps(os.environ.get(STEPS_ENV, ''))


def max_bytes_setting():
    """$MNOPT_TIMELINE_MAX_BYTES (0: no cap), else DEFAULT_MAX_BYTES."""
    return _env.whole_number(MAX_BYTES_ENV, DEFAULT_MAX_BYTES, 0, 'bytes')


def describe(steps):
    """'100:120' for (100, 120), '100:' for (100, None)."""
    return '%d:%s' % (steps[0], '' if steps[1] is None else steps[1])


class Window(object):
    """The step a timeline is at, and whether it records there.

    ``steps``: (start, stop or None) from MNOPT_TIMELINE_STEPS, else None
    (recording from the start, until ``stop()``).  ``recording`` is the
    gate the timeline reads before each event."""

    def __init__(self, steps=None):
        self.steps = steps
        self.recording = steps is None
        self.step = None            # the step begun last (None: none yet)
        self._owner, self._owner_rank = None, -1
        self._counts = weakref.WeakKeyDictionary()

    def begin_step(self, owner, kind, number=None):
        """A step of ``owner`` (kind 'optimizer' or 'averaging') begins:
        its number where ``owner`` is the one counting the steps, else
        None.  ``number``: the job's step, where ``owner`` tells it (an
        optimizer, restored by a resume); else ``owner``'s calls are
        counted from 0 in this process."""
        rank = OWNER_RANK[kind]
        current = self._owner() if self._owner is not None else None
        if current is not owner:
            if current is not None and self._owner_rank >= rank:
                return None
            self._owner, self._owner_rank = weakref.ref(owner), rank
        if number is None:
            number = self._counts.get(owner, 0)
        self._counts[owner] = number + 1
        self.step = number
        if self.steps is not None:
            start, stop = self.steps
            self.recording = start <= number and (stop is None
                                                  or number < stop)
        return number

    def set_by_call(self, on):
        """``start_timeline()`` (True) or ``stop_timeline()`` (False);
        refused where MNOPT_TIMELINE_STEPS sets the window."""
        if self.steps is not None:
            raise RuntimeError(
                '%s=%s sets which steps the timeline records: unset it to '
                'start and stop the timeline with comm.start_timeline() '
                'and comm.stop_timeline(), or leave the calls out'
                % (STEPS_ENV, describe(self.steps)))
        self.recording = bool(on)
