"""The averaging cases: mean_grads per communicator and wire, beside the
raw-Allreduce limit and ChainerMN's naive communicator, and their table."""

import atexit
import json
import os

import numpy
from mpi4py import MPI

from mnopt.benchmark import harness
from mnopt.benchmark.harness import bus_bandwidth, print_heading, print_row
from mnopt.benchmark.workloads import (grad_list, link_holding,
                                       resnet50_grad_shapes)


def _limit_case(comm, n_elements, chunk):
    buf = numpy.ones(n_elements, dtype=numpy.float32)

    def run():
        for start in range(0, n_elements, chunk):
            comm.Allreduce(MPI.IN_PLACE, buf[start:start + chunk])
    return run


SIGN_COMMS = {}  # case label -> its sign-compressed communicator
#: The table's columns: 31 + 6 x (1 + 7) = 79, within 80.
LABEL_WIDTH, CELL_WIDTH = 31, 7


def build_cases(args, world):
    import mnopt
    shapes = resnet50_grad_shapes()
    total = sum(int(numpy.prod(s)) for s in shapes)
    # One set of gradients for every case (a rank held one per case: a
    # gigabyte for the default cases).  Each case averages it in place, its
    # repetitions too: after the first averaging every rank holds the same
    # values, whichever case left them.
    grads = grad_list(shapes, world.rank)
    model = []   # the Link holding them, made once where a case needs one

    def link():
        if not model:
            model.append(link_holding(grads))
        return model[0]
    cases = []
    if not args.only_mnopt:
        limit_comm = world.Dup()
        for mib in [4, 16] if args.quick else [1, 4, 16, 64]:
            cases.append(('limit: Allreduce, %d MiB chunks' % mib, 'limit',
                          _limit_case(limit_comm, total, mib << 18)))
        cases += _chainermn_cases(link, world)
    for name in args.communicators:
        for wire, options, label in _variants(name, args):
            if name == 'reduction_server':
                options['stats'] = True
            if name != 'reduction_server' and world != MPI.COMM_WORLD:
                options['mpi_comm'] = world   # the workers of a server job
            comm = mnopt.create_communicator(
                name, bucket_bytes=args.bucket_bytes, **options)
            if name == 'reduction_server' and world.rank == 0:
                atexit.register(lambda c=comm: print(c.stats.format(
                    'worker 0 %s' % c.allreduce_grad_dtype)))
            average = _averaging(comm, grads, link,
                                 getattr(args, 'through_model', False))
            cases.append(('mnopt %s %s' % (name, label), name, average))
            if wire == 'sign':
                SIGN_COMMS[cases[-1][0]] = comm
            if args.compare_checks and name != 'reduction_server':
                # The same averaging with stall detection and the overflow
                # check off: what the checks cost.
                off = mnopt.create_communicator(
                    name, bucket_bytes=args.bucket_bytes, stall_warning=0,
                    timeout=0, on_overflow='ignore', **options)
                cases.append(('mnopt %s %s, checks off' % (name, label),
                              name + ' checks off',
                              _averaging(off, grads, link,
                                         getattr(args, 'through_model',
                                                 False))))
    return cases, total


def _averaging(comm, grads, link, through_model):
    """One averaging of ``grads`` (ResNet-50's) on ``comm``: ``mean_grads``
    on the arrays, or (``through_model``) ``multi_node_mean_grad`` on the
    Chainer Link holding them (``link()``), the path a ChainerMN user
    takes."""
    if through_model:
        model = link()
        return lambda: comm.multi_node_mean_grad(model)
    return lambda: comm.mean_grads(grads)


def _chainermn_cases(link, world):
    """ChainerMN's naive communicator, where ChainerMN can run here."""
    from mnopt.server import job as server_job
    try:
        if server_job.job().servers:
            raise RuntimeError('a job with reduction servers')
        import chainermn
        cmn = chainermn.create_communicator('naive', mpi_comm=world.Dup())
    except Exception as e:  # not installed, or not importable here
        if world.rank == 0:
            print('# ChainerMN not available (%s); skipping it' % e)
        return []
    model = link()
    return [('chainermn naive', 'chainermn',
             lambda: cmn.multi_node_mean_grad(model))]


def _variants(name, args):
    """(wire, communicator options, label) for each of --dtypes; 'sign'
    is sign compression (majority vote), not a dtype, once per --votes
    (the reduction server votes its own way)."""
    for wire in args.dtypes:
        if wire != 'sign':
            yield wire, {'allreduce_grad_dtype': wire}, wire
        elif name == 'reduction_server':
            yield wire, {'compression': 'sign'}, wire
        else:
            for vote in args.votes:
                label = wire if vote == 'ring' else '%s (%s vote)' % (wire,
                                                                      vote)
                yield wire, {'compression': 'sign', 'vote': vote}, label


def report(cases, times, total, world, args, link_bytes=None):
    """Rank 0: the table of ``cases``' ``times`` (the slowest rank's, shape
    (cases, reps)) over ``total`` float32 elements, and the JSON file of
    ``args.json``."""
    nbytes = total * 4
    medians = numpy.median(times, axis=1)
    limit = min([m for m, c in zip(medians, cases) if c[1] == 'limit'],
                default=None)
    rows = []
    print_heading(
        'mean_grads, ResNet-50 gradients (%d float32, %.1f MB), N=%d, %d '
        'repetitions after %d warm-up, slowest rank; algbw = bytes/time, '
        "busbw = algbw*2(N-1)/N (what each rank's link carries on a ring); "
        'MNOPT_ALLREDUCE=%s' % (total, nbytes / 1e6, world.size, args.reps,
                                harness.WARMUP, os.environ.get(
                                    'MNOPT_ALLREDUCE') or 'auto'))
    print_row('case', ('median', 'min', 'max', 'algbw', 'busbw', 'x'),
              LABEL_WIDTH, CELL_WIDTH)
    print_row('', ('ms', 'ms', 'ms', 'GB/s', 'GB/s', 'limit'), LABEL_WIDTH,
              CELL_WIDTH)
    for (label, kind, _), t, med in zip(cases, times, medians):
        row = {'case': label, 'kind': kind, 'median_s': float(med),
               'min_s': float(t.min()), 'max_s': float(t.max()),
               'algbw_GBps': nbytes / med / 1e9,
               'busbw_GBps': bus_bandwidth(nbytes / med / 1e9, world.size),
               'x_limit': float(med / limit) if limit else None}
        if label in SIGN_COMMS:  # measured: bytes rank 0 sent in its vote
            row['sent_bytes'] = SIGN_COMMS[label].vote_stats['bytes_sent']
        if link_bytes is not None:
            row['link_tx_bytes'] = link_bytes[len(rows)]
        rows.append(row)
        print_row(label, ('%.1f' % (med * 1e3), '%.1f' % (t.min() * 1e3),
                          '%.1f' % (t.max() * 1e3),
                          '%.3f' % row['algbw_GBps'],
                          '%.3f' % row['busbw_GBps'],
                          '%.2f' % row['x_limit'] if limit else '-'),
                  LABEL_WIDTH, CELL_WIDTH)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump({'n_ranks': world.size, 'n_elements': total,
                       'reps': args.reps, 'allreduce': os.environ.get(
                           'MNOPT_ALLREDUCE') or 'auto',
                       'through_model': getattr(args, 'through_model',
                                                False),
                       'rows': rows}, f, indent=1)
