"""The timeline's cost on mean_grads: ResNet-50's gradients (25.6 M
float32, mnopt.benchmarking.workloads) averaged on the flat communicator,
the timeline off or on.  A micro-benchmark, not a test.

    mpiexec -n 2 python -m mpi4py benchmarks/timeline_overhead.py off
    mpiexec -n 2 python -m mpi4py benchmarks/timeline_overhead.py on

Run it from another checkout's root (PYTHONPATH) with ``off`` to time the
code before the timeline was instrumented.  Prints rank 0's median and
quartiles of ``rounds`` calls in ms."""

import os
import sys
import tempfile
import time

import numpy
from mpi4py import MPI

import mnopt
from mnopt.benchmarking import workloads


def main(mode='off', rounds=40, warmup=5):
    options = {}
    directory = None
    if mode == 'on':
        directory = MPI.COMM_WORLD.bcast(
            tempfile.mkdtemp(prefix='mnopt-tl-bench-')
            if MPI.COMM_WORLD.rank == 0 else None)
        options['timeline'] = os.path.join(directory, 'trace.json')
    comm = mnopt.create_communicator('flat', **options)
    grads = workloads.grad_list(workloads.resnet50_grad_shapes(), comm.rank)
    times = []
    for i in range(warmup + int(rounds)):
        comm.mpi_comm.Barrier()
        start = time.perf_counter()
        comm.mean_grads(grads)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    comm.finalize()
    if comm.rank == 0:
        q1, med, q3 = numpy.percentile(times, [25, 50, 75]) * 1e3
        print('%-4s %d ranks, %d calls: median %.2f ms (quartiles %.2f, '
              '%.2f)' % (mode, comm.size, len(times), med, q1, q3))


if __name__ == '__main__':
    main(*sys.argv[1:2])
