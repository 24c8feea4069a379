"""The probe of an elastic relaunch: whether a host answers, asked of
every host at once before each attempt (``python -m mnopt.launch
--probe CMD``).  By default ``ssh -o BatchMode=yes -o ConnectTimeout=5
{host} true``, and nothing at all for this machine's own names; tests
give a command that fakes hosts going and coming.
"""

import os
import shlex
import signal
import socket
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor, wait

from mnopt.common.failure_summary import signal_name

#: The default probe: a host answers if ssh can run ``true`` on it.
SSH_PROBE = 'ssh -o BatchMode=yes -o ConnectTimeout=5 {host} true'
#: Seconds a probe may take before its host counts as not answering.
PROBE_TIMEOUT_S = 15.0


def _own_names():
    return {'localhost', '127.0.0.1', socket.gethostname(), socket.getfqdn()}


def command_probe(template=SSH_PROBE, timeout=PROBE_TIMEOUT_S):
    """A probe ``probe(host) -> None or why not``: the command
    ``template`` (``{host}`` replaced) must exit 0 within ``timeout``
    seconds.  The probe's own exit is waited for, not its output's end:
    a child it leaves (``ssh -f``, a ControlPersist master) may hold its
    stderr.  The default ssh probe answers for this machine's own names
    without running anything."""
    own = _own_names() if template == SSH_PROBE else set()
    running = set()

    def stop():
        """Kill every probe running now (the launcher must stop)."""
        for child in list(running):
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except OSError:
                pass

    def probe(host):
        if host in own:
            return None
        argv = shlex.split(template.replace('{host}', host))
        with tempfile.TemporaryFile() as err:
            try:
                # A session of its own: a probe that hangs is killed with
                # what it started.
                child = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=err, start_new_session=True)
            except OSError as e:
                return 'the probe could not run (%s)' % e
            running.add(child)
            try:
                status = child.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except OSError:
                    pass
                child.wait()
                return 'the probe took more than %g s' % timeout
            finally:
                running.discard(child)
            if status == 0:
                return None
            err.seek(0)
            said = err.read().decode(errors='replace').strip().splitlines()
        return 'the probe %s%s' % (
            'exited with status %d' % status if status > 0 else
            'was ended by %s' % signal_name(-status),
            ': ' + said[-1] if said else '')
    probe.stop = stop
    return probe


def probe_all(probe, hosts, stopping=None):
    """{host: None or why not}, every host probed at once (a host whose
    probe hangs costs one probe timeout, not one per host).  Once
    ``stopping`` (a threading.Event) is set, the probes still running are
    killed (``probe.stop``, where the probe has one) and not waited for:
    their hosts count as not answering."""
    if not hosts:
        return {}
    pool = ThreadPoolExecutor(max_workers=min(len(hosts), 64))
    futures = [pool.submit(probe, host) for host in hosts]
    try:
        while stopping is not None and not stopping.is_set():
            if not wait(futures, timeout=0.1)[1]:
                break
        if stopping is not None and stopping.is_set():
            getattr(probe, 'stop', lambda: None)()
            return {h: f.result() if f.done() and not f.exception() else
                    'the launcher is stopping' for h, f in zip(hosts, futures)}
        return {h: f.result() for h, f in zip(hosts, futures)}
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
