"""One attempt of ``python -m mnopt.launch``: the job started in a process
group of its own, its output passed through (noting what MPI's launcher
says of a rank a signal ended), its start watched, and the whole group
stopped when the launcher must stop it: nothing the attempt started
outlives the launcher's signal by more than a bounded wait.

Its start: every rank of a job of several notes its start in the folder
``MNOPT_FAILURE_DIR`` when it imports mnopt (mnopt/failure_summary.py,
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

from mnopt import failure_summary

#: What MPI's launchers say of a rank that a signal ended: MPICH's Hydra
#: (its pid and host, then the signal), Open MPI's (all on one line).
HYDRA_PID = re.compile(rb'PID (\d+) RUNNING AT (\S+)')
HYDRA_SIGNAL = re.compile(rb'EXIT STRING: .*\(signal (\d+)\)')
OPEN_MPI = re.compile(rb'process rank (\d+) with PID (\d+) on node (\S+) '
                      rb'exited on signal (\d+)')
START_RECORD = re.compile(r'^rank-(\d+)\.start$')

#: How long the job's stderr may stay open after the job ended (a rank
#: its launcher left behind holds it) before the summary is printed.
READ_S = 5.0


def _forward(source, into, ended):
    """Copy the job's output ``source`` to ``into`` line by line, noting
    in ``ended`` the rank a signal ended, as the MPI launcher says it."""
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
    signal ended; ``finish()`` reads and removes the folder."""

    def __init__(self, command, env):
        self.command, self.env = command, env
        self.child = self.folder = None
        self.ended, self.readers = {}, []

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
                                         args=(source, out, self.ended))
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
        to end, then SIGKILL what is left of its group; its status."""
        try:
            status = self.child.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            status = None
        self.signal_group(signal.SIGKILL)   # what outlived the leader too
        return self.child.wait() if status is None else status

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
