"""One attempt of ``python -m mnopt.launch``: the job started in a process
group of its own, its output passed through (noting what MPI's launcher
says of a rank a signal ended), its start watched, and the whole group
stopped when the launcher must stop it: nothing the attempt started
outlives the launcher's signal by more than a bounded wait.  After a
failed elastic attempt, the host it names (``blame``): where the first
failure was, or where ranks never started.

Its start: every rank of a job of several notes its start in the folder
``MNOPT_FAILURE_DIR`` when it imports mnopt (mnopt/common/failure_summary.py,
``note_start``: ``rank-N.start``), so the launcher, which made the folder,
knows which ranks started without asking MPI, which may itself hang (an
MPI launcher waits for ever for the proxy of a host that died before the
job started).
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from mnopt.common import failure_summary

#: What MPI's launchers say of a rank that a signal ended: MPICH's Hydra
#: (its pid and host, then the signal), Open MPI's (all on one line).
HYDRA_PID = re.compile(rb'PID (\d+) RUNNING AT (\S+)')
HYDRA_SIGNAL = re.compile(rb'EXIT STRING: .*\(signal (\d+)\)')
OPEN_MPI = re.compile(rb'process rank (\d+) with PID (\d+) on node (\S+) '
                      rb'exited on signal (\d+)')
START_RECORD = re.compile(r'^rank-(\d+)\.start$')
#: What mnopt says of a rank that exited before MPI started
#: (mnopt/global_except_hook.py): each rank its own line.
EARLY_EXIT = re.compile(rb'mnopt: rank (\d+) exited with status \d+ before '
                        rb'MPI started')

#: Seconds between looks at the attempt while its start is watched.
LOOK_S = 0.25
#: How long the job's stderr may stay open after the job ended (a rank
#: its launcher left behind holds it) before the summary is printed.
READ_S = 5.0


def _forward(source, into, ended, exits):
    """Copy the job's output ``source`` to ``into`` line by line, noting
    in ``ended`` the rank a signal ended, as the MPI launcher says it, and
    in ``exits`` each rank mnopt says exited before MPI started."""
    where = {}
    for line in iter(source.readline, b''):
        try:
            into.write(line)
            into.flush()
        except (OSError, ValueError):
            pass
        found = HYDRA_PID.search(line)
        if found:
            where = {'pid': int(found.group(1)),
                     'host': found.group(2).decode(errors='replace')}
        found = HYDRA_SIGNAL.search(line)
        if found and where and not ended:
            ended.update(where, signal=int(found.group(1)))
        found = OPEN_MPI.search(line)
        if found and not ended:
            ended.update(rank=int(found.group(1)), pid=int(found.group(2)),
                         host=found.group(3).decode(errors='replace'),
                         signal=int(found.group(4)))
        found = EARLY_EXIT.search(line)
        if found:
            exits.append(int(found.group(1)))


def failure_folder():
    """A fresh folder for the ranks' records: in the current directory
    (shared by the nodes, usually), else the temporary one."""
    for where in (os.getcwd(), None):
        try:
            return tempfile.mkdtemp(prefix='.mnopt-failure-', dir=where)
        except OSError:
            pass
    return None


class Attempt(object):
    """One run of ``command``: ``start()``, then ``child`` is the process
    (the leader of its own process group), ``folder`` the ranks' record
    folder (or None), ``ended`` what the MPI launcher said of a rank a
    signal ended, ``exits`` the ranks mnopt said exited before MPI
    started; ``finish()`` reads and removes the folder."""

    def __init__(self, command, env):
        self.command, self.env = command, env
        self.child = self.folder = None
        self.ended, self.exits, self.readers = {}, [], []

    def start(self):
        self.folder = failure_folder()
        env = self.env
        if self.folder is not None:
            env = dict(env, **{failure_summary.FOLDER_VARIABLE: self.folder})
        # A group of its own, so that a signal reaches every process the
        # attempt started (MPI's launcher, its proxies, the ranks here),
        # and none of the launcher's own parent.  Out of the terminal's
        # session, a read of the terminal would fail: MPI's launchers pass
        # stdin to rank 0, so a terminal's is not passed.
        stdin = subprocess.DEVNULL if _is_terminal(sys.stdin) else None
        # MPICH's Hydra reports a rank's end on stdout, Open MPI on stderr.
        into = [getattr(stream, 'buffer', None)
                for stream in (sys.stdout, sys.stderr)]
        if None in into:   # a stream swapped for a text one: not followed
            self.child = subprocess.Popen(self.command, env=env, stdin=stdin,
                                          start_new_session=True)
            return self
        self.child = subprocess.Popen(
            self.command, env=env, stdin=stdin, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True)
        self.readers = [threading.Thread(target=_forward, daemon=True,
                                         args=(source, out, self.ended,
                                               self.exits))
                        for source, out in zip((self.child.stdout,
                                                self.child.stderr), into)]
        for reader in self.readers:
            reader.start()
        return self

    def started_ranks(self):
        """The ranks that noted their start in the folder."""
        try:
            names = os.listdir(self.folder)
        except (OSError, TypeError):
            return set()
        return {int(m.group(1)) for m in map(START_RECORD.match, names)
                if m}

    def signal_group(self, signum):
        """Send ``signum`` to every process of the attempt's group."""
        if self.child is None:
            return
        try:
            os.killpg(self.child.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, signum, wait_s):
        """Pass ``signum`` to the whole group, wait up to ``wait_s``
        seconds for the job to end, then kill what is left of the group;
        returns the job's exit status."""
        self.signal_group(signum)
        return self.end_within(wait_s)

    def end_within(self, wait_s):
        """Wait up to ``wait_s`` seconds for the job (already signalled)
        to end, every process of its group (a rank that outlives MPI's
        launcher too), then SIGKILL what is left of the group; its
        status."""
        deadline = time.monotonic() + wait_s
        try:
            status = self.child.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            status = None
        while status is not None and self.group_alive() and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        self.signal_group(signal.SIGKILL)   # what outlived the leader too
        return self.child.wait() if status is None else status

    def group_alive(self):
        """Whether a process of the attempt's group is left."""
        try:
            os.killpg(self.child.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def finish(self):
        """The ranks' records (failure_summary.read_folder), once the
        job's output is through; the folder removed."""
        for reader in self.readers:   # its output out before the summary
            reader.join(READ_S)
        if self.folder is None:
            return None
        import shutil
        found = failure_summary.read_folder(self.folder)
        shutil.rmtree(self.folder, ignore_errors=True)
        return found


def _is_terminal(stream):
    try:
        return stream is not None and stream.isatty()
    except (OSError, ValueError):
        return False


def never_started(started, hosts, procs_per_node):
    """{host: [ranks]} of the ranks not in ``started``, ranks placed on
    ``hosts`` in order, ``procs_per_node`` each (as ElasticPlan's mpiexec
    command places them)."""
    missing = {}
    for rank in range(len(hosts) * procs_per_node):
        if rank not in started:
            missing.setdefault(hosts[rank // procs_per_node], []).append(
                rank)
    return missing


def _rank_of(rec):
    """The rank a failure record is of (its ``who``: a rank may write of
    another), or None."""
    who = str(rec.get('who') or 'rank %s' % rec.get('rank'))
    return int(who[5:]) if re.match(r'^rank \d+$', who) else None


def blamed_hosts(found, ended, exits, hosts, procs_per_node):
    """``(hosts, why)`` after a failed attempt on ``hosts`` (ranks placed
    in order, ``procs_per_node`` each): the host of the rank that failed
    first, as the ranks' records (``found``: failure_summary.read_folder),
    an MPI launcher naming a rank a signal ended (``ended``; MPICH's, which
    names no rank and may name one it ended itself, is not taken) or
    mnopt's line of a rank that exited before MPI started (``exits``) tell
    it; ``([], why none)`` where nothing names one, or ranks failed on
    every host (the job's own error, not a host's)."""
    def host_of(rank):
        ok = rank is not None and 0 <= rank < len(hosts) * procs_per_node
        return hosts[rank // procs_per_node] if ok else None
    found = found or {'start': {}, 'failure': {}, 'fault': {}}
    named = ended if ended and ended.get('rank') is not None else None
    failed = [_rank_of(r) for r in found['failure'].values()
              if r.get('how') != 'stall'] + list(exits) + [
        r for r, text in found['fault'].items() if text.strip()]
    first = failure_summary.first_failure(found, named)
    if first is not None and first.get('how') != 'stall':
        rank, how = _rank_of(first), first['how']
    elif named is not None or exits:
        rank = int(named['rank']) if named is not None else exits[0]
        how = 'a signal' if named is not None else 'it exited before MPI ' \
            'started'
    else:
        return [], 'no rank left a record or was named where it failed'
    if host_of(rank) is None:
        return [], 'the rank that failed first (rank %s) is not one of ' \
            'the job\'s' % rank
    if {host_of(r) for r in failed + [rank]} >= set(hosts):
        return [], 'ranks failed on every host (%s): the job\'s own ' \
            'error, not a host\'s' % ','.join(hosts)
    return [host_of(rank)], 'rank %d failed first there (%s)' % (rank, how)


def never_started_hosts(missing, hosts):
    """``(hosts, why)`` after an attempt that never started: the hosts of
    the ranks that did not start (``missing``: ``never_started``), or
    ``([], why none)`` where no rank started on any host (the folder not
    shared, or the MPI launcher itself stuck)."""
    if set(missing) >= set(hosts):
        return [], 'no rank started on any host'
    return [h for h in hosts if h in missing], 'its ranks did not start ' \
        'within --start-timeout'


def _start_watch(attempt, plan, start_timeout):
    """The ranks whose start is awaited, or None where the start is not
    watched (no elastic plan, no deadline, no folder, or one process:
    a job of one writes no start record)."""
    if plan is None or not start_timeout or attempt.folder is None:
        return None
    expected = len(plan.hosts) * plan.procs_per_node
    return expected if expected > 1 else None


def watch(attempt, plan, stopping, start_timeout, stop_timeout, say):
    """Wait for the attempt's end (``stopping``: a threading.Event a
    signal's handler sets, with its time in ``at``); returns (its exit
    status, why the launcher ended it: None, 'take back' (elastic.
    ElasticPlan.time_to_take_back), 'never started' or 'signal')."""
    begun = time.monotonic()
    expected = _start_watch(attempt, plan, start_timeout)
    takes_back = plan is not None and plan.takes_back()
    next_probe = begun + (plan.probe_interval if takes_back else 0)
    child = attempt.child
    while True:
        # Looked at in turns: a signal's handler does not end a wait.
        ticks = [LOOK_S]
        if takes_back:
            ticks.append(max(0.0, next_probe - time.monotonic()))
        try:
            status = child.wait(timeout=min(ticks))
        except subprocess.TimeoutExpired:
            status = None
        now = time.monotonic()
        if status is not None and not stopping.is_set():
            return status, None
        if stopping.is_set():   # the rest of the group ends too, in time
            left = stop_timeout - (now - stopping.at)
            return attempt.end_within(max(0.0, left)), 'signal'
        if expected and len(attempt.started_ranks()) >= expected:
            expected = None   # all started: mnopt's stall detection on
        elif expected and now - begun >= start_timeout:
            _say_never_started(attempt, plan, start_timeout, say)
            return attempt.stop(signal.SIGTERM, stop_timeout), \
                'never started'
        if takes_back and now >= next_probe:
            next_probe = now + plan.probe_interval
            if plan.time_to_take_back():
                return attempt.stop(signal.SIGTERM, stop_timeout), \
                    'take back'


def _say_never_started(attempt, plan, start_timeout, say):
    missing = never_started(
        attempt.started_ranks(), plan.hosts, plan.procs_per_node)
    say('mnopt.launch: the job started on %s (%d process%s each) never '
        'started: within %g s (--start-timeout) %s noted no start in %s; '
        'ending it, and probing the hosts again.  If those ranks did '
        'start, the hosts do not share that folder (it is made in the '
        'current directory): start the launcher in a directory every host '
        'sees, or pass --start-timeout 0' % (
            ','.join(plan.hosts), plan.procs_per_node,
            'es' * (plan.procs_per_node > 1), start_timeout,
            '; '.join('ranks %s on %s' % (','.join(map(str, ranks)), host)
                      for host, ranks in missing.items()),
            attempt.folder))


def blame(plan, attempt, found, why, missing, say):
    """After a failed elastic attempt: leave out the host that failed
    (elastic.ElasticPlan.leave_out), or say why none is."""
    if why == 'never started':
        hosts, reason = never_started_hosts(missing, plan.hosts)
        if not hosts:
            hosts, reason = in_turn(plan, reason, say)
    else:
        hosts, reason = blamed_hosts(
            found, attempt.ended, attempt.exits, plan.hosts,
            plan.procs_per_node)
    if hosts:
        plan.leave_out(hosts, reason)
    else:
        say('mnopt.launch: no host left out: %s' % reason)


def in_turn(plan, reason, say):
    """``([host], why)`` after an attempt where no rank started on any
    host: the next host in turn (the one left out so least often, the
    first of them), as one host whose MPI daemon hangs keeps every rank
    from starting (Open MPI starts ranks once every daemon called back);
    the host left out in turn before, without which no rank started
    either, runs again at once.  ``([], reason)`` where no more than
    --min-nodes hosts would be left."""
    turns = plan.__dict__.setdefault('turns', {})
    innocent = [h for h in turns if plan.is_left_out(h)]
    for host in innocent:   # not the one: no rank started without it
        plan.let_back(host)
        say('mnopt.launch: %s may run again: without it no rank started '
            'either' % host)
    if len(plan.hosts) + len(innocent) <= plan.min_nodes:
        return [], reason
    host = min(plan.hosts, key=lambda h: turns.get(h, 0))
    turns[host] = turns.get(host, 0) + 1
    return [host], 'no rank started on any host: one host\'s MPI daemon ' \
        'may hang, so hosts are left out in turn, one per attempt'
