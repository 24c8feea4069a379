"""PowerSGD's core: low-rank gradient compression, with no communication.

PowerSGD (Vogels, Karimireddy and Jaggi 2019, arXiv 1905.13727) sends, for
each gradient matrix ``M`` (n x m), two thin factors of rank ``r`` instead
of ``M``; one power iteration, warm-started from the last step's ``Q``:

    M = grad.reshape(n, m) + error           (error feedback, local)
    P = M Q;          P = allreduce_sum(P);  P = orthogonalize(P)
    Q = M^T P;        Q = allreduce_sum(Q)
    M_hat = P Q^T / world_size               (the same bits on every rank)
    error = M - M_hat                        (what this rank has not sent)

``P`` and ``Q`` are sums, so any all-reduction carries them.  This module
is the arithmetic only, as small functions over explicit state (the style
of PyTorch's ``powerSGD_hook``): ``plan`` says which arrays are compressed
(vectors, empty arrays and matrices whose compression rate is below
``min_compression_rate`` are averaged as they are; a conv kernel is the
matrix (out, in*kh*kw)), ``PowerSGDState`` holds the settings, the step
count, the error-feedback residuals and the ``Q`` factors, and ``step``
runs one step given a caller's ``allreduce_sum(list_of_arrays)``.  The
three pieces of ``step`` (``project``, ``reproject``, ``reconstruct``) are
public for a caller that all-reduces in its own way.

Every rank must end a step with the same bits.  What every rank computes
from all-reduced data (``orthogonalize``, ``reconstruct``) is a fixed
sequence of element-wise operations and fixed-order sums: no LAPACK QR
(blocked, threaded and free to flip a column's sign), no BLAS product
whose summation order may follow the thread count.  Identical input on
identical software then gives identical output; one differing bit would
make the ranks' ``M_hat`` differ, and replicas drift apart.  The local
products ``M Q`` and ``M^T P`` need no such care: they are summed.
"""

import collections
import math

import numpy

from mnopt.common.arrays import array_module, to_host

#: One array of a plan: its index in the gradient list, its shape, and for
#: a compressed array its matrix shape (n, m) and rank (else None, 0).
Entry = collections.namedtuple('Entry', 'index shape matrix rank')


def matrix_shape(shape):
    """(n, m) that an array of ``shape`` is compressed as: (shape[0],
    product of the rest); None for a scalar or a vector."""
    if len(shape) < 2:
        return None
    return int(shape[0]), int(numpy.prod(shape[1:], dtype=numpy.int64))


def compresses(n, m, rank, min_compression_rate):
    """Whether an n x m matrix is worth compressing at ``rank``: its n*m
    elements more than ``min_compression_rate`` times the (n + m) * rank
    of its factors (PyTorch's rule; an empty matrix never is)."""
    return (n + m) * rank * min_compression_rate < n * m


def plan(shapes, rank, min_compression_rate=2.0):
    """A tuple of ``Entry``, one per shape in order.  The rank of a matrix
    is ``min(rank, n, m)``."""
    if rank < 1:
        raise ValueError('matrix_approximation_rank must be >= 1, got %r'
                         % (rank,))
    entries = []
    for index, shape in enumerate(shapes):
        shape = tuple(int(s) for s in shape)
        nm = matrix_shape(shape)
        if nm is not None:
            r = min(rank, *nm)
            if r > 0 and compresses(nm[0], nm[1], r, min_compression_rate):
                entries.append(Entry(index, shape, nm, r))
                continue
        entries.append(Entry(index, shape, None, 0))
    return tuple(entries)


def wire_elements(entries):
    """Elements each rank puts into the all-reductions of one compressed
    step: P and Q of every compressed array, every other array whole."""
    total = 0
    for e in entries:
        if e.matrix is None:
            total += int(numpy.prod(e.shape, dtype=numpy.int64))
        else:
            total += (e.matrix[0] + e.matrix[1]) * e.rank
    return total


def work_dtype(dtype):
    """The dtype PowerSGD computes and sends in: float32 for 16- and
    32-bit gradients (Gram-Schmidt in half precision loses too much),
    float64 for float64."""
    return numpy.result_type(dtype, numpy.float32)


def orthogonalize(a, epsilon=0.0, xp=None):
    """A copy of the 2-D ``a`` with orthonormal columns: modified
    Gram-Schmidt, column by column, left to right, twice ("twice is
    enough": one pass in float32 leaves columns of an ill-conditioned
    ``a`` off orthogonal by its condition number times the rounding; at
    full rank that was 1e-3 of the mean).  ``epsilon`` is added to each
    norm before dividing (PyTorch's orthogonalization epsilon); a column of norm 0 (a zero
    gradient, or a rank beyond that of ``a``) stays zero, where a plain
    division would give NaN.  Deterministic: see the module's
    docstring."""
    xp = xp or array_module([a])
    q = a.copy()
    # A non-finite P (an inf in some gradient) gives NaN, which the step
    # then reports by its mean (``reconstruct``): no warning per column.
    with numpy.errstate(invalid='ignore', over='ignore'):
        _gram_schmidt_pass(q, epsilon, xp)
        _gram_schmidt_pass(q, epsilon, xp)
    return q


def _gram_schmidt_pass(q, epsilon, xp):
    for i in range(q.shape[1]):
        col = q[:, i]
        norm = xp.sqrt(xp.sum(col * col))
        denom = norm + q.dtype.type(epsilon)
        denom = xp.where(denom == 0, q.dtype.type(1), denom)
        col = col / denom
        q[:, i] = col
        if i + 1 < q.shape[1]:
            rest = q[:, i + 1:]
            # Fixed order: an element-wise product, then a sum along axis 0.
            coef = xp.sum(col[:, None] * rest, axis=0)
            q[:, i + 1:] = rest - col[:, None] * coef[None, :]


def random_q(seed, index, m, rank, dtype, xp=numpy, step=None):
    """The starting Q (m x rank) of array ``index``: standard normal from a
    generator seeded by (seed, index[, step]) on the host, so that every
    rank, device and resumed job draws the same bits."""
    key = [int(seed), int(index)] + ([] if step is None else [int(step)])
    rng = numpy.random.Generator(numpy.random.PCG64(key))
    host = rng.standard_normal((m, rank)).astype(dtype)
    return host if xp is numpy else xp.asarray(host)


class PowerSGDState(object):
    """Settings and state of PowerSGD over one list of gradient shapes.

    The settings are PyTorch's ``PowerSGDState``'s: ``rank``
    (matrix_approximation_rank), ``start_iter`` (start_powerSGD_iter:
    plain averaging for the steps before it), ``min_compression_rate``,
    ``use_error_feedback``, ``warm_start`` (else a fresh seeded Q every
    step) and ``epsilon`` (orthogonalization_epsilon).  The state is
    ``iteration`` (steps taken), ``errors`` and ``qs`` ({plan index:
    array}, the arrays on the gradients' device; a communicator keeps the
    residuals per parameter: mnopt/averaging/low_rank.py)."""

    def __init__(self, shapes, rank=1, start_iter=1000,
                 min_compression_rate=2.0, use_error_feedback=True,
                 warm_start=True, epsilon=0.0, seed=0):
        self.shapes = [tuple(int(s) for s in shape) for shape in shapes]
        self.rank = int(rank)
        self.start_iter = int(start_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.epsilon = float(epsilon)
        self.seed = int(seed)
        self.plan = plan(self.shapes, self.rank, self.min_compression_rate)
        self.iteration = 0
        self.errors = {}
        self.qs = {}

    @property
    def compressing(self):
        """Whether the next step is compressed (``start_iter`` reached)."""
        return self.iteration >= self.start_iter

    def q_for(self, entry, dtype, xp):
        """This step's Q of a compressed ``entry``: the warm one if kept,
        else a seeded draw (per step without warm start)."""
        q = self.qs.get(entry.index) if self.warm_start else None
        if q is None:
            step = None if self.warm_start else self.iteration
            q = random_q(self.seed, entry.index, entry.matrix[1], entry.rank,
                         dtype, xp, step)
        return q


def project(state, grads, xp=None):
    """First half, local: (matrices, ps, plain).  ``matrices`` and ``ps``
    ({plan index: array}) are M (gradient plus residual) and P = M Q of
    the compressed arrays; ``plain`` ({index: array}) the others, to be
    summed whole alongside the Ps."""
    xp = xp or array_module(grads)
    matrices, ps, plain = {}, {}, {}
    for e in state.plan:
        g = grads[e.index]
        if tuple(g.shape) != e.shape:
            raise ValueError('gradient %d has shape %s, the plan %s'
                             % (e.index, tuple(g.shape), e.shape))
        if e.matrix is None:
            plain[e.index] = g
            continue
        dtype = work_dtype(g.dtype)
        m = g.reshape(e.matrix).astype(dtype)   # always a copy
        if state.use_error_feedback and e.index in state.errors:
            m += state.errors[e.index]
        matrices[e.index] = m
        ps[e.index] = xp.matmul(m, unit_columns(state.q_for(e, dtype, xp),
                                                xp))
    return matrices, ps, plain


def unit_columns(q, xp):
    """``q`` with each column scaled to norm 1 (a zero column stays zero).
    The warm Q is a mean of M^T P, as large as the gradients' singular
    values, so M Q would be as large as their square: beyond float16 for
    gradients of 100, below its resolution for 1e-3.  Scaled, P is no
    larger than a row of M; Gram-Schmidt gives the same P either way
    (it takes each column's scale out), up to rounding."""
    norms = xp.sqrt(xp.sum(q * q, axis=0))
    return q / xp.where(norms == 0, q.dtype.type(1), norms)[None, :]


def reproject(state, matrices, summed_ps, xp=None):
    """Second half, from the summed Ps: (ps, qs), the orthonormal P (the
    same bits on every rank) and the local Q = M^T P to be summed."""
    ps, qs = {}, {}
    for index, m in matrices.items():
        xp_ = xp or array_module([m])
        p = orthogonalize(summed_ps[index], state.epsilon, xp_)
        ps[index] = p
        qs[index] = xp_.matmul(m.T, p)
    return ps, qs


def outer_sum(p, q, q_rows=None):
    """P Q^T summed rank-one term by term, in order: the same bits on
    every rank and device for the same P and Q (no BLAS).  ``q_rows``:
    Q^T made contiguous (its columns are strided), if the caller has it."""
    q_rows = q.T if q_rows is None else q_rows
    xp = array_module([p])
    out = xp.multiply(p[:, 0:1], q_rows[0][None, :])
    term = xp.empty_like(out) if p.shape[1] > 1 else None
    for j in range(1, p.shape[1]):
        out += xp.multiply(p[:, j:j + 1], q_rows[j][None, :], out=term)
    return out


#: Elements of M_hat rebuilt at a time on the host: a block of rows that
#: stays in the CPU's cache while it is cast out and taken from M (three
#: passes over memory become one).  Each element's arithmetic is the same
#: whatever the block, so its bits are too.
BLOCK_ELEMENTS = 1 << 14


def rebuild(p, q, m, out, world_size=1, error_feedback=True):
    """``out[...] = P Q^T / world_size`` (cast to ``out``'s dtype; ``out``
    shaped as M), and with ``error_feedback`` ``m -= `` that same M_hat,
    in place (``m`` then holds the residual).  Row block by row block
    on the host, all at once on a GPU."""
    xp = array_module([m])
    n, cols = m.shape
    rows = n if xp is not numpy else max(1, BLOCK_ELEMENTS // max(cols, 1))
    scale = m.dtype.type(world_size)
    q_rows = xp.ascontiguousarray(q.T)
    for start in range(0, n, rows):
        block = slice(start, start + rows)
        m_hat = outer_sum(p[block], q, q_rows)
        if world_size != 1:   # x / 1 is x: skipped, the same bits
            m_hat /= scale
        out[block] = m_hat
        if error_feedback:
            m[block] -= m_hat


def reconstruct(state, grads, matrices, ps, summed_qs, summed_plain,
                world_size, xp=None, out=None):
    """The end of a step: the mean gradients (a list shaped and typed as
    ``grads``; with ``out``, a list of arrays to write them into, where
    it is not None, and that list), the residuals and warm Qs kept, the
    step counted.  The matrices of ``matrices`` become the residuals.

    A step whose factors are not finite (an inf or NaN in some rank's
    gradient, or a 16-bit wire that overflowed) gives its non-finite mean
    (the optimizer or the loss scaler skips it) and changes no state:
    the residuals and Qs stay as they were, so that the next finite step
    goes on from them.  Kept, a NaN would poison every later step.  The
    summed factors are the same bits on every rank, so every rank decides
    alike.

    The residual is M - M_hat, PyTorch's choice, not the paper's
    M - P P^T M: the two differ by this rank's M minus the ranks' mean M,
    which sums to zero over the ranks, and the step is linear in the sum
    of the Ms, so both give the same means (up to rounding); this one
    reuses M_hat instead of another product."""
    out = [None] * len(grads) if out is None else out
    for index, total in summed_plain.items():
        out[index] = (total / world_size).astype(grads[index].dtype,
                                                 copy=False)
    order = sorted(matrices)
    finite, dead = inspect_factors([ps[i] for i in order],
                                   [summed_qs[i] for i in order], xp)
    for index in order:
        m = matrices[index]
        target = out[index]
        if target is None:
            target = out[index] = (xp or array_module([m])).empty(
                grads[index].shape, grads[index].dtype)
        elif not target.flags.c_contiguous:
            # Its reshape to M's shape would be a copy, not a view.
            raise ValueError('reconstruct writes into C-contiguous arrays '
                             'only (out[%d] is not)' % index)
        rebuild(ps[index], summed_qs[index], m, target.reshape(m.shape),
                world_size, state.use_error_feedback and finite)
        if not finite:
            continue
        if state.use_error_feedback:
            state.errors[index] = m
        if state.warm_start:
            state.qs[index] = summed_qs[index].copy()   # not the caller's
    if not finite:
        return out
    if state.warm_start:
        refresh_dead_columns(state, order, dead, xp)
    state.iteration += 1
    return out


def inspect_factors(ps, qs, xp=None):
    """(whether every P and Q is finite, the all-zero columns of the Qs:
    a boolean numpy array, the Qs' columns in order): one transfer from
    the device for both."""
    if not qs:
        return True, numpy.zeros(0, bool)
    xp = xp or array_module(qs)
    flags = to_host(xp.concatenate(
        [xp.stack([xp.isfinite(p).all() for p in ps] +
                  [xp.isfinite(q).all() for q in qs])] +
        [xp.all(q == 0, axis=0) for q in qs]))
    return bool(flags[:2 * len(qs)].all()), flags[2 * len(qs):]


def refresh_dead_columns(state, order, dead, xp=None):
    """Redraw the all-zero columns of the warm Qs of plan indices
    ``order`` (``dead``: inspect_factors' flags; a zero gradient, or a sum
    of rank below ``rank``): a zero column of Q would stay zero ever
    after.  The Qs are all-reduced, so every rank redraws the same ones,
    from (seed, index, iteration)."""
    if not dead.any():
        return
    at = 0
    for i in order:
        q = state.qs[i]
        cols = numpy.flatnonzero(dead[at:at + q.shape[1]])
        at += q.shape[1]
        if cols.size:
            fresh = random_q(state.seed, i, q.shape[0], q.shape[1], q.dtype,
                             xp or array_module([q]), state.iteration)
            q = q.copy()
            for c in cols.tolist():   # plain ints index numpy and CuPy
                q[:, c] = fresh[:, c]
            state.qs[i] = q


def step(state, grads, allreduce_sum, world_size, xp=None):
    """One step: the mean over the ranks of ``grads`` (a list of arrays
    shaped as the state's shapes), compressed once ``start_iter`` steps
    have passed.  ``allreduce_sum(list_of_arrays)`` returns their sums
    over the ranks (new arrays or the same, in order), with the same
    bits on every rank; it is called once before ``start_iter``, twice
    after (the Ps with the uncompressed arrays, then the Qs)."""
    xp = xp or array_module(grads)
    if not state.compressing:
        summed = allreduce_sum(list(grads))
        state.iteration += 1
        return [(s / world_size).astype(g.dtype, copy=False)
                for s, g in zip(summed, grads)]
    matrices, ps, plain = project(state, grads, xp)
    order = sorted(ps) + sorted(plain)
    summed = allreduce_sum([ps[i] if i in ps else plain[i] for i in order])
    summed = dict(zip(order, summed))
    ps, qs = reproject(state, matrices, summed, xp)
    q_order = sorted(qs)
    summed_qs = dict(zip(q_order, allreduce_sum([qs[i] for i in q_order])
                         if q_order else []))
    summed_plain = {i: summed[i] for i in plain}
    return reconstruct(state, grads, matrices, ps, summed_qs, summed_plain,
                       world_size, xp)


def compression_rate(entries, itemsize=4, work_itemsize=4):
    """Bytes of the uncompressed gradients (``itemsize`` each) over the
    bytes of one compressed step (``work_itemsize`` each)."""
    full = sum(int(numpy.prod(e.shape, dtype=numpy.int64))
               for e in entries) * itemsize
    sent = wire_elements(entries) * work_itemsize
    return math.inf if sent == 0 else full / sent
