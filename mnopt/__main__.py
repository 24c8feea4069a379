"""``python -m mnopt``: the version, and the commands mnopt ships.

mnopt's tools are modules of their own (``python -m mnopt.check``, ...),
because most run as MPI ranks under a launcher (``mpiexec -n 2 python -m
mpi4py -m mnopt.check``); this entry point only tells a new user they
exist.  It imports nothing but mnopt's package (no MPI), so it works
anywhere mnopt is installed.
"""

from __future__ import annotations

import argparse
import sys

import mnopt

#: (module, how it is run, what it does), in the order shown.
COMMANDS = (
    ('check', 'mpiexec -n 2 python -m mpi4py -m mnopt.check',
     'check a launch and the install: ranks, versions, optional parts'),
    ('benchmark', 'mpiexec -n 2 python -m mpi4py -m mnopt.benchmark '
     '[--quick]',
     'time gradient averaging per communicator and wire dtype'),
    ('launch', 'python -m mnopt.launch --max-restarts 3 -- mpiexec ...',
     'relaunch a job that died, resuming from its snapshots'),
    ('server', 'mpiexec -n W python train.py : -n S python -m mnopt.server',
     'the reduction server processes (reduction_server communicator)'),
    ('netsim', 'python -m mnopt.netsim run --nodes 2 --rate 1gbit -- ...',
     'a simulated cluster on one machine (root: network namespaces)'),
    ('report', 'python -m mnopt.report trace.rank*.json',
     'where each step\'s time went, from MNOPT_TIMELINE traces'),
)


def usage() -> str:
    lines = ['mnopt %s: multi-node data-parallel training for Chainer and '
             'CuPy' % mnopt.__version__, '(import mnopt as chainermn)',
             '', 'commands (each a module; --help on each for its options):']
    for name, run, what in COMMANDS:
        # Each on its own lines, so that the listing fits 80 columns.
        lines.append('  %-10s %s' % (name, what))
        lines.append('      %s' % run)
    return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog='python -m mnopt', description=usage(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--version', action='version',
                        version='mnopt %s' % mnopt.__version__)
    parser.parse_args(argv)
    print(usage())
    return 0


if __name__ == '__main__':
    sys.exit(main())
