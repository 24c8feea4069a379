"""scatter_dataset and scatter_index: each rank's share of a dataset that
one rank holds, split as ChainerMN splits it, as a ScatteredDataset that
knows which of the whole dataset's examples it holds (so that a resume on
another number of ranks can hand out the rest of an interrupted epoch:
mnopt/iterators/epoch_position.py)."""

import chainer.datasets
import numpy


class DataSizeError(RuntimeError):
    """ChainerMN raises it when a dataset is too large to scatter in one
    message; mnopt moves objects in pieces, so it is never raised.  Here so
    that scripts catching it import unchanged."""


class ScatteredDataset(chainer.datasets.SubDataset):
    """One rank's share of a scattered dataset: a ``SubDataset`` (as
    ChainerMN's ``scatter_dataset`` returns) that also says which examples
    of the whole dataset it holds.

    ``global_indices[i]`` is the whole dataset's index of example ``i``;
    ``n_total`` the whole dataset's length.  A resume mid-epoch may give
    the share a *detour*: examples of the whole dataset, by index, read at
    positions ``len(self)``, ``len(self) + 1``, ... (past the share's own
    examples), which only the resumed epoch's order names; later epochs
    read the share's own examples as before."""

    def __init__(self, dataset, start, finish, order, force_equal_length):
        super().__init__(dataset, start, finish, order)
        self.n_total = len(dataset)
        self.force_equal_length = force_equal_length
        positions = numpy.arange(start, finish)
        self.global_indices = positions if order is None else \
            numpy.asarray(order)[positions]
        #: The whole dataset's order the shares were cut from.
        self.root_order = numpy.arange(self.n_total) if order is None \
            else numpy.asarray(order)
        self.detour = numpy.zeros(0, dtype=numpy.int64)

    def get_example(self, i):
        if len(self) <= i < len(self) + len(self.detour):
            return self._dataset[int(self.detour[i - len(self)])]
        return super().get_example(i)

    def global_index(self, positions):
        """The whole dataset's indices of ``positions`` (an int array of
        the share's positions, the detour's included)."""
        positions = numpy.asarray(positions, dtype=numpy.int64)
        inside = positions < len(self)
        found = numpy.empty(len(positions), dtype=numpy.int64)
        found[inside] = self.global_indices[positions[inside]]
        found[~inside] = self.detour[positions[~inside] - len(self)]
        return found


def _check_root(comm, root):
    """Raise ValueError on every rank unless every rank passed the same
    ``root`` and it is one of the communicator's ranks (a rank waiting for
    another root's broadcast would wait forever)."""
    roots = comm.allgather_obj(root)
    if any(r != roots[0] for r in roots):
        raise ValueError('ranks disagree on root: %s' % ', '.join(
            'rank %d: %r' % rr for rr in enumerate(roots)))
    if isinstance(root, bool) or not isinstance(root, (int, numpy.integer)) \
            or not 0 <= root < comm.size:
        raise ValueError('root %r is not a rank of a communicator of size %d'
                         % (root, comm.size))


def _from_root(comm, root, produce):
    """``produce()`` on ``root``, broadcast to every rank; an error there is
    raised on every rank (as the same built-in type where it is one)."""
    if comm.rank == root:
        try:
            message = ('ok', produce())
        except (TypeError, ValueError) as e:
            message = ('error', type(e), str(e))
    else:
        message = None
    message = comm.bcast_obj(message, root=root)
    if message[0] == 'error':
        raise message[1]('on the root rank %d: %s' % (root, message[2]))
    return message[1]


def _scatter_index(n_total_samples, size, force_equal_length):
    """Yield ``(rank, begin, end)`` of each of ``size`` ranks' shares of
    ``n_total_samples`` examples, ChainerMN's split: with
    ``force_equal_length`` every share has ceil(n / size) examples, rank
    r's starting at floor(n * r / size) (neighbouring shares overlap
    rather than run past the end); without it the shares are disjoint and
    the first n % size ranks take one example more."""
    if size <= 0 or n_total_samples < 0:
        raise ValueError('cannot split %d examples over %d ranks'
                         % (n_total_samples, size))
    if force_equal_length:
        share = -(-n_total_samples // size)
        for rank in range(size):
            begin = n_total_samples * rank // size
            yield rank, begin, begin + share
        return
    begin = 0
    for rank in range(size):
        end = begin + n_total_samples // size + (rank < n_total_samples % size)
        yield rank, begin, end
        begin = end


def share_bounds(n_total_samples, size, force_equal_length):
    """``[(begin, end)]`` of each of ``size`` ranks' shares of
    ``n_total_samples`` examples, as ``scatter_dataset`` cuts them."""
    return [(b, e) for _, b, e in _scatter_index(
        n_total_samples, size, force_equal_length)]


def _scatter_shares(n_total_samples, comm, root, force_equal_length):
    if comm.rank == root:
        shares = [(b, e) for _, b, e in _scatter_index(
            n_total_samples, comm.size, force_equal_length)]
    else:
        shares = None
    return comm.scatter_obj(shares, root=root)


def scatter_index(n_total_samples, comm, root=0, *, force_equal_length=True):
    """This rank's ``(begin, end)`` of ``n_total_samples`` examples (the
    value given on ``root`` counts), split as ``scatter_dataset`` splits
    them; see there for ``force_equal_length``."""
    _check_root(comm, root)
    n_total_samples = _from_root(comm, root, lambda: int(n_total_samples))
    return _scatter_shares(n_total_samples, comm, root, force_equal_length)


def scatter_dataset(dataset, comm, root=0, shuffle=False, seed=None,
                    max_buf_len=256 * 1024 * 1024, *,
                    force_equal_length=True):
    """Give each rank its share of ``dataset`` (the one ``root`` holds;
    the others' are ignored), as a ``ScatteredDataset`` (a
    ``chainer.datasets.SubDataset`` that knows which of the whole
    dataset's examples it holds).

    With ``shuffle`` the examples are taken in the order of a permutation
    drawn from ``numpy.random.RandomState(seed)``.  With
    ``force_equal_length`` (the default; keep it for updaters and
    multi-node evaluators, which need the same number of iterations on
    every rank) every rank gets ceil(n / size) examples and neighbouring
    shares may overlap; without it the shares are disjoint and differ by
    at most one example (an exact evaluation).  ``max_buf_len`` is
    accepted for ChainerMN compatibility: objects are always sent in
    pieces, so there is no limit.
    """
    del max_buf_len
    _check_root(comm, root)

    def dataset_and_order():
        n_total = len(dataset)
        order = (numpy.random.RandomState(seed).permutation(n_total)
                 if shuffle else None)
        return dataset, order
    dataset, order = _from_root(comm, root, dataset_and_order)
    begin, end = _scatter_shares(len(dataset), comm, root,
                                 force_equal_length)
    return ScatteredDataset(dataset, begin, end, order, force_equal_length)
