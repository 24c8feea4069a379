"""ChainerMN's links.  Layer 6 (chainer) of docs/architecture.md."""

from mnopt.links.batch_normalization import MultiNodeBatchNormalization  # NOQA
from mnopt.links.create_mnbn_model import create_mnbn_model  # NOQA
from mnopt.links.multi_node_chain_list import MultiNodeChainList  # NOQA
from mnopt.links.n_step_rnn import create_multi_node_n_step_rnn  # NOQA
