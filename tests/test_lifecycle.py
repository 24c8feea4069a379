"""A job's life: how it starts (bad settings fail at create_communicator on
every rank), how it ends (an early exit ends the job, a healthy one exits
0), how python -m mnopt.launch stops, and communicators freed when they
are dropped."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO


def _wait_for(condition, timeout, what):
    """Poll ``condition`` until it holds; fail naming ``what`` after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail('timed out after %g s waiting for %s' % (timeout, what))
        time.sleep(0.05)


# ------------------------------------------------------- python -m mnopt.launch
@pytest.mark.spawn
@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT],
                         ids=['SIGTERM', 'SIGINT'])
def test_launcher_stops_when_signalled_during_its_restart_delay(
        tmp_path, signum):
    attempts = tmp_path / 'attempts'
    # A job that fails at once, counting its attempts.
    job = [sys.executable, '-c', 'import sys; open(%r, "a").write("x"); '
           'sys.exit(3)' % str(attempts)]
    launcher = subprocess.Popen(
        [sys.executable, '-m', 'mnopt.launch', '--max-restarts', '5',
         '--delay', '60', '--'] + job, stderr=subprocess.PIPE, text=True,
        cwd=REPO)
    try:

        def in_delay():
            # The launcher has said it restarts after a delay.
            return attempts.exists() and launcher.poll() is None and \
                os.path.getsize(attempts) == 1
        _wait_for(in_delay, 60, 'the first attempt to fail')
        time.sleep(0.5)   # into the delay (its message may be buffered)
        launcher.send_signal(signum)
        start = time.monotonic()
        status = launcher.wait(timeout=30)
        log = launcher.stderr.read()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert time.monotonic() - start < 10, log
    assert status == 3, log        # the last attempt's status, not 0
    assert attempts.read_text() == 'x', log   # no second attempt started
    assert 'interrupted; not restarting' in log
