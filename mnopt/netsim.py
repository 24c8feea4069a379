"""A simulated cluster on one machine: nodes with slow links, for MPI.

    python -m mnopt.netsim run --nodes 4 --ranks-per-node 2 --rate 1gbit \\
        -- python -m mnopt.benchmark --communicators flat
    python -m mnopt.netsim up --nodes 4 --rate 1gbit [--delay 1ms]
    python -m mnopt.netsim exec --nodes 4 -- python -m mnopt.benchmark
    python -m mnopt.netsim down
    python -m mnopt.netsim run --nodes 8 --topology chain --rate 1gbit \
        --link 3=200mbit -- ...        # a chain, its middle link slow

Each node is a Linux network namespace (``mnopt-n0`` ...).  Topologies:

- ``star`` (default): each node's ``eth0`` is a veth to a bridge in a
  switch namespace (``mnopt-sw``); link k is node k's.
- ``chain``: node k and node k+1 are joined by a veth (link k); a bridge
  in each node joins its one or two links and its own ``eth0``, so frames
  for nodes further along are forwarded node by node, every link in turn.

Both ends of every veth are shaped with tc (token bucket at ``--rate``, or
the rate given for that link with ``--link K=RATE``, plus a netem
``--delay`` if asked), so every link has its rate in each direction.
Nothing is added to the machine's own namespace, and the only addresses
used are the nodes' own (10.231.7.10 and up), inside namespaces this tool
creates and deletes.

MPI runs across the nodes with hydra's ssh launcher pointed at a script
that enters the node's namespace with its own hostname (so MPI sees
separate hosts); ``UCX_TLS=tcp`` keeps UCX from using shared memory
between "nodes" (its shared-memory transports cross namespaces).

``run`` brings the cluster up, runs the command, and tears it down, also
when interrupted.  Needs root and iproute2 (``ip``, ``tc``).

One idea, over 400 lines: the simulated cluster, its namespaces and
shaped links brought up, run in and torn down by its command line.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile

PREFIX = 'mnopt-'
SWITCH = PREFIX + 'sw'
SUBNET = '10.231.7.'
FIRST_HOST = 10
MAX_NODES = 64
TOPOLOGIES = ('star', 'chain')
TIMEOUT = 30  # seconds for any one ip/tc command


class NetsimError(RuntimeError):
    pass


def node_name(k):
    return '%sn%d' % (PREFIX, k)


def node_address(k):
    return SUBNET + str(FIRST_HOST + k)


def _sh(*cmd, check=True):
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=TIMEOUT)
    if check and proc.returncode != 0:
        raise NetsimError('%s failed: %s' % (' '.join(cmd),
                                             proc.stderr.strip()))
    return proc


def check_environment():
    """Raise NetsimError saying what is missing, or return None."""
    if os.geteuid() != 0:
        raise NetsimError('netsim needs root: it creates network namespaces '
                          'and shapes links with tc')
    for tool in ('ip', 'tc', 'unshare'):
        if shutil.which(tool) is None:
            raise NetsimError('netsim needs %r (apt-get install iproute2 '
                              'util-linux)' % tool)
    hydra_mpiexec()
    probe = PREFIX + 'probe'
    made = _sh('ip', 'netns', 'add', probe, check=False)
    _sh('ip', 'netns', 'del', probe, check=False)
    if made.returncode != 0:
        raise NetsimError('cannot create network namespaces here: %s'
                          % made.stderr.strip())


def namespaces():
    out = _sh('ip', 'netns', 'list').stdout.split('\n')
    return sorted(line.split()[0] for line in out
                  if line.startswith(PREFIX))


def down():
    """Delete every namespace this tool made (their veths go with them).
    Idempotent."""
    for ns in namespaces():
        _sh('ip', 'netns', 'del', ns, check=False)
    if namespaces():
        raise NetsimError('could not delete %s' % ', '.join(namespaces()))


def _shape(ns, dev, rate, delay):
    base = ['ip', 'netns', 'exec', ns, 'tc', 'qdisc', 'add', 'dev', dev]
    # Token bucket: the burst must cover a timer tick at this rate.
    tbf = ['tbf', 'rate', rate, 'burst', '256kb', 'latency', '100ms']
    if delay:
        _sh(*(base + ['root', 'handle', '1:', 'netem', 'delay', delay]))
        _sh(*(base + ['parent', '1:1', 'handle', '10:'] + tbf))
    else:
        _sh(*(base + ['root'] + tbf))


def up(nodes, rate='1gbit', delay=None, topology='star', link_rates=None):
    """Create ``nodes`` nodes joined as ``topology``, links shaped to
    ``rate`` except those in ``link_rates`` ({link index: rate}).  Tears
    down any previous cluster first, so it is idempotent."""
    if not 1 <= nodes <= MAX_NODES:
        raise NetsimError('--nodes must be 1..%d, not %d' % (MAX_NODES, nodes))
    if topology not in TOPOLOGIES:
        raise NetsimError('unknown topology %r; choose one of %s'
                          % (topology, ', '.join(TOPOLOGIES)))
    link_rates = dict(link_rates or {})
    n_links = nodes if topology == 'star' else nodes - 1
    bad = sorted(k for k in link_rates if not 0 <= k < n_links)
    if bad:
        raise NetsimError('no link %s in a %s of %d nodes (links 0..%d)'
                          % (bad[0], topology, nodes, n_links - 1))
    check_environment()
    down()
    try:
        for k in range(nodes):
            ns = node_name(k)
            _sh('ip', 'netns', 'add', ns)
            node = ['ip', 'netns', 'exec', ns]
            if topology == 'chain':
                # The node's bridge br0 joins its links and its own eth0
                # (a veth to port 'host': UCX's TCP transport skips
                # bridges as interfaces).
                _sh(*(node + ['ip', 'link', 'add', 'br0', 'type', 'bridge']))
                _sh(*(node + ['ip', 'link', 'add', 'eth0', 'type', 'veth',
                              'peer', 'name', 'host']))
                _sh(*(node + ['ip', 'link', 'set', 'host', 'master', 'br0']))
                _sh(*(node + ['ip', 'link', 'set', 'host', 'up']))
                _sh(*(node + ['ip', 'link', 'set', 'br0', 'up']))
            _sh(*(node + ['ip', 'link', 'set', 'lo', 'up']))
        join = _join_star if topology == 'star' else _join_chain
        for k in range(n_links):
            join(k, link_rates.get(k, rate), delay)
        for k in range(nodes):
            node = ['ip', 'netns', 'exec', node_name(k)]
            _sh(*(node + ['ip', 'addr', 'add', node_address(k) + '/24',
                          'dev', 'eth0']))
            _sh(*(node + ['ip', 'link', 'set', 'eth0', 'up']))
    except BaseException:
        down()
        raise


def _join_star(k, rate, delay):
    """Link k: node k's eth0 to port pk of the switch's bridge."""
    sw = ['ip', 'netns', 'exec', SWITCH]
    if k == 0:
        _sh('ip', 'netns', 'add', SWITCH)
        _sh(*(sw + ['ip', 'link', 'add', 'br0', 'type', 'bridge']))
        _sh(*(sw + ['ip', 'link', 'set', 'br0', 'up']))
    port = 'p%d' % k
    _sh('ip', 'link', 'add', 'eth0', 'netns', node_name(k), 'type', 'veth',
        'peer', 'name', port, 'netns', SWITCH)
    _sh(*(sw + ['ip', 'link', 'set', port, 'master', 'br0']))
    _sh(*(sw + ['ip', 'link', 'set', port, 'up']))
    _shape(node_name(k), 'eth0', rate, delay)   # node -> switch
    _shape(SWITCH, port, rate, delay)           # switch -> node


def _join_chain(k, rate, delay):
    """Link k: node k's 'right' veth to node k+1's 'left', both ports of
    their node's bridge (STP off: a chain has no loops, and ports forward
    at once)."""
    a, b = node_name(k), node_name(k + 1)
    _sh('ip', 'link', 'add', 'right', 'netns', a, 'type', 'veth', 'peer',
        'name', 'left', 'netns', b)
    for ns, dev in ((a, 'right'), (b, 'left')):
        node = ['ip', 'netns', 'exec', ns]
        _sh(*(node + ['ip', 'link', 'set', dev, 'master', 'br0']))
        _sh(*(node + ['ip', 'link', 'set', dev, 'up']))
        _shape(ns, dev, rate, delay)


def parse_links(specs):
    """['3=200mbit', ...] -> {3: '200mbit'}."""
    rates = {}
    for spec in specs or ():
        k, sep, rate = spec.partition('=')
        if not sep or not k.strip().isdigit() or not rate:
            raise NetsimError('--link takes K=RATE (e.g. 3=200mbit), not %r'
                              % spec)
        rates[int(k)] = rate
    return rates


_LAUNCHER = '''#!/bin/sh
# hydra's ssh launcher calls: SCRIPT [ssh options] HOST COMMAND...
# Like ssh, hand the command words to a shell of the node as one string.
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
k=$(( ${host##*.} - %(first)d ))
exec ip netns exec %(prefix)sn$k unshare --uts sh -c \
    'hostname "$0" && eval "exec $1"' %(prefix)sn$k "$*"
'''


def hydra_mpiexec():
    """MPICH's mpiexec (hydra), which netsim drives with ``-launcher ssh
    -launcher-exec``: the environment's own, else the one on PATH."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which('mpiexec') or 'mpiexec'
    try:
        version = subprocess.run([mpiexec, '--version'], capture_output=True,
                                 text=True, timeout=30).stdout
    except OSError as e:
        raise NetsimError('netsim needs MPICH\'s mpiexec: %s' % e)
    if 'HYDRA' not in version:
        raise NetsimError('netsim launches through MPICH\'s mpiexec (hydra); '
                          '%s is another (%s)' % (mpiexec, version.strip()
                                                  .splitlines()[:1]))
    return mpiexec


def blas_threads_env(processes):
    """The simulated nodes share this machine's cores, which MPI cannot
    see (each node has its own hostname): each process gets its share of
    BLAS threads (mnopt/common/cores.py), unless the user set them."""
    from mnopt.common import cores
    if any(os.environ.get(name) for name in
           cores.USER_SETTINGS + ('MNOPT_BLAS_THREADS',)):
        return []
    return [('MNOPT_BLAS_THREADS', str(cores.share(processes)))]


def mpiexec_command(nodes, ranks_per_node, command, launcher, extra_env=(),
                    servers=0, server_args=()):
    """The argv that runs ``command`` on ``nodes`` x ``ranks_per_node``
    ranks, and with ``servers``, one ``python -m mnopt.server`` on each of
    the next ``servers`` nodes; it must itself run inside node 0 (see
    ``exec_in_cluster``)."""
    mpiexec = hydra_mpiexec()
    env = [('UCX_TLS', 'tcp')] + blas_threads_env(
        nodes * ranks_per_node + servers) + list(extra_env)
    hosts = ['%s:%d' % (node_address(k), ranks_per_node) for k in range(nodes)]
    hosts += ['%s:1' % node_address(nodes + k) for k in range(servers)]
    argv = [mpiexec, '-launcher', 'ssh', '-launcher-exec', launcher,
            '-iface', 'eth0', '-hosts', ','.join(hosts)]
    for key, value in env:
        argv += ['-genv', key, value]
    argv += ['-n', str(nodes * ranks_per_node)] + list(command)
    if servers:
        argv += [':', '-n', str(servers), sys.executable, '-m', 'mpi4py',
                 '-m', 'mnopt.server'] + list(server_args)
    return argv


def exec_in_cluster(nodes, ranks_per_node, command, timeout=None,
                    extra_env=(), servers=0, server_args=()):
    """Run ``command`` under mpiexec across the cluster (which must be up:
    ``nodes`` + ``servers`` nodes).  Returns the CompletedProcess; output
    is passed through."""
    present = namespaces()
    missing = [node_name(k) for k in range(nodes + servers)
               if node_name(k) not in present]
    if missing:
        raise NetsimError('the cluster is not up (missing %s); run '
                          '"python -m mnopt.netsim up --nodes %d" first'
                          % (', '.join(missing), nodes))
    tmp = tempfile.mkdtemp(prefix='mnopt-netsim-')
    launcher = os.path.join(tmp, 'launch.sh')
    with open(launcher, 'w') as f:
        f.write(_LAUNCHER % {'first': FIRST_HOST, 'prefix': PREFIX})
    os.chmod(launcher, 0o755)
    argv = mpiexec_command(nodes, ranks_per_node, command, launcher,
                           extra_env, servers, server_args)
    try:
        return subprocess.run(
            ['ip', 'netns', 'exec', node_name(0), 'unshare', '--uts', 'sh',
             '-c', 'hostname "$0" && exec "$@"', node_name(0)] + argv,
            timeout=timeout)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _terminate_on_sigterm():
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)


def _link(spec):
    """--link K=RATE, as an argparse type (kept as given: parse_links
    reads the list)."""
    try:
        parse_links([spec])
    except NetsimError as e:
        raise argparse.ArgumentTypeError(str(e))
    return spec


#: What each subcommand does, for --help.
VERBS = {
    'up': 'bring a cluster up (replacing any previous one) and leave it up',
    'run': 'bring a cluster up, run a command across it under mpiexec, and '
           'tear it down (also when interrupted)',
    'exec': 'run a command across the cluster that is up',
    'down': 'tear the cluster down (idempotent)',
}


def parser():
    """The command line: every option with its help, bad values refused by
    argparse (usage and an ``error:`` line, exit status 2)."""
    from mnopt.common import cli
    p = argparse.ArgumentParser(
        prog='python -m mnopt.netsim',
        description='A simulated cluster of nodes with shaped links.',
        epilog=cli.help_epilog(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='verb', required=True, metavar='COMMAND',
                           help='; '.join('%s: %s' % kv
                                          for kv in VERBS.items()))
    for verb, what in VERBS.items():
        s = sub.add_parser(verb, help=what, description=what)
        if verb == 'down':
            continue
        s.add_argument('--nodes', type=cli.int_range(1, MAX_NODES),
                       required=True, metavar='N',
                       help='nodes (1..%d), one network namespace each'
                            % MAX_NODES)
        if verb in ('up', 'run'):
            s.add_argument('--rate', default='1gbit',
                           help='each link, each direction (tc syntax; '
                                'default 1gbit)')
            s.add_argument('--delay', default=None,
                           help='one-way delay per link end, e.g. 1ms')
            s.add_argument('--topology', default='star', choices=TOPOLOGIES,
                           help='star: a switch, one link per node; chain: '
                                'node k and k+1 joined by link k (default '
                                'star)')
            s.add_argument('--link', action='append', default=[],
                           metavar='K=RATE', type=_link,
                           help='link K at RATE instead (star: node K\'s '
                                'link; chain: nodes K and K+1); repeatable')
        if verb in ('run', 'exec'):
            s.add_argument('--ranks-per-node', type=cli.positive_int,
                           default=1, metavar='N',
                           help='MPI ranks on each node (default 1)')
            s.add_argument('--servers', type=cli.nonnegative_int, default=0,
                           metavar='N',
                           help='also run this many reduction servers '
                                '(python -m mnopt.server), one per extra node')
            s.add_argument('--server-args', default='', metavar='ARGS',
                           help='arguments for the servers, one string')
            s.add_argument('--timeout', type=cli.positive_float,
                           default=3600, metavar='S',
                           help='seconds before the command is killed '
                                '(default 3600)')
            s.add_argument('command', nargs=argparse.REMAINDER,
                           help='the command each rank runs, after --')
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    command = [c for c in getattr(args, 'command', [])]
    if command[:1] == ['--']:
        command = command[1:]
    try:
        if args.verb == 'down':
            down()
            return 0
        if args.verb in ('up', 'run'):
            shape = dict(rate=args.rate, delay=args.delay,
                         topology=args.topology,
                         link_rates=parse_links(args.link))
        if args.verb == 'up':
            up(args.nodes, **shape)
            print('up: %d nodes, %s, at %s%s%s (%s)' % (
                args.nodes, args.topology, args.rate,
                ''.join(', link %s' % l for l in args.link),
                ', delay %s' % args.delay if args.delay else '',
                ', '.join(node_address(k) for k in range(args.nodes))))
            return 0
        if not command:
            p.error('give the command to run after --')
        extra = dict(servers=args.servers,
                     server_args=args.server_args.split())
        if args.verb == 'exec':
            return exec_in_cluster(args.nodes, args.ranks_per_node, command,
                                   args.timeout, **extra).returncode
        _terminate_on_sigterm()
        up(args.nodes + args.servers, **shape)
        try:
            return exec_in_cluster(args.nodes, args.ranks_per_node, command,
                                   args.timeout, **extra).returncode
        finally:
            down()
    except NetsimError as e:
        sys.stderr.write('netsim: %s\n' % e)
        return 2


if __name__ == '__main__':
    sys.exit(main())
