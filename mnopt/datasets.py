"""Splitting a dataset over ranks."""

import numpy
from chainer.dataset import DatasetMixin


def scatter_index(n_total, comm, root=0, shuffle=False, seed=None,
                  force_equal_length=True):
    """Each rank's (start, stop, order) over a dataset of ``n_total``."""
    if comm.rank == root:
        order = (numpy.random.RandomState(seed).permutation(n_total)
                 if shuffle else None)
        args = []
        for r in range(comm.size):
            start = n_total * r // comm.size
            stop = n_total * (r + 1) // comm.size
            if force_equal_length:
                # Pad short ranks (by wrapping around) so every rank runs
                # the same number of iterations per epoch.
                stop = start + -(-n_total // comm.size) if n_total else start
            args.append((start, stop, order))
        return comm.scatter_obj(args, root=root)
    return comm.scatter_obj(None, root=root)


class _ScatteredDataset(DatasetMixin):
    """Examples ``start`` to ``stop`` of ``dataset`` (in ``order`` when
    given); the range may run past the end and wraps around."""

    def __init__(self, dataset, start, stop, order):
        self._dataset = dataset
        index = numpy.arange(start, stop) % max(len(dataset), 1)
        self._index = index if order is None else numpy.asarray(order)[index]

    def __len__(self):
        return len(self._index)

    def get_example(self, i):
        return self._dataset[int(self._index[i])]


def scatter_dataset(dataset, comm, root=0, shuffle=False, seed=None,
                    max_buf_len=None, force_equal_length=True):
    """Give each rank a near-equal share of ``dataset`` (held by ``root``).

    With ``force_equal_length`` the shares are padded by wrapping around so
    all ranks have the same length.  ``max_buf_len`` is accepted for
    ChainerMN compatibility: large objects are always sent in chunks.
    """
    del max_buf_len
    n_total = len(dataset) if comm.rank == root else None
    n_total = comm.bcast_obj(n_total, root=root)
    start, stop, order = scatter_index(n_total, comm, root, shuffle, seed,
                                       force_equal_length)
    data = comm.bcast_obj(dataset if comm.rank == root else None, root=root)
    return _ScatteredDataset(data, start, stop, order)


def create_empty_dataset(dataset):
    """A dataset as long as ``dataset`` whose examples are empty tuples:
    for ranks that take part in every iteration (model parallelism) but
    read no input."""
    return [()] * len(dataset)


class DataSizeError(RuntimeError):
    """ChainerMN raises it when a dataset is too large to scatter in one
    message; mnopt moves objects in pieces, so it is never raised.  Here so
    that scripts catching it import unchanged."""
