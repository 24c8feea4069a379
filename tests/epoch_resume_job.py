"""One side of an interrupted epoch (tests/test_epoch_resume.py): under
mpiexec, for each configuration (iterator, its shuffle, scatter_dataset's
shuffle and force_equal_length), a trainer over a scattered dataset of
example indices whose updater only logs which example each batch read, in
which epoch.  ``first``: two iterations, a multi_node_snapshot at the
second (rank 0 alone writes it: one replica set).  ``middle``: autoload,
one iteration, a snapshot inside the rest of epoch 0.  ``resume``:
autoload, then on to the end of epoch 0.  Each rank writes what it read
as JSON.  ``checkpointer``: ChainerMN's create_multi_node_checkpointer
(each rank's own file, ``maybe_load``) instead of multi_node_snapshot.

    python -m mpi4py epoch_resume_job.py first|middle|resume OUTDIR N BATCH
        [snapshot|checkpointer]
"""

import json
import os
import sys

import chainer
import numpy

import mnopt

CONFIGS = [(kind, it_shuffle, scatter_shuffle, equal)
           for kind, it_shuffle in [('serial', True), ('serial', False),
                                    ('multiprocess', True)]
           for scatter_shuffle in (True, False)
           for equal in (True, False)]


class LoggingUpdater(chainer.training.StandardUpdater):
    """Reads a batch and logs its examples by epoch; no training (the
    read order is what is tested)."""

    def __init__(self, iterator, optimizer, log):
        super().__init__(iterator, optimizer)
        self.log = log

    def update_core(self):
        it = self.get_iterator('main')
        batch = [int(i) for i in it.next()]
        if it.is_new_epoch:   # the last current_position: the next epoch's
            ended = len(batch) - it.current_position
            self.log.setdefault(it.epoch - 1, []).extend(batch[:ended])
            self.log.setdefault(it.epoch, []).extend(batch[ended:])
        else:
            self.log.setdefault(it.epoch, []).extend(batch)


def run(comm, phase, out, n, batch, config, saver='snapshot'):
    kind, it_shuffle, scatter_shuffle, equal = config
    data = mnopt.scatter_dataset(numpy.arange(n), comm,
                                 shuffle=scatter_shuffle, seed=5,
                                 force_equal_length=equal)
    if kind == 'serial':
        it = chainer.iterators.SerialIterator(data, batch,
                                              shuffle=it_shuffle)
    else:
        it = chainer.iterators.MultiprocessIterator(
            data, batch, shuffle=it_shuffle, n_processes=1)
    link = chainer.links.Linear(1, 1)
    opt = chainer.optimizers.SGD()
    opt.setup(link)
    log = {}
    stop = {'first': (2, 'iteration'), 'middle': (3, 'iteration')}.get(
        phase, (1, 'epoch'))
    trainer = chainer.training.Trainer(LoggingUpdater(it, opt, log), stop,
                                       out=out)
    if saver == 'checkpointer':
        extension = mnopt.create_multi_node_checkpointer('job', comm)
        if phase != 'first':
            extension.maybe_load(trainer, opt)
    else:
        extension = mnopt.extensions.multi_node_snapshot(
            comm, chainer.training.extensions.snapshot(
                autoload=phase != 'first'))
    # 'middle': resumed at 2, a snapshot at 3, inside the rest of the
    # epoch.  Resumed to the end: no more snapshots (without
    # force_equal_length the ranks end the epoch, and stop, at different
    # iterations).
    trainer.extend(extension, trigger=(
        {'first': 2, 'middle': 3}.get(phase, 10 ** 6), 'iteration'))
    trainer.run()
    if kind == 'multiprocess':
        it.finalize()
    with open(os.path.join(out, '%s.%d.json' % (phase, comm.rank)), 'w') as f:
        json.dump({str(k): v for k, v in log.items()}, f)


def main():
    phase, base, n, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
        int(sys.argv[4])
    saver = sys.argv[5] if len(sys.argv) > 5 else 'snapshot'
    comm = mnopt.create_communicator('naive')
    for k, config in enumerate(CONFIGS):
        out = os.path.join(base, str(k))
        if comm.rank == 0:
            os.makedirs(out, exist_ok=True)
        comm.allgather_obj(None)
        run(comm, phase, out, n, batch, config, saver)
    comm.allgather_obj(None)


if __name__ == '__main__':
    main()
