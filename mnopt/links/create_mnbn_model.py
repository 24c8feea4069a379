"""create_mnbn_model: a copy of a model with every BatchNormalization
replaced by MultiNodeBatchNormalization (ChainerMN's helper)."""

import copy

import chainer

from mnopt.links.batch_normalization import check_communication_backend
from mnopt.links.batch_normalization import MultiNodeBatchNormalization


def _mnbn_from(bn, comm, communication_backend):
    mnbn = MultiNodeBatchNormalization(
        bn.avg_mean.shape, comm, decay=bn.decay, eps=bn.eps,
        dtype=bn.avg_mean.dtype, use_gamma=hasattr(bn, 'gamma'),
        use_beta=hasattr(bn, 'beta'),
        communication_backend=communication_backend)
    mnbn.copyparams(bn)
    mnbn.avg_mean[...] = bn.avg_mean
    mnbn.avg_var[...] = bn.avg_var
    mnbn.N = bn.N
    mnbn.name = bn.name
    if bn.xp is not mnbn.xp:
        mnbn.to_device(bn.device)
    return mnbn


def create_mnbn_model(link, comm, communication_backend='auto'):
    """A deep copy of ``link`` in which every
    ``chainer.links.BatchNormalization`` (at any depth, in Chains and
    ChainLists alike) is a MultiNodeBatchNormalization with the same
    parameters and running statistics, given ``communication_backend``
    ('mpi', 'nccl' or 'auto', checked first).  ``link`` is left
    unchanged; the copy shares the communicators the model holds."""
    check_communication_backend(comm, communication_backend)
    if isinstance(link, chainer.links.BatchNormalization):
        return _mnbn_from(link, comm, communication_backend)
    new = copy.deepcopy(link)
    _replace_in(new, comm, communication_backend)
    return new


def _replace_in(link, comm, backend):
    # Chainer 7 keeps a Chain's children as attributes named in _children
    # and a ChainList's in the list _children (a Sequential's also in
    # _layers): the layout of every Chainer 7 release, which ChainerMN's
    # helper relies on too.
    if isinstance(link, chainer.ChainList):
        for i, child in enumerate(list(link._children)):
            if isinstance(child, chainer.links.BatchNormalization):
                new = link._children[i] = _mnbn_from(child, comm, backend)
                # chainer.Sequential also runs its layers from _layers.
                layers = getattr(link, '_layers', [])
                for k, layer in enumerate(layers):
                    if layer is child:
                        layers[k] = new
            else:
                _replace_in(child, comm, backend)
    elif isinstance(link, chainer.Chain):
        for name in sorted(link._children):
            child = getattr(link, name)
            if isinstance(child, chainer.links.BatchNormalization):
                link.__dict__[name] = _mnbn_from(child, comm, backend)
            else:
                _replace_in(child, comm, backend)
