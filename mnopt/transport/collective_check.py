"""MNOPT_DEBUG=detail: every collective a communicator runs is checked
across ranks before it runs, and a mismatch is one error on every rank
naming each rank's call and the line of the user's code that made it
(what ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does for DDP).

Without the check, ranks that call different collectives, or the same
one with other roots, shapes or dtypes (a condition that differs between
ranks, a model built differently on one rank), hang in MPI or mix each
other's bytes.  With it, each collective first makes one exchange of an
8-byte digest of (its kind, its root, the shapes and dtypes it must share)
on a private duplicate of the communicator; only where the digests differ
are the calls themselves (and their call sites) exchanged through
mnopt's agreement, and every rank raises the same
``CollectiveMismatchError``.  The exchanges run inside the collective's
stall-watched operation: a rank that never arrives at the check (it is in
another mnopt operation, or left the loop) is reported as any late rank.

Point to point (``send``/``recv``, ``send_obj``/``recv_obj``): the sender
sends a short description of its call before the message; the receiver
checks that the pair matches (an array sent to ``recv_obj``, an object to
``recv``) and raises naming both call sites.  The sender does not wait
for the verdict: only the receiver raises.

Off (the default) the communicator's ``check_calls`` is None: one
attribute test per call.
"""

import hashlib
import inspect
import os
import sys
import threading

import numpy

from mnopt.common import _env
from mnopt.transport import agreement

#: MNOPT_DEBUG's values.
MODES = ('off', 'detail')

_MNOPT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The name of the exchange that follows digests that differ.
_EXCHANGE = 'MNOPT_DEBUG=detail: the check of a collective'

ADVICE = ('every rank must call the same collectives in the same order, '
          'with the same root, and with arrays of the same shapes and '
          'dtypes where the collective sums or broadcasts them into '
          'place (as in Horovod and DDP); look for a condition that '
          'differs between ranks at the lines named')


class CollectiveMismatchError(RuntimeError):
    """Ranks called collectives that do not match (MNOPT_DEBUG=detail)."""


def mode():
    """$MNOPT_DEBUG in any case, as PyTorch's TORCH_DISTRIBUTED_DEBUG
    (DETAIL is 'detail'; 'off' where unset; ValueError naming it
    otherwise)."""
    return _env.choice('MNOPT_DEBUG', 'off', MODES, any_case=True)


def call_site():
    """``file:line`` of the user's code that led here: the innermost
    frame outside mnopt and Chainer (else outside mnopt)."""
    chainer = sys.modules.get('chainer')
    libraries = [_MNOPT] + ([os.path.dirname(chainer.__file__)]
                            if getattr(chainer, '__file__', None) else [])
    frame, fallback = sys._getframe(1), None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_MNOPT + os.sep):
            site = '%s:%d' % (frame.f_code.co_filename, frame.f_lineno)
            fallback = fallback or site
            if not any(path.startswith(lib + os.sep) for lib in libraries):
                return site
        frame = frame.f_back
    return fallback or '(no caller outside mnopt)'


def _array(x):
    """(shape, dtype name) of an array, else None (not an array)."""
    shape, dtype = getattr(x, 'shape', None), getattr(x, 'dtype', None)
    if shape is None or dtype is None:
        return None
    return tuple(int(n) for n in shape), numpy.dtype(dtype).name


def _arrays(x):
    if isinstance(x, (tuple, list)):
        return tuple(_array(a) for a in x)
    return _array(x)


def _shown(arrays):
    """A short text for ``_arrays``' result."""
    if arrays is None:
        return 'not an array'
    if len(arrays) == 2 and isinstance(arrays[1], str):
        return 'shape %s %s' % arrays
    return '%d arrays %s' % (len(arrays), _summary(arrays))


def _summary(arrays):
    arrays = [a for a in arrays if a is not None]
    dtypes = sorted(set(d for _, d in arrays))
    elements = sum(int(numpy.prod(s)) for s, _ in arrays)
    return '(%d elements, %s)' % (elements, '/'.join(dtypes) or '-')


def _named(pairs):
    """The (shape, dtype) of each array of ``[(name, array), ...]``."""
    return tuple(_array(a) for _, a in pairs)


def _params(model):
    return tuple(_array(p.array) for _, p in sorted(model.namedparams())
                 if p.array is not None)


# What each collective's ranks must share, from its arguments (with
# defaults applied): (compared, shown).  A collective not listed here is
# not checked (mnopt's agreements name their exchange already; the
# background halves run on a thread of their own).
def _root(a, key='root'):
    return {'root': a[key]}, 'root=%d' % a[key]


def _root_array(a, name):
    compared, shown = _root(a)
    return compared, '%s, %s' % (shown, _shown(_arrays(a[name])))


def _gradients(a, name='named_grads', extra=None):
    arrays = _named(a[name])
    compared = {'arrays': arrays}
    shown = _shown(arrays)
    if extra:
        compared[extra] = tuple(a[extra])
        shown += ', %s=%s' % (extra, list(a[extra]))
    return compared, shown


SIGNATURES = {
    'bcast': lambda a: _root_array(a, 'x'),
    'gather': lambda a: _root_array(a, 'x'),
    'scatter': lambda a: _root(a),
    'allgather': lambda a: ({}, _shown(_arrays(a['x']))),
    'alltoall': lambda a: ({'arrays': len(a['xs'])},
                           '%d arrays' % len(a['xs'])),
    'allreduce': lambda a: ({'array': _arrays(a['x'])},
                            _shown(_arrays(a['x']))),
    'bcast_obj': lambda a: _root(a),
    'gather_obj': lambda a: _root(a),
    'scatter_obj': lambda a: _root(a),
    'allgather_obj': lambda a: ({}, ''),
    'allreduce_obj': lambda a: ({}, ''),
    'mean_grads': _gradients,
    'mean_grads_async': _gradients,
    'reduce_scatter_mean': lambda a: _gradients(
        a, extra='arrays_per_rank'),
    'reduce_scatter_mean_async': lambda a: _gradients(
        a, extra='arrays_per_rank'),
    'allgather_params': lambda a: _gradients(a, 'named_params',
                                             'arrays_per_rank'),
    'bcast_data': lambda a: (dict(_root(a)[0], arrays=_params(a['model'])),
                             'root=%d, %s' % (a['root'], _shown(
                                 _params(a['model'])))),
    'split': lambda a: ({}, 'color=%r, key=%r' % (a['color'], a['key'])),
}

#: Arguments that may be iterators: made lists before they are read, so
#: the collective still sees every item.
_ITERABLES = ('named_grads', 'named_params')

_signatures = {}


def _is_iterator(value):
    """A generator or iterator, read once (a list, a tuple or a dict is
    passed on as it is: the collective's own check says what is wrong)."""
    try:
        return iter(value) is value
    except TypeError:
        return False


def _bound(method, args, kwargs):
    signature = _signatures.get(method)
    if signature is None:
        signature = _signatures[method] = inspect.signature(method)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def digest(value):
    """A signed 64-bit digest of ``repr(value)``, the same in every
    process (Python's ``hash`` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(),
                                          digest_size=8).digest(),
                          'little', signed=True)


def ranks_text(ranks):
    """'rank 3', 'ranks 0, 2', 'ranks 1-63' (runs of 3 or more joined)."""
    runs, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs += ['%d-%d' % (start, r)] if r - start >= 2 else \
                [str(n) for n in range(start, r + 1)]
            start = None
    return '%s %s' % ('rank' if len(ranks) == 1 else 'ranks',
                      ', '.join(runs))


def mismatch_message(calls):
    """The error for ``calls`` (each rank's (kind, shown, call site)):
    one line per distinct call, naming the ranks that made it."""
    made = {}
    for r, call in enumerate(calls):
        made.setdefault(tuple(call), []).append(r)
    return ('MNOPT_DEBUG=detail: the ranks called collectives that do not '
            'match:\n%s\n%s' % ('\n'.join(
                '  %s: %s(%s) at %s' % ((ranks_text(ranks),) + call)
                for call, ranks in made.items()),
                ADVICE[0].upper() + ADVICE[1:]))


# Point to point: the sender's description of its call goes first, with
# the message's tag; the receiver reads it, checks the pair, and receives
# the message from the sender and tag it named.

#: {send: None; receive: the send it pairs with}.
PAIRS = {'send': None, 'send_obj': None, 'recv': 'send',
         'recv_obj': 'send_obj'}

#: What marks a description (any other first message is not one).
_HEADER = 'mnopt MNOPT_DEBUG=detail'


def _send_header(name, a):
    from mnopt.transport import objects
    shown = _shown(_arrays(a['data'])) if name == 'send' else \
        type(a['obj']).__name__
    objects.send_obj(a['self'].mpi_comm,
                     (_HEADER, name, shown, call_site()), a['dest'], a['tag'])


def _check_pair(name, a):
    """Receive the sender's description; raise CollectiveMismatchError
    (after receiving the message, so nothing is left behind) unless it
    pairs with ``name``.  The message is then received from the sender
    and tag the description came with."""
    from mpi4py import MPI
    from mnopt.transport import objects
    comm = a['self'].mpi_comm
    status = MPI.Status()
    header = objects.recv_obj(comm, a['source'], a['tag'], status)
    if header is None:    # from MPI.PROC_NULL
        return
    a['source'], a['tag'] = status.Get_source(), status.Get_tag()
    if not (isinstance(header, tuple) and len(header) == 4
            and header[0] == _HEADER):
        raise CollectiveMismatchError(
            'MNOPT_DEBUG=detail: %s at %s received a message from rank %d '
            "(tag %d) that mnopt's send did not describe: with "
            'MNOPT_DEBUG=detail every message to mnopt\'s recv must come '
            "from mnopt's send (not the communicator's mpi_comm)"
            % (name, call_site(), a['source'], a['tag']))
    _, sent, shown, site = header
    if sent != PAIRS[name]:
        objects.recv_bytes(comm, a['source'], a['tag'])   # left behind else
        raise CollectiveMismatchError(
            'MNOPT_DEBUG=detail: rank %d\'s %s at %s received what rank '
            "%d's %s(%s) at %s sent: pair send with recv, and send_obj "
            'with recv_obj' % (comm.rank, name, call_site(), a['source'],
                               sent, shown, site))


class CollectiveCheck(object):
    """The check of one communicator's collectives, over ``comm`` (a
    private duplicate of its MPI communicator, freed by ``free``).
    Called by ``stall.watched`` as ``check(name, method, args, kwargs)``
    (``args`` with the communicator first); returns the arguments to run
    the method with."""

    def __init__(self, comm):
        self.comm = comm
        #: The thread that made the communicator: collectives started by
        #: another thread (the background averaging's halves) are not
        #: checked, as the check's exchanges must not interleave.
        self.thread = threading.get_ident()

    def __call__(self, name, method, args, kwargs):
        if name in PAIRS:
            bound = _bound(method, args, kwargs)
            (_send_header if PAIRS[name] is None else _check_pair)(
                name, bound.arguments)
            return bound.args, bound.kwargs
        describe = SIGNATURES.get(name)
        if describe is None or threading.get_ident() != self.thread:
            return args, kwargs
        bound = _bound(method, args, kwargs)
        for key in _ITERABLES:
            value = bound.arguments.get(key)
            if value is not None and _is_iterator(value):
                bound.arguments[key] = list(value)
        try:
            compared, shown = describe(bound.arguments)
        except Exception as e:   # the collective's own check will say
            compared, shown = {'unreadable': True}, 'arguments: %s' % e
        self.check(name, compared, shown)
        return bound.args, bound.kwargs

    def check(self, name, compared, shown):
        """One digest exchange; on a mismatch, the calls exchanged and
        CollectiveMismatchError raised on every rank."""
        said = agreement.numbers(self.comm, [digest((name, compared))])
        if (said == said[0]).all():
            return
        calls = agreement.everyone(self.comm, (name, shown, call_site()),
                                   _EXCHANGE)
        raise CollectiveMismatchError(mismatch_message(calls))

    def free(self):
        from mpi4py import MPI
        if self.comm != MPI.COMM_NULL and not MPI.Is_finalized():
            self.comm.Free()
        self.comm = MPI.COMM_NULL
