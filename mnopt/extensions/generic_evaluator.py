"""GenericMultiNodeEvaluator: any evaluation, computed batch by batch on
every rank and combined on one."""

import chainer
from chainer import function
from chainer.dataset import convert
from chainer.training import extension


class GenericMultiNodeEvaluator(extension.Extension):
    """Subclass it and define ``calc_local(*batch)``, which returns a
    picklable result for one batch of this rank's ``iterator``, and
    ``aggregate(results)``, which gets the results of every rank's batches
    (rank by rank, in batch order) on ``root`` and returns the evaluation.
    Calling it (or the trainer, as an extension) returns that on ``root``
    and None elsewhere; ranks may have different numbers of batches.
    ``progress_hook(batch)`` is called after each local batch."""

    trigger = 1, 'epoch'
    default_name = 'validation'
    priority = extension.PRIORITY_WRITER
    name = None

    def __init__(self, comm, iterator, target, device=None,
                 converter=convert.concat_examples, root=0,
                 progress_hook=None):
        self.comm = comm
        self.iterator = iterator
        self.target = target
        self.device = device
        self.converter = converter
        self.root = root
        self.progress_hook = progress_hook

    def calc_local(self, *args, **kwargs):
        raise NotImplementedError('define calc_local in a subclass')

    def aggregate(self, results):
        raise NotImplementedError('define aggregate in a subclass')

    def __call__(self, trainer=None):
        it = self.iterator
        if hasattr(it, 'reset'):
            it.reset()
        results = []
        with function.no_backprop_mode(), \
                chainer.using_config('train', False):
            for batch in it:
                arrays = self.converter(batch, self.device)
                if isinstance(arrays, tuple):
                    result = self.calc_local(*arrays)
                elif isinstance(arrays, dict):
                    result = self.calc_local(**arrays)
                else:
                    result = self.calc_local(arrays)
                results.append(result)
                if self.progress_hook is not None:
                    self.progress_hook(batch)
        gathered = self.comm.gather_obj(results, root=self.root)
        if self.comm.rank != self.root:
            return None
        return self.aggregate([r for rank in gathered for r in rank])
