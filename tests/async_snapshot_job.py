"""A job of tests/test_async_snapshot.py, under mpiexec: a small trainer
with an asynchronous multi_node_snapshot every 2 iterations (every rank
writes its own file), to iteration 6.

    python -m mpi4py async_snapshot_job.py run OUTDIR KILL_RANK PHASE
        KILL_RANK is SIGKILLed at PHASE of its write of iteration 4
        (mnopt.extensions.background_writer's phases; 'written-alone':
        at 'written' once rank 0's file of iteration 4 is in place, the
        kill between two ranks' writes).  -1: no kill.
    python -m mpi4py async_snapshot_job.py resume OUTDIR
        autoload; prints 'LOADED <snapshot> AT <iteration>' on each rank.
"""

import os
import signal
import sys
import time

import chainer
import chainer.links as L
import numpy

import mnopt
from mnopt.extensions import background_writer


def trainer_for(comm, out, autoload, asynchronous=True):
    numpy.random.seed(0)   # the same model in every run
    model = L.Classifier(L.Linear(3, 2))
    rng = numpy.random.RandomState(comm.rank)
    x = rng.standard_normal((32, 3)).astype(numpy.float32)
    t = (x[:, 0] > 0).astype(numpy.int32)
    it = chainer.iterators.SerialIterator(
        chainer.datasets.TupleDataset(x, t), 4, shuffle=False)
    opt = mnopt.create_multi_node_optimizer(chainer.optimizers.SGD(0.1),
                                            comm)
    opt.setup(model)
    trainer = chainer.training.Trainer(
        chainer.training.StandardUpdater(it, opt), (6, 'iteration'), out=out)
    ext = mnopt.extensions.multi_node_snapshot(
        comm, chainer.training.extensions.snapshot(autoload=autoload),
        list(range(comm.size)), asynchronous=asynchronous)
    trainer.extend(ext, trigger=(2, 'iteration'))
    return trainer, ext


def wait_for(path):
    while not os.path.exists(path):
        time.sleep(0.01)


def kill_at(comm, out, phase):
    """The hook: SIGKILL this rank at ``phase`` of its write of iteration
    4, once the snapshot of iteration 2 is complete on every rank (so
    that the newest complete snapshot is known)."""
    def hook(at, filename):
        if not filename.startswith('snapshot_iter_4.'):
            return
        if phase == 'written-alone':
            if at != 'written':
                return
            wait_for(os.path.join(out, 'snapshot_iter_4.0'))
        elif at != phase:
            return
        elif phase == 'renamed':   # every rank's file in place
            for r in range(comm.size):
                wait_for(os.path.join(out, 'snapshot_iter_4.%d' % r))
        for r in range(comm.size):
            wait_for(os.path.join(out, 'snapshot_iter_2.%d' % r))
        os.kill(os.getpid(), signal.SIGKILL)
    return hook


def main():
    action, out = sys.argv[1], sys.argv[2]
    comm = mnopt.create_communicator('naive')
    if action == 'run':
        kill_rank, phase = int(sys.argv[3]), sys.argv[4]
        if comm.rank == kill_rank:
            background_writer.phase_hook = kill_at(comm, out, phase)
        trainer, _ = trainer_for(comm, out, autoload=False)
        trainer.run()
    else:
        trainer, ext = trainer_for(comm, out, autoload=True)
        ext.initialize(trainer)
        print('LOADED %s AT %d' % (ext.loaded, trainer.updater.iteration),
              flush=True)
    comm.allgather_obj(None)


if __name__ == '__main__':
    main()
