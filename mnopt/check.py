"""Check a launch: who runs where, on what, and whether averaging works.

    mpiexec -n 4 python -m mnopt.check            (or srun python -m ...)

Rank 0 prints one line per rank (host, node, rank in node, GPU it would
use) and the versions every rank runs (Python, NumPy, mpi4py, the MPI
library, Chainer, CuPy, NCCL), then averages one small gradient on the
``flat`` communicator and checks the analytic mean.  It ends with
``mnopt check: OK`` (exit 0), or with a line per problem (exit 1): ranks
running different versions, more ranks on a node than GPUs where GPUs are
used, a wrong mean, a process alone in its MPI world though its
environment says the job has several (started without its launcher, or
with another MPI library's: mnopt/launched.py).
"""

import os
import platform
import socket
import sys

import numpy
from mpi4py import MPI

from mnopt import cli


def _version(module):
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or fails to import
        return None


def describe_process():
    """What this process runs on, as a dict of strings and numbers."""
    from mnopt.gpu import device, diagnosis
    cupys = diagnosis.cupy_distributions()
    info = {
        'host': socket.gethostname(),
        'python': platform.python_version(),
        'numpy': numpy.__version__,
        'mpi4py': _version('mpi4py'),
        'mpi': ' '.join(MPI.Get_library_version().split()[:3]),
        'thread_level': MPI.Query_thread(),
        'chainer': _version('chainer'),
        'cupy': ', '.join('%s %s' % kv for kv in sorted(cupys.items()))
        or None,
        'nccl': None, 'gpus': 0,
        'gpu_problem': diagnosis.gpu_problem() if cupys else 'CuPy not installed',
        'cuda_visible_devices': os.environ.get('CUDA_VISIBLE_DEVICES'),
    }
    if info['gpu_problem'] is None:
        cupy = device.cupy()
        from cupy.cuda import nccl
        info['nccl'] = nccl.get_version()
        info['gpus'] = cupy.cuda.runtime.getDeviceCount()
    return info


#: Fields every rank must agree on.
SAME_EVERYWHERE = ('python', 'numpy', 'mpi4py', 'mpi', 'chainer', 'cupy',
                   'nccl')


def problems(rows):
    """Lines describing what is wrong with a launch, from every rank's
    (rank, intra_rank, intra_size, node, info)."""
    out = []
    for field in SAME_EVERYWHERE:
        values = {}
        for rank, _, _, _, info in rows:
            values.setdefault(info[field], []).append(rank)
        if len(values) > 1:
            out.append('ranks disagree on %s: %s' % (field, '; '.join(
                '%s on ranks %s' % (v, r) for v, r in sorted(
                    values.items(), key=lambda kv: kv[1][0]))))
    for rank, intra_rank, intra_size, node, info in rows:
        if info['gpus'] and intra_size > info['gpus']:
            out.append('node %d (%s) runs %d ranks but sees %d GPU(s): one '
                       'process per GPU for pure_nccl' % (
                           node, info['host'], intra_size, info['gpus']))
            break
    return out


def parser():
    import argparse
    return argparse.ArgumentParser(
        prog='python -m mnopt.check',
        description=__doc__.split('\n')[0],
        epilog=__doc__.split('\n', 1)[1].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter)


def main(argv=None):
    # No options but --help: which must print the help, not run the check.
    cli.parse_args(parser(), argv)
    import mnopt
    from mnopt import launched
    world = MPI.COMM_WORLD
    comm = mnopt.create_communicator('flat')
    info = describe_process()
    rows = comm.allgather_obj((comm.rank, comm.intra_rank, comm.intra_size,
                               comm.inter_rank, info))
    grads = [('check', numpy.full(3, float(comm.rank), numpy.float32))]
    comm.mean_grads(grads)
    means = comm.allgather_obj(grads[0][1].tolist())
    found = problems(rows)
    alone = launched.problem(os.environ, world.Get_size())
    if alone is not None:
        found.append(alone)
    want = (comm.size - 1) / 2.0
    averaged_right = all(m == [want] * 3 for m in means)
    if not averaged_right:
        found.append('averaging gave %s, not %s on every rank' % (means, want))
    if world.rank == 0:
        print('mnopt check: %d ranks on %d nodes' % (comm.size,
                                                     comm.inter_size))
        print('%5s  %-24s %4s %9s %5s  %s' % ('rank', 'host', 'node',
                                              'in node', 'GPU', 'GPUs seen'))
        for rank, intra_rank, intra_size, node, row in rows:
            device = intra_rank % row['gpus'] if row['gpus'] else '-'
            print('%5d  %-24s %4d %4d of %-2d %5s  %s' % (
                rank, row['host'][:24], node, intra_rank, intra_size, device,
                row['gpus'] or row['gpu_problem']))
        first = rows[0][4]
        for field in SAME_EVERYWHERE + ('thread_level',):
            print('%-13s %s' % (field, first[field]))
        print('averaging     flat, mean of %d ranks %s' % (
            comm.size, 'ok' if averaged_right else 'WRONG'))
        for p in found:
            print('PROBLEM: ' + p)
        print('mnopt check: %s' % ('OK' if not found else
                                   '%d problem(s)' % len(found)))
        sys.stdout.flush()
    comm.finalize()
    return 1 if found else 0


if __name__ == '__main__':
    sys.exit(main())
