"""AllreducePersistent: persistent values (batch normalization's running
statistics) averaged over ranks."""

import numpy

from mnopt.communicators import any_communicator
from mnopt.common.arrays import as_array_like, to_host


class AllreducePersistent(object):
    """Replace every floating-point persistent array of ``model`` by its
    mean over ranks (e.g. before evaluation, so that every rank evaluates
    with the same running statistics).  Integer and scalar persistents
    (counters) are left alone.  Use as an extension or call directly.

    All float persistents travel in one buffer, summed in float64.  Ranks
    whose persistents differ in names or shapes get a ValueError on every
    rank."""

    trigger = 1, 'epoch'
    priority = 0  # after the writers and readers of the same iteration

    def __init__(self, model, comm):
        self.model = model
        self.comm = comm

    def __call__(self, trainer=None):
        arrays = []
        for link_name, link in sorted(self.model.namedlinks()):
            # Chainer 7 lists a link's persistent names only in the set
            # _persistent, which every Link of Chainer 2-7 keeps.
            for name in sorted(link._persistent):
                value = link.__dict__[name]
                if hasattr(value, 'dtype') and value.dtype.kind == 'f' \
                        and getattr(value, 'ndim', 0) > 0:
                    arrays.append((link_name + '/' + name, link, name,
                                   value))
        layout = [(n, tuple(v.shape)) for n, _, _, v in arrays]
        layouts = any_communicator.everyone(
            self.comm, layout, 'AllreducePersistent (the persistent values)')
        bad = [r for r, lay in enumerate(layouts) if lay != layouts[0]]
        if bad:
            raise ValueError('AllreducePersistent: the persistent values of '
                             'rank 0 and rank %d differ: %s vs %s'
                             % (bad[0], layouts[0], layouts[bad[0]]))
        if not arrays:
            return
        flat = numpy.concatenate([
            to_host(v).astype(numpy.float64).ravel()
            for _, _, _, v in arrays])
        total = to_host(self.comm.allreduce(flat)) / self.comm.size
        start = 0
        for _, link, name, value in arrays:
            mean = total[start:start + value.size].reshape(value.shape)
            start += value.size
            link.__dict__[name] = as_array_like(mean.astype(value.dtype), value)
