"""GenericMultiNodeEvaluator: any evaluation, computed batch by batch on
every rank and combined on one."""

import copy

from chainer import function
from chainer.dataset import convert
from chainer.training import extension

from mnopt.communicators import any_communicator


class GenericMultiNodeEvaluator(extension.Extension):
    """ChainerMN's evaluation that is not a mean: each rank runs
    ``calc_local(*batch)`` on each batch of its own (non-repeating)
    ``iterator``; ``root`` gets every result, in ChainerMN's order (round
    by round: the first batch of every rank in rank order, then the
    second...; ranks may have different numbers of batches), and returns
    ``aggregate(results)``.  Calling it (or the trainer, as an extension)
    returns that on ``root`` and None elsewhere.

    By default ``calc_local`` calls ``target`` and ``aggregate`` returns
    the list of results, as ChainerMN's; override them.  A result of None
    is left out (ChainerMN reads it as a rank with no batch left).
    ``progress_hook(batch)`` is called after each local batch, on every
    rank (ChainerMN: on ``root`` only).  A ``calc_local`` error on any rank is raised on every rank
    (the rank's own error there, RuntimeError naming it elsewhere)."""

    trigger = 1, 'epoch'
    default_name = 'validation'
    priority = extension.PRIORITY_WRITER
    name = None

    def __init__(self, comm, iterator, target, device=None,
                 converter=convert.concat_examples, root=0, *,
                 progress_hook=None):
        if not 0 <= root < comm.size:
            raise ValueError('root %r is not a rank of a communicator of '
                             'size %d' % (root, comm.size))
        self.comm = comm
        self.iterator = iterator
        self._targets = {'main': target}
        self.device = device
        self.converter = converter
        self.root = root
        self._progress_hook = progress_hook

    @property
    def target(self):
        return self._targets['main']

    def calc_local(self, *args, **kwargs):
        """One batch's result (anything picklable but None); by default
        ``target(*args, **kwargs)``."""
        return self._targets['main'](*args, **kwargs)

    def aggregate(self, results):
        """The evaluation, from every rank's results (on ``root`` only);
        by default the list itself."""
        return results

    def _local_results(self):
        it = self.iterator
        if hasattr(it, 'reset'):
            it.reset()
        else:
            it = copy.copy(it)
        results = []
        with function.no_backprop_mode():
            for batch in it:
                arrays = self.converter(batch, self.device)
                if isinstance(arrays, tuple):
                    result = self.calc_local(*arrays)
                elif isinstance(arrays, dict):
                    result = self.calc_local(**arrays)
                else:
                    result = self.calc_local(arrays)
                results.append(result)
                if self._progress_hook is not None:
                    self._progress_hook(batch)
        return results

    def __call__(self, trainer=None):
        error = None
        try:
            results = self._local_results()
        except Exception as e:
            results, error = None, e
        any_communicator.raise_together(self.comm, error,
                                        'GenericMultiNodeEvaluator')
        # The results go to root as ChainerMN's do: the user's gather_obj.
        gathered = self.comm.gather_obj(results, root=self.root)
        if self.comm.rank != self.root:
            return None
        rounds = max(len(r) for r in gathered)
        return self.aggregate([
            rank_results[i] for i in range(rounds)
            for rank_results in gathered
            if i < len(rank_results) and rank_results[i] is not None])
