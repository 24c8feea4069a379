"""Which hosts an elastic relaunch runs on (``python -m mnopt.launch
--hosts ... --min-nodes K --procs-per-node P -- python train.py ...``):
the hosts given (mnopt/launch/hosts.py: a list, a host file or Slurm's
node list), a short probe of each before every attempt, the ones that
answer, and the mpiexec command that starts the job on them.

A host that does not answer is dropped for that attempt and taken back
at the first attempt where it answers again; a host the launcher blamed
for a failure (its ranks failed first, or never started) is left out
while enough others answer, until it has answered more probes each time
(``ElasticPlan.leave_out``); each change is said with its reason.  The
probe is mnopt/launch/probe.py's.  With ``--take-back-after-snapshot
DIR`` a running job is ended to take a host back once a complete
snapshot is in DIR (mnopt/launch/snapshots.py).
"""

import os
import subprocess
import time

from mnopt.launch import snapshots as elastic_snapshots
from mnopt.launch.probe import probe_all


class HostPool(object):
    """The hosts of an elastic job and which of them answered at the last
    probe.  ``select()`` probes every host and returns the ones that
    answer, saying (through ``say``) which it dropped or took back, and
    why."""

    def __init__(self, hosts, probe, say):
        self.hosts, self.probe, self.say = list(hosts), probe, say
        self.down = {}   #: host -> why it did not answer
        #: Set when the launcher must stop: probes are not waited for.
        self.stopping = None

    def select(self):
        up = []
        said = probe_all(self.probe, self.hosts, self.stopping)
        if self.stopping is not None and self.stopping.is_set():
            return [h for h in self.hosts if said[h] is None]   # unsaid
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
    ``min_nodes`` of them, or None (too few: the reasons are said).  A
    host the launcher blamed for a failure (``leave_out``) is left out
    (used only once the wait for ``min_nodes`` others ran out) until it
    has answered 2**n probes (n: the times it was left out), and is not
    taken back on purpose by a take-back."""

    def __init__(self, pool, min_nodes, procs_per_node, command,
                 mpiexec='mpiexec', flavour=None, rejoin_dir=None,
                 probe_interval=30.0, snapshot_pattern='snapshot*'):
        if rejoin_dir is not None and not os.path.isdir(rejoin_dir):
            raise ValueError(
                '--take-back-after-snapshot %s: no such folder: give the '
                'folder the job writes its snapshots to (its --out; make it '
                'first where the job has not yet)' % rejoin_dir)
        self.pool, self.min_nodes = pool, min_nodes
        self.procs_per_node, self.command = procs_per_node, command
        self.mpiexec = mpiexec
        self.flavour = flavour or mpi_flavour(mpiexec)
        self.hosts = None   #: the hosts of the attempt last started
        #: Where snapshots appear (--take-back-after-snapshot), or None.
        self.rejoin_dir = rejoin_dir
        self.probe_interval, self.pattern = probe_interval, snapshot_pattern
        self._unknown = 0   #: looks that found new files, no snapshot's
        #: [hosts answering again, the files then, at the last look]
        self._back = None
        self._answers = {}   #: host left out -> probes answered in a row
        self._flaps = {}   #: host -> relaunches to take it back it missed
        self._strikes = {}   #: host -> times it was left out
        self._cooling = {}   #: host left out -> probes it must answer yet
        self._why_out = {}   #: host left out -> why
        #: Hosts left out for a failure that have not run since: never
        #: taken back on purpose (only at a failure's relaunch).
        self._blamed = set()
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

    def is_left_out(self, host):
        return host in self._cooling

    def let_back(self, host):
        """Undo leaving ``host`` out: it was not the host to blame."""
        self._cooling.pop(host, None)
        self._why_out.pop(host, None)
        self._blamed.discard(host)
        self._strikes[host] -= 1

    def leave_out(self, hosts, why):
        """After a failed attempt: leave ``hosts`` out of the next attempts
        (``why``: what they did) until each has answered 2**n probes, the
        relaunch's own among them (n: the times it was left out), while
        at least ``min_nodes`` others answer."""
        for host in hosts:
            self._blamed.add(host)
            n = self._strikes[host] = self._strikes.get(host, 0) + 1
            self._cooling[host], self._why_out[host] = 2 ** n, why
            self.pool.say(
                'mnopt.launch: leaving %s out: %s; it runs again once it '
                'has answered %d probes (before that, only where fewer than '
                '--min-nodes %d other hosts answer after --wait-for-nodes)'
                % (host, why, 2 ** n, self.min_nodes))

    def _cool(self, answered):
        """Count a probe answered by each host left out in ``answered``;
        the hosts whose wait it ends (said)."""
        over = []
        for host in answered:
            if host in self._cooling:
                self._cooling[host] -= 1
                if self._cooling[host] <= 0:
                    del self._cooling[host]
                    over.append(host)
                    self.pool.say(
                        'mnopt.launch: %s has answered %d probes since it '
                        'was left out (%s): it may run again' % (
                            host, 2 ** self._strikes[host],
                            self._why_out.pop(host)))
        return over

    def _select(self):
        """(the hosts that answer, those of them not left out)."""
        up = self.pool.select()
        self._cool(up)
        return up, [h for h in up if h not in self._cooling]

    def _keep(self, up, use, waited):
        """``use`` with the hosts left out that --min-nodes needs (said),
        once --wait-for-nodes brought no other."""
        kept = [h for h in up if h in self._cooling][
            :max(0, self.min_nodes - len(use))]
        self.pool.say(
            'mnopt.launch: running on %s though it was left out (%s): '
            'without it fewer than --min-nodes %d hosts answer%s' % (
                ','.join(kept), '; '.join(self._why_out[h] for h in kept),
                self.min_nodes, ' after waiting %g s (--wait-for-nodes)'
                % waited if waited else ''))
        return [h for h in up if h not in self._cooling or h in kept]

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

    def command_for_attempt(self, wait=0.0, stopping=None):
        """The next attempt's mpiexec command, or None where fewer than
        ``min_nodes`` hosts answer, after probing again every
        ``probe_interval`` (1 s at least) for up to ``wait`` seconds, or
        until ``stopping`` (a threading.Event) is set."""
        up, use = self._select()
        self._note_missed_take_back(up)
        self._back, self._answers = None, {}
        deadline, told = time.monotonic() + wait, False
        while len(use) < self.min_nodes:
            if stopping is not None and stopping.is_set():
                return None   # the launcher says it is interrupted
            left = deadline - time.monotonic()
            short = '%d of %d hosts answer%s, fewer than --min-nodes %d' % (
                len(up), len(self.pool.hosts), ' (%d not left out for a '
                'failure)' % len(use) if len(use) < len(up) else '',
                self.min_nodes)
            pause = min(max(self.probe_interval, 1.0), left)
            if not told and left > 0:
                told = True
                self.pool.say('mnopt.launch: %s: waiting up to %g s '
                              '(--wait-for-nodes) for more, probing every '
                              '%g s%s' % (short, wait, pause, ' (%s)' %
                                          self.pool.why_down()
                                          if self.pool.down else ''))
            if left <= 0 or (stopping.wait(pause) if stopping is not None
                             else time.sleep(pause)):
                if stopping is not None and stopping.is_set():
                    return None
                if len(up) >= self.min_nodes:   # a host left out it is
                    use = self._keep(up, use, wait)
                    break
                self.pool.say('mnopt.launch: %s: not starting the job (%s)%s'
                              % (short, self.pool.why_down(),
                                 ' after waiting %g s (--wait-for-nodes)' %
                                 wait if left <= 0 and wait else ''))
                return None
            up, use = self._select()
        if use != self.hosts:
            self.pool.say('mnopt.launch: starting on %d host%s (%s), %d '
                          'process%s each' % (
                              len(use), 's' * (len(use) > 1), ','.join(use),
                              self.procs_per_node,
                              'es' * (self.procs_per_node > 1)))
        self.hosts = use
        self._blamed -= set(use)
        return mpiexec_command(self.mpiexec, self.flavour, use,
                               self.procs_per_node, self.command)

    def takes_back(self):
        """Whether the attempt running now watches for a host to take
        back: one is left out, and snapshots are watched."""
        return self.rejoin_dir is not None and self.hosts is not None and \
            bool(self._takable())

    def _takable(self):
        """The hosts left out a take-back may take back: not those left
        out for a failure (they run again only at a failure's relaunch,
        once they waited: its ranks may fail again at once)."""
        return [h for h in self.pool.hosts
                if h not in self.hosts and h not in self._blamed]

    def _answering_again(self):
        back = []
        said = probe_all(self.pool.probe, self._takable(),
                         self.pool.stopping)
        self._cool([h for h, why in said.items() if why is None])
        for host, why in said.items():
            answered = why is None and host not in self._cooling
            self._answers[host] = self._answers.get(host, 0) + 1 \
                if answered else 0
            if self._answers[host] >= self.answers_needed(host):
                back.append(host)
        return back

    def time_to_take_back(self):
        """Called every ``probe_interval`` while an attempt runs: probes
        the hosts left out; once one has answered enough probes in a row
        (``answers_needed``, after its wait if it was left out), True as
        soon as a snapshot is complete in ``rejoin_dir`` whose every file
        was written since (mnopt/launch/snapshots.py), however often
        snapshots come."""
        if self._back is None:
            back = self._answering_again()
            if back:
                files = elastic_snapshots.listing(self.rejoin_dir)
                self._back = [back, files, files]
                self.pool.say(
                    'mnopt.launch: %s answer%s again: the job restarts to '
                    'take %s back after the next snapshot in %s' % (
                        ','.join(back), 's' * (len(back) == 1),
                        'it' if len(back) == 1 else 'them', self.rejoin_dir))
            return False
        new = elastic_snapshots.new_since(
            self.rejoin_dir, self._back[1],
            len(self.hosts) * self.procs_per_node, self.pattern)
        self._back[2], unknown = elastic_snapshots.unknown_since(
            self.rejoin_dir, self._back[2], self.pattern)
        self._unknown += 1 if unknown else 0
        if self._unknown == 3:   # said once, at the 3rd look with new files
            self.pool.say(
                'mnopt.launch: files keep appearing in %s (%s), none a '
                'snapshot named as --snapshot-pattern %s: if the job\'s '
                'snapshots are named otherwise, give their pattern, or no '
                'take-back comes' % (self.rejoin_dir, ', '.join(
                    unknown[:3]), self.pattern))
        if new:
            self.pool.say('mnopt.launch: a complete snapshot was written '
                          '(%s): ending the job to relaunch it with %s' % (
                              ', '.join(new), ','.join(self._back[0])))
            return True
        return False
