"""create_multi_node_n_step_rnn: a stacked RNN link split across ranks by
layers of time (ChainerMN's): the initial hidden states come from one rank,
the final ones go to another."""

import chainer
from chainer.links.rnn import n_step_rnn

from mnopt.functions import point_to_point
from mnopt.links.communicator_sharing import deepcopy_sharing


class MultiNodeNStepRNN(chainer.Chain):
    """``actual_rnn`` (an NStep RNN link) whose initial states are received
    from ``rank_in`` and whose final states are sent to ``rank_out`` (None:
    no receive / no send).  Called with the RNN's inputs (without the
    states); returns the RNN's outputs followed by the delegate variable of
    the sends (None when ``rank_out`` is None), to backpropagate from or tie
    in with pseudo_connect."""

    def __init__(self, link, communicator, rank_in=None, rank_out=None):
        if not isinstance(link, n_step_rnn.NStepRNNBase):
            raise ValueError(
                'create_multi_node_n_step_rnn needs a stacked RNN link '
                '(chainer.links.NStepLSTM, NStepGRU, NStepRNNTanh, ... or '
                'their Bi versions), not %s' % type(link).__name__)
        for name, rank in (('rank_in', rank_in), ('rank_out', rank_out)):
            if rank is not None and not 0 <= rank < communicator.size:
                raise ValueError('create_multi_node_n_step_rnn: %s %r is not '
                                 'in the communicator (size %d)'
                                 % (name, rank, communicator.size))
        super(MultiNodeNStepRNN, self).__init__()
        with self.init_scope():
            self.actual_rnn = link
        self.communicator = communicator
        self.rank_in, self.rank_out = rank_in, rank_out
        self.n_cells = link.n_cells   # (h,) or (h, c)

    def __deepcopy__(self, memo):
        return deepcopy_sharing(self, memo, self.communicator)

    def forward(self, *inputs):
        cells = [None] * self.n_cells
        if self.rank_in is not None:
            delegate = None
            for i in range(self.n_cells):
                # Each receive follows the previous one, so that backward
                # returns the gradients last first, the order in which the
                # sender's backward waits for them.
                cells[i] = point_to_point.recv(
                    self.communicator, rank=self.rank_in,
                    delegate_variable=delegate)
                delegate = cells[i]
        outputs = self.actual_rnn(*(tuple(cells) + inputs))

        delegate = None
        if self.rank_out is not None:
            for cell in outputs[:self.n_cells]:
                if delegate is not None:
                    cell, = point_to_point.pseudo_connect(delegate, cell)
                delegate = point_to_point.send(cell, self.communicator,
                                               rank=self.rank_out)
        return tuple(outputs) + (delegate,)


def create_multi_node_n_step_rnn(actual_link, communicator, rank_in=None,
                                 rank_out=None):
    """A MultiNodeNStepRNN around ``actual_link`` (a
    ``chainer.links.NStep*`` stacked RNN): it receives the initial hidden
    states (h, and c for an LSTM) from ``rank_in``, runs the RNN, sends the
    final states to ``rank_out``, and returns the RNN's outputs followed by
    the delegate variable of the sends."""
    return MultiNodeNStepRNN(actual_link, communicator, rank_in, rank_out)
