"""A job of tests/test_async_snapshot.py, under mpiexec: a trainer with a
sharded optimizer (Adam, shard_state=True) and an asynchronous
multi_node_snapshot(n_retains=1) every 2 iterations, to iteration 10.

    python -m mpi4py async_retention_job.py OUTDIR KILL
        KILL: 'none'; 'lost-node' (the last rank SIGKILLed as it writes
        snapshot 8, once every other rank's file of 8 is in place: its
        node lost mid-snapshot); 'second-failure' (rank 0 SIGKILLed
        during its background write of snapshot 8).
Prints 'LOADED <snapshot> AT <iteration>' on rank 0 after the autoload.
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


def snapshots(out):
    return sorted(n for n in os.listdir(out) if n.startswith('snap'))


def kill_at(comm, out, kill):
    def hook(at, name):
        if not name.startswith('snapshot_iter_8.'):
            return
        if kill == 'lost-node' and comm.rank == comm.size - 1 and \
                at == 'copied':
            for r in range(comm.size - 1):
                while not os.path.exists('%s/snapshot_iter_8.%d'
                                         % (out, r)):
                    time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        if kill == 'second-failure' and comm.rank == 0 and at == 'writing':
            print('KILLED WITH %s' % ' '.join(snapshots(out)), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    return hook


def main():
    out, kill = sys.argv[1], sys.argv[2]
    comm = mnopt.create_communicator('flat')
    numpy.random.seed(0)
    model = L.Classifier(L.Linear(3, 2))
    rng = numpy.random.RandomState(comm.rank)
    x = rng.standard_normal((64, 3)).astype(numpy.float32)
    t = (x[:, 0] > 0).astype(numpy.int32)
    it = chainer.iterators.SerialIterator(
        chainer.datasets.TupleDataset(x, t), 4, shuffle=False)
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.Adam(), comm, shard_state=True)
    opt.setup(model)
    trainer = chainer.training.Trainer(
        chainer.training.StandardUpdater(it, opt), (10, 'iteration'),
        out=out)
    ext = mnopt.extensions.multi_node_snapshot(
        comm, chainer.training.extensions.snapshot(autoload=True,
                                                   n_retains=1),
        asynchronous=True)
    trainer.extend(ext, trigger=(2, 'iteration'))
    background_writer.phase_hook = kill_at(comm, out, kill)

    @chainer.training.make_extension(trigger=(1, 'iteration'),
                                     priority=-1000)
    def nothing(trainer):
        pass

    def say_loaded(trainer):   # after the snapshot's autoload
        if comm.rank == 0:
            print('LOADED %s AT %d' % (ext.loaded,
                                       trainer.updater.iteration),
                  flush=True)
    nothing.initialize = say_loaded
    trainer.extend(nothing)
    trainer.run()


if __name__ == '__main__':
    main()
