"""MultiNodeChainList: one model split across ranks (ChainerMN's)."""

import chainer

from mnopt.functions import point_to_point


class MultiNodeChainList(chainer.ChainList):
    """A model whose parts run on different ranks.  On each rank, add the
    parts this rank runs with ``add_link(link, rank_in, rank_out)``:
    ``rank_in`` None means the part takes the model's inputs, else it
    receives (and sums) what those ranks send; ``rank_out`` None means its
    output is the model's output here, else it is sent to those ranks.
    ``forward`` returns the output, or on a rank without one the delegate
    variable to backpropagate from."""

    def __init__(self, comm):
        super(MultiNodeChainList, self).__init__()
        self._comm = comm
        self._rank_inouts = []

    def add_link(self, link, rank_in=None, rank_out=None):
        super(MultiNodeChainList, self).add_link(link)
        if isinstance(rank_in, int):
            rank_in = [rank_in]
        if isinstance(rank_out, int):
            rank_out = [rank_out]
        self._rank_inouts.append((rank_in, rank_out))

    def forward(self, *inputs):
        y, delegate = None, None
        for part, (rank_in, rank_out) in zip(self, self._rank_inouts):
            if rank_in is None:
                x = part(*inputs)
            else:
                x = None
                for source in rank_in:
                    received = point_to_point.recv(
                        self._comm, rank=source, delegate_variable=delegate)
                    delegate = None
                    x = received if x is None else x + received
                x = part(x)
            if rank_out is None:
                if y is not None:
                    raise ValueError('MultiNodeChainList: more than one '
                                     'part of this rank returns an output')
                y = x
                continue
            for dest in rank_out:
                sent = point_to_point.send(x, self._comm, rank=dest)
                delegate = sent if delegate is None else \
                    point_to_point.pseudo_connect(delegate, sent)
        if y is None:
            return delegate
        if delegate is not None:
            y = point_to_point.pseudo_connect(delegate, y)
        return y
