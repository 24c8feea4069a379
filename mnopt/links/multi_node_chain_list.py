"""MultiNodeChainList: one model split across ranks (ChainerMN's)."""

import collections
import numbers

import chainer

from mnopt.functions import point_to_point
from mnopt.links.communicator_sharing import deepcopy_sharing


def _ranks(ranks):
    """None, or the list of ranks (an int is a list of one)."""
    if ranks is None:
        return None
    return [int(ranks)] if isinstance(ranks, numbers.Integral) \
        else [int(r) for r in ranks]


def _after(delegate, x):
    """``x`` (a variable or a tuple of them) tied after ``delegate`` in the
    graph: backward reaches ``delegate``'s producer after ``x``'s users."""
    if delegate is None:
        return x
    if isinstance(x, tuple):
        return point_to_point.pseudo_connect(delegate, *x)
    y, = point_to_point.pseudo_connect(delegate, x)
    return y


def _handle(x):
    """The variable that stands for ``x`` as a delegate (a part's output
    may be a tuple: all of it goes to the same users)."""
    return x[0] if isinstance(x, tuple) else x


class MultiNodeChainList(chainer.ChainList):
    """A model whose parts run on different ranks.  On each rank, add the
    parts this rank runs with ``add_link(link, rank_in, rank_out)``, in the
    order they run:

    - ``rank_in`` None: the part takes the model's inputs; else a rank or a
      list of ranks, and the part is called with what each sends, in that
      order (``part(*received)``);
    - ``rank_out`` None: the part's output is the model's output (one part
      at most); else a rank or a list of ranks to send it to.

    A rank may send to itself: the output waits in a queue for a later part
    whose ``rank_in`` names this rank.  ``forward`` returns the output, or
    on a rank without one the delegate variable to backpropagate from.

    Backward runs the parts' communication in the reverse order of the
    forward pass, which is what the peers expect: each communication is
    tied after the previous one in the graph (pseudo_connect).

    A copy (``copy(mode='copy')``, ``copy.deepcopy``) shares the
    communicator.
    """

    def __init__(self, comm):
        super(MultiNodeChainList, self).__init__()
        self._comm = comm
        self._rank_inouts = []

    def add_link(self, link, rank_in=None, rank_out=None):
        rank_in, rank_out = _ranks(rank_in), _ranks(rank_out)
        for ranks in (rank_in, rank_out):
            for rank in ranks or ():
                if not 0 <= rank < self._comm.size:
                    raise ValueError(
                        'MultiNodeChainList: rank %r is not in the '
                        'communicator (size %d)' % (rank, self._comm.size))
        if rank_out is None and any(out is None
                                    for _, out in self._rank_inouts):
            raise ValueError('MultiNodeChainList: only one part can have '
                             'rank_out None (give the model output)')
        super(MultiNodeChainList, self).add_link(link)
        self._rank_inouts.append((rank_in, rank_out))

    def __deepcopy__(self, memo):
        return deepcopy_sharing(self, memo, self._comm)

    def forward(self, *inputs):
        me = self._comm.rank
        to_self = collections.deque()   # outputs sent to this rank
        y = None          # the model's output
        delegate = None   # the last communication, for the next to follow

        for i, (part, (rank_in, rank_out)) in enumerate(
                zip(self, self._rank_inouts)):
            if rank_in is None:
                xs = inputs
                if i > 0 and delegate is not None:
                    xs = point_to_point.pseudo_connect(delegate, *inputs)
                x = part(*xs)
            else:
                xs = []
                for source in rank_in:
                    if source == me:
                        if not to_self:
                            raise ValueError(
                                'MultiNodeChainList: part %d receives from '
                                'its own rank %d, but no earlier part sent '
                                'to it' % (i, me))
                        received = _after(delegate, to_self.popleft())
                    else:
                        received = point_to_point.recv(
                            self._comm, rank=source,
                            delegate_variable=delegate)
                    xs.append(received)
                    # The next receive follows this one, so that backward
                    # sends the gradients back in the reverse order.
                    delegate = _handle(received)
                # The part's output depends on every receive (and so on
                # what they follow): nothing more to tie.
                delegate = None
                x = part(*xs)

            if rank_out is None:
                y = x
                delegate = _handle(x)
                continue
            for k, dest in enumerate(rank_out):
                if k > 0 or dest == me:
                    # Each send follows the previous communication (the
                    # first one's x already does).
                    x = _after(delegate, x)
                if dest == me:
                    to_self.append(x)
                    delegate = _handle(x)
                else:
                    delegate = point_to_point.send(x, self._comm, rank=dest)

        if to_self:
            raise ValueError(
                'MultiNodeChainList: %d output(s) sent to rank %d itself were '
                'never received: every rank_out naming this rank needs a '
                'later rank_in naming it' % (len(to_self), me))
        if y is None:
            return delegate
        if _handle(y) is not delegate:
            # A part after the output's communicated: backward must reach it.
            y = _after(delegate, y)
        return y
