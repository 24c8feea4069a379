"""Which hosts an elastic relaunch runs on (``python -m mnopt.launch
--hosts ... --min-nodes K --procs-per-node P -- python train.py ...``):
the hosts given (a list, a host file or Slurm's node list), a short probe
of each before every attempt, the ones that answer, and the mpiexec
command that starts the job on them.

A host that does not answer is dropped for that attempt and taken back
at the first attempt where it answers again; each change is said with
its reason.  The probe is a command run per host (``{host}`` replaced):
by default ``ssh -o BatchMode=yes -o ConnectTimeout=5 {host} true``,
and nothing at all for this machine's own names; tests give one that
fakes hosts going and coming.
"""

import os
import re
import shlex
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor

#: The default probe: a host answers if ssh can run ``true`` on it.
SSH_PROBE = 'ssh -o BatchMode=yes -o ConnectTimeout=5 {host} true'
#: Seconds a probe may take before its host counts as not answering.
PROBE_TIMEOUT_S = 15.0


def parse_host_list(text):
    """``h1,h2,...`` as a list of names (empty items dropped);
    ValueError for a host named twice."""
    hosts = [h.strip() for h in text.split(',') if h.strip()]
    twice = sorted({h for h in hosts if hosts.count(h) > 1})
    if twice:
        raise ValueError('host %s is named twice: name each host once (the '
                         'processes per host are --procs-per-node)'
                         % ', '.join(twice))
    return hosts


def read_hostfile(path):
    """The hosts of an MPI host file: one a line, ``#`` comments; what
    follows the name (``:4``, ``slots=4``) is ignored (the processes per
    host are ``--procs-per-node``)."""
    hosts = []
    with open(path) as f:
        for line in f:
            line = line.split('#', 1)[0].strip()
            if line:
                name = re.split(r'[\s:]', line, maxsplit=1)[0]
                if re.search(r'[\[\],]', name):
                    raise ValueError(
                        '%s: %r is no host name: write one host a line, '
                        'each by its full name (no [ranges]; for Slurm\'s '
                        'node lists use --hosts "$(scontrol show hostnames '
                        '| paste -sd,)")' % (path, line))
                hosts.append(name)
    return parse_host_list(','.join(hosts))


def _expand_range(ranges):
    names = []
    for part in ranges.split(','):
        if '-' in part:
            first, last = part.split('-', 1)
            names += ['%0*d' % (len(first), n)
                      for n in range(int(first), int(last) + 1)]
        else:
            names.append(part)
    return names


def _expand_name(item, text):
    """One name of a node list, each bracket expanded (``rack[1-2]-n[01-02]``
    is four names, the last bracket varying fastest, as Slurm's)."""
    found = re.match(r'^([^\[\]]*)\[([0-9,-]+)\](.*)$', item)
    if found is None:
        if '[' in item or ']' in item:
            raise ValueError('%r is not a Slurm node list (at %r): give the '
                             'hosts as --hosts h1,h2,...' % (text, item))
        return [item]
    prefix, ranges, rest = found.groups()
    try:
        middles = _expand_range(ranges)
    except ValueError:
        raise ValueError('%r is not a Slurm node list (at %r): give the '
                         'hosts as --hosts h1,h2,...' % (text, item))
    return [prefix + m + tail for m in middles
            for tail in _expand_name(rest, text)]


def expand_slurm_nodelist(text):
    """Slurm's compressed node list (``node[01-03,07],gpu5``,
    ``rack[1-2]-node[01-02]``) as names, as ``scontrol show hostnames``
    prints them; ValueError for a list it cannot read."""
    items = re.findall(r'(?:[^,\[]|\[[^\]]*\])+', text)
    if ','.join(items) != text.strip(','):
        raise ValueError('%r is not a Slurm node list: give the hosts as '
                         '--hosts h1,h2,...' % text)
    return [h for item in items for h in _expand_name(item, text) if h]


def hosts_from(hosts=None, hostfile=None, environ=None):
    """The hosts given: ``--hosts``, ``--hostfile``, or Slurm's
    ``SLURM_JOB_NODELIST``; ValueError saying what to give where none
    is."""
    environ = os.environ if environ is None else environ
    if hosts:
        return parse_host_list(hosts)
    if hostfile:
        return read_hostfile(hostfile)
    if environ.get('SLURM_JOB_NODELIST'):
        return parse_host_list(','.join(expand_slurm_nodelist(
            environ['SLURM_JOB_NODELIST'])))
    raise ValueError('no hosts: give --hosts h1,h2,..., --hostfile FILE, '
                     'or run inside a Slurm allocation (SLURM_JOB_NODELIST)')


def _own_names():
    names = {'localhost', '127.0.0.1', socket.gethostname()}
    try:
        names.add(socket.getfqdn())
    except OSError:
        pass
    return names


def command_probe(template=SSH_PROBE, timeout=PROBE_TIMEOUT_S):
    """A probe ``probe(host) -> None or why not``: the command
    ``template`` (``{host}`` replaced) must exit 0 within ``timeout``
    seconds.  The default ssh probe answers for this machine's own names
    without running anything."""
    own = _own_names() if template == SSH_PROBE else set()

    def probe(host):
        if host in own:
            return None
        argv = shlex.split(template.replace('{host}', host))
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, timeout=timeout)
        except subprocess.TimeoutExpired:
            return 'the probe took more than %g s' % timeout
        except OSError as e:
            return 'the probe could not run (%s)' % e
        if done.returncode != 0:
            said = done.stderr.decode(errors='replace').strip().splitlines()
            return 'the probe exited with status %d%s' % (
                done.returncode, ': ' + said[-1] if said else '')
        return None
    return probe


def probe_all(probe, hosts):
    """{host: None or why not}, every host probed at once (a host whose
    probe hangs costs one probe timeout, not one per host)."""
    if not hosts:
        return {}
    with ThreadPoolExecutor(max_workers=min(len(hosts), 64)) as pool:
        return dict(zip(hosts, pool.map(probe, hosts)))


class HostPool(object):
    """The hosts of an elastic job and which of them answered at the last
    probe.  ``select()`` probes every host and returns the ones that
    answer, saying (through ``say``) which it dropped or took back, and
    why."""

    def __init__(self, hosts, probe, say):
        self.hosts, self.probe, self.say = list(hosts), probe, say
        self.down = {}   #: host -> why it did not answer

    def select(self):
        up = []
        said = probe_all(self.probe, self.hosts)
        for host in self.hosts:
            why = said[host]
            if why is None:
                if host in self.down:
                    self.say('mnopt.launch: took back %s: it answers again '
                             '(it did not: %s)' % (host, self.down.pop(host)))
                up.append(host)
            else:
                if host not in self.down:
                    self.say('mnopt.launch: dropped %s: %s' % (host, why))
                self.down[host] = why
        return up

    def why_down(self):
        return '; '.join('%s: %s' % hw for hw in sorted(self.down.items()))


def mpi_flavour(mpiexec):
    """'openmpi' or 'hydra' (MPICH, Intel MPI, MVAPICH), by what
    ``mpiexec --version`` says."""
    try:
        said = subprocess.run([mpiexec, '--version'], capture_output=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 'hydra'
    return 'openmpi' if b'Open MPI' in said or b'OpenRTE' in said \
        else 'hydra'


def mpiexec_command(mpiexec, flavour, hosts, procs_per_node, command):
    """The command that runs ``command`` on ``procs_per_node`` processes
    of each host in ``hosts``, in host order."""
    listed = ','.join('%s:%d' % (h, procs_per_node) for h in hosts)
    option = '--host' if flavour == 'openmpi' else '-hosts'
    return [mpiexec, option, listed, '-n', str(len(hosts) * procs_per_node)
            ] + list(command)


class ElasticPlan(object):
    """Each attempt's command: the hosts that answer now, at least
    ``min_nodes`` of them, or None (too few: the reasons are said)."""

    def __init__(self, pool, min_nodes, procs_per_node, command,
                 mpiexec='mpiexec', flavour=None, rejoin_dir=None,
                 probe_interval=30.0):
        self.pool, self.min_nodes = pool, min_nodes
        self.procs_per_node, self.command = procs_per_node, command
        self.mpiexec = mpiexec
        self.flavour = flavour or mpi_flavour(mpiexec)
        self.hosts = None   #: the hosts of the attempt last started
        #: Where snapshots appear (--take-back-after-snapshot), or None.
        self.rejoin_dir = rejoin_dir
        self.probe_interval = probe_interval
        self._back = None   #: (hosts answering again, the snapshots then)
        self._answers = {}   #: host left out -> probes answered in a row
        self._flaps = {}   #: host -> relaunches to take it back it missed
        #: The hosts the last relaunch meant to take back but that did
        #: not answer at its own probe (the launcher counts that restart
        #: as a failure).
        self.missed_take_back = []

    def answers_needed(self, host):
        """Probes in a row ``host``, left out, must answer before the
        job is restarted on purpose to take it back: 1, doubled each
        time it then did not answer at the relaunch (a host that flaps
        would otherwise restart the job forever)."""
        return 2 ** self._flaps.get(host, 0)

    def _note_missed_take_back(self, up):
        self.missed_take_back = [h for h in (self._back or ((), ))[0]
                                 if h not in up]
        for host in self.missed_take_back:
            self._flaps[host] = self._flaps.get(host, 0) + 1
            self.pool.say(
                'mnopt.launch: %s did not answer at the relaunch: not taken '
                'back (%s); it is taken back on purpose again only once it '
                'answers %d probes in a row' % (
                    host, self.pool.down.get(host, 'it did not answer'),
                    self.answers_needed(host)))

    def command_for_attempt(self):
        up = self.pool.select()
        self._note_missed_take_back(up)
        self._back, self._answers = None, {}
        if len(up) < self.min_nodes:
            self.pool.say(
                'mnopt.launch: %d of %d hosts answer, fewer than --min-nodes '
                '%d: not starting the job (%s)' % (
                    len(up), len(self.pool.hosts), self.min_nodes,
                    self.pool.why_down()))
            return None
        if up != self.hosts:
            self.pool.say('mnopt.launch: starting on %d host%s (%s), %d '
                          'process%s each' % (
                              len(up), 's' * (len(up) > 1), ','.join(up),
                              self.procs_per_node,
                              'es' * (self.procs_per_node > 1)))
        self.hosts = up
        return mpiexec_command(self.mpiexec, self.flavour, up,
                               self.procs_per_node, self.command)

    def takes_back(self):
        """Whether the attempt running now watches for a host to take
        back: one is left out, and snapshots are watched."""
        return self.rejoin_dir is not None and self.hosts is not None and \
            len(self.hosts) < len(self.pool.hosts)

    def _snapshot_files(self):
        """{name: modification time} of the complete snapshot files in
        ``rejoin_dir``: files only (Chainer writes into a temporary
        folder), none whose name starts with '.' (mnopt's partial
        files, written but not yet complete)."""
        try:
            with os.scandir(self.rejoin_dir) as entries:
                return {e.name: e.stat().st_mtime_ns for e in entries
                        if not e.name.startswith('.') and e.is_file()}
        except OSError:
            return {}

    def _answering_again(self):
        back = []
        said = probe_all(self.pool.probe, [
            h for h in self.pool.hosts if h not in self.hosts])
        for host, why in said.items():
            answered = why is None
            self._answers[host] = self._answers.get(host, 0) + 1 \
                if answered else 0
            if self._answers[host] >= self.answers_needed(host):
                back.append(host)
        return back

    def time_to_take_back(self):
        """Called every ``probe_interval`` while an attempt runs: probes
        the hosts left out; once one has answered enough probes in a row
        (``answers_needed``), True as soon as a snapshot file is complete
        that was not before (a new name, or a name written again), however
        often snapshots come."""
        if self._back is None:
            back = self._answering_again()
            if back:
                self._back = (back, self._snapshot_files())
                self.pool.say(
                    'mnopt.launch: %s answer%s again: the job restarts to '
                    'take %s back after the next snapshot in %s' % (
                        ','.join(back), 's' * (len(back) == 1),
                        'it' if len(back) == 1 else 'them', self.rejoin_dir))
            return False
        before = self._back[1]
        new = sorted(n for n, t in self._snapshot_files().items()
                     if before.get(n) != t)
        if new:
            self.pool.say('mnopt.launch: a snapshot was written (%s): ending '
                          'the job to relaunch it with %s' % (
                              ', '.join(new), ','.join(self._back[0])))
            return True
        return False
