"""The message-size sweep: mean_grads of one float32 array per size, beside
one raw Allreduce; its table and figure."""

import numpy
from mpi4py import MPI

from mnopt.benchmark import harness
from mnopt.benchmark.harness import bus_bandwidth, print_heading, print_row


SWEEP_SIZES = [1 << k for k in range(10, 29, 2)]  # 1 KiB .. 256 MiB


def _reps_for(nbytes, reps):
    return max(3, reps if nbytes <= 1 << 20 else reps // 2
               if nbytes <= 16 << 20 else reps // 5)


def sweep(args, world):
    """mean_grads of one float32 array per message size, next to
    one raw Allreduce of the same buffer."""
    import mnopt
    # In a job with server processes, the others run over the workers.
    workers = {} if world == MPI.COMM_WORLD else {'mpi_comm': world}
    comms = [(name, wire, mnopt.create_communicator(
        name, allreduce_grad_dtype=wire,
        **({} if name == 'reduction_server' else workers)))
        for name in args.communicators for wire in args.dtypes]
    raw = world.Dup()
    rows = []
    sizes = [n for n in SWEEP_SIZES if n <= args.max_size]
    for i, nbytes in enumerate(sizes):
        n = nbytes // 4
        buf = numpy.ones(n, numpy.float32)
        cases = [('mpi4py Allreduce', 'raw',
                  lambda b=buf: raw.Allreduce(MPI.IN_PLACE, b))]
        for name, wire, comm in comms:
            grads = [('w', numpy.ones(n, numpy.float32))]
            cases.append(('mnopt %s %s' % (name, wire), name,
                          lambda c=comm, g=grads: c.mean_grads(g)))
        times = harness.run_cases(cases, world, _reps_for(nbytes, args.reps),
                                  progress='size %d/%d (%s): ' % (
                                      i + 1, len(sizes), _human(nbytes)))
        for (label, kind, _), t in zip(cases, times):
            med = float(numpy.median(t))
            rows.append({'bytes': nbytes, 'case': label, 'kind': kind,
                         'median_s': med, 'min_s': float(t.min()),
                         'max_s': float(t.max()),
                         'algbw_GBps': nbytes / med / 1e9,
                         'busbw_GBps': bus_bandwidth(nbytes / med / 1e9,
                                                     world.size)})
    return rows


def _human(nbytes):
    for unit in ('B', 'KiB', 'MiB', 'GiB'):
        if nbytes < 1024:
            return '%d %s' % (nbytes, unit)
        nbytes //= 1024
    return '%d TiB' % nbytes


#: The sweep's columns: size and case (37), then 5 x (1 + 7): 77.
LABEL_WIDTH, CELL_WIDTH = 37, 7


def print_sweep(rows, world):
    print_heading('mean_grads of one float32 array, N=%d, slowest rank; '
                  'algbw = bytes/time, busbw = algbw*2(N-1)/N' % world.size)
    print_row('    size  case', ('median', 'min', 'max', 'algbw', 'busbw'),
              LABEL_WIDTH, CELL_WIDTH)
    print_row('', ('ms', 'ms', 'ms', 'GB/s', 'GB/s'), LABEL_WIDTH,
              CELL_WIDTH)
    for r in rows:
        print_row('%8s  %s' % (_human(r['bytes']), r['case']), [
            '%.3f' % v for v in (r['median_s'] * 1e3, r['min_s'] * 1e3,
                                 r['max_s'] * 1e3, r['algbw_GBps'],
                                 r['busbw_GBps'])], LABEL_WIDTH, CELL_WIDTH)


def plot_sweep(rows, path, title):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for case in dict.fromkeys(r['case'] for r in rows):
        pts = [(r['bytes'], r['busbw_GBps']) for r in rows if r['case'] == case]
        ax.plot(*zip(*pts), marker='o', label=case)
    ax.set_xscale('log', base=2)
    ax.set_xlabel('message size (bytes)')
    ax.set_ylabel('bus bandwidth (GB/s)')
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
