"""ChainerMN's iterators (ChainerMN's module paths): one rank's batches
for every rank (``multi_node_iterator``), and the same shuffled order on
every rank (``synchronized_iterator``).  Layer 6 (chainer) of
docs/architecture.md.

Both check at creation that the ranks agree (which rank is the master, how
long the dataset is) and raise the same error on every rank if not, instead
of leaving some ranks waiting for batches that never come.
"""

from mnopt.iterators.multi_node_iterator import create_multi_node_iterator  # NOQA
from mnopt.iterators.synchronized_iterator import create_synchronized_iterator  # NOQA
