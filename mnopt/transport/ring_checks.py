"""The ring's argument checks: with ``check=True`` every rank raises the
same ValueError unless all pass sound arguments and the same size, wire
and counts (one small all-gather through mnopt's agreement); and the
error of a message of the wrong size."""

import zlib

import numpy

from mnopt.wire import dtypes as wire_dtypes
from mnopt.transport import agreement
from mnopt.transport import waiting

#: The wires the ring sums (their order numbers them in ``agree``).
WIRES = ('float32', 'float64', 'float16', 'bfloat16')


def fits(array, wire):
    """Whether the ring takes ``array`` for ``wire`` (None: any dtype)."""
    if wire is not None and wire not in WIRES:
        return False
    want = None if wire is None else wire_dtypes.storage_dtype(wire)
    return (isinstance(array, numpy.ndarray) and array.ndim == 1
            and array.flags.c_contiguous
            and (want is None or array.dtype == want))


def describe(array, wire):
    """Why it does not (see ``fits``), in one line."""
    if wire is not None and wire not in WIRES:
        return 'unknown wire %r; one of %s' % (wire, ', '.join(WIRES))
    if not isinstance(array, numpy.ndarray):
        return 'a numpy array was expected, not %s' % type(array).__name__
    return ('a contiguous 1-D numpy array%s was expected, not a %s array '
            'of shape %s%s' % (
                '' if wire is None else ' of %s (the %s wire)' % (
                    wire_dtypes.storage_dtype(wire), wire),
                array.dtype, array.shape,
                '' if array.flags.c_contiguous else ', not contiguous'))


def checked_counts(comm, array, wire, counts, check):
    """``counts`` as a list of ints, after the checks (every rank's when
    ``check``)."""
    problem = None
    if wire is not None and wire not in WIRES:
        problem = 'unknown wire %r; one of %s' % (wire, ', '.join(WIRES))
    elif not fits(array, wire):
        problem = describe(array, wire)
    return _check_counts(comm, getattr(array, 'size', -1), wire, counts,
                         problem, check, 'array holds')


def _check_counts(comm, size, wire, counts, problem, check, holds):
    """``counts`` checked against a buffer of ``size`` elements (after
    ``problem``, this rank's earlier finding), on every rank when
    ``check``."""
    try:
        counts = [int(c) for c in counts]
    except (TypeError, ValueError):
        problem = problem or 'counts must be whole numbers, not %r' % (
            counts,)
        counts = []
    if problem is None:
        if len(counts) != comm.size or min(counts) < 0:
            problem = ('counts must give one size >= 0 per rank (%d), '
                       'not %r' % (comm.size, counts))
        elif sum(counts) != size:
            problem = ('counts add up to %d but the %s %d %s'
                       % (sum(counts), holds, size,
                          'bytes' if holds == 'parts hold' and wire is None
                          else 'elements'))
    if check:
        agree(comm, size, wire, counts, problem)
    elif problem is not None:
        raise ValueError(problem)
    return counts


def checked_parts_counts(comm, parts, wire, counts, check):
    """``counts`` as a list of ints, after the checks of ``parts``
    (``wire`` None: any dtype, sizes in bytes)."""
    problem = None
    try:
        parts = list(parts)
    except TypeError:
        problem, parts = 'parts must be a list of arrays, not %r' % (
            type(parts).__name__,), []
    if problem is None and wire is not None and wire not in WIRES:
        problem = 'unknown wire %r; one of %s' % (wire, ', '.join(WIRES))
    bad = [p for p in parts if not fits(p, wire)]
    if problem is None and bad:
        problem = 'part %d: %s' % (
            next(i for i, p in enumerate(parts) if not fits(p, wire)),
            describe(bad[0], wire))
    total = sum(p.nbytes if wire is None else p.size for p in parts
                if isinstance(p, numpy.ndarray))
    return _check_counts(comm, total, wire, counts, problem, check,
                         'parts hold')


#: Bytes of each rank's problem in ``agree``'s exchange.
_PROBLEM_BYTES = 256


def agree(comm, size, wire, counts, problem):
    """Raise ValueError on every rank unless every rank has no problem and
    the same size, wire and counts: one all-gather of 4 numbers and a line
    of text per rank (``agreement.numbers``), waited for like
    the ring's own waits), then ``agreement.settle``."""
    if comm.size == 1:
        if problem:
            raise ValueError(problem)
        return
    text = (problem or '').encode()[:_PROBLEM_BYTES].ljust(_PROBLEM_BYTES,
                                                            b'\0')
    mine = numpy.concatenate([numpy.array([
        1 if problem else 0, size,
        -1 if wire is None else WIRES.index(wire) if wire in WIRES else -2,
        zlib.crc32(numpy.asarray(counts, dtype=numpy.int64).tobytes())],
        dtype=numpy.int64), numpy.frombuffer(text, numpy.int64)])
    everyone = agreement.numbers(comm, mine, wait=waiting.wait_all)
    agreement.settle(
        ValueError(problem) if problem else None,
        [everyone[r, 4:].tobytes().rstrip(b'\0').decode(errors='replace')
         if everyone[r, 0] else None for r in range(comm.size)],
        'ring collective', ValueError, '%s: bad arguments on %s')
    differ = [r for r in range(comm.size)
              if (everyone[r, 1:4] != everyone[0, 1:4]).any()]
    if differ:
        raise ValueError(
            'ring collective: ranks disagree on the buffer: rank 0 has %d '
            'elements (%s wire), rank %d has %d (%s)%s. Every rank must '
            'pass the same size, wire and counts.' % (
                everyone[0, 1], _wire_name(everyone[0, 2]), differ[0],
                everyone[differ[0], 1], _wire_name(everyone[differ[0], 2]),
                '' if everyone[0, 1] != everyone[differ[0], 1] else
                ' and different counts' if everyone[0, 2] ==
                everyone[differ[0], 2] else ''))


def _wire_name(code):
    return 'bytes' if code == -1 else WIRES[code] if 0 <= code < len(
        WIRES) else '?'


def size_error(comm, source, want, status, mpi_type):
    """What a ring on ``comm`` says when rank ``source`` sent it other
    than ``want`` elements (``status``: the receive's)."""
    return ('ring collective on rank %d: rank %d sent %d elements where '
            '%d were expected: ranks disagree on the buffer size'
            % (comm.rank, source, status.Get_count(mpi_type), want))
