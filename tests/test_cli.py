"""mnopt's command lines: ``--help`` prints help on every option and
exits 0 (without running anything), under the name the user types
(``python -m mnopt.X``); a bad value is argparse's error (usage, an
``error:`` line, exit status 2), not a traceback.  Quick subprocesses,
no mpiexec."""

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, WORLD, python_path
from mnopt.common import cli

# The commands run as processes of their own, outside any MPI job (a
# rank's environment would make MPI_Init in them wait for a process
# manager): once, in the serial pass.
pytestmark = pytest.mark.skipif(WORLD.size > 1,
                                reason='runs commands outside MPI')


def run(*argv):
    env = dict(os.environ, PYTHONPATH=python_path())
    return subprocess.run([sys.executable, '-m'] + list(argv), cwd=REPO,
                          env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=120)


def options_without_help(text):
    """The option entries of an argparse help text that have no help: an
    entry's help follows on its line or on the next, indented, line."""
    lines = text.splitlines()
    bare = []
    for i, line in enumerate(lines):
        if not line.startswith('  -'):
            continue
        said_here = re.search(r'\S {2,}\S', line.strip())
        said_next = i + 1 < len(lines) and \
            lines[i + 1].startswith(' ' * 6) and \
            not lines[i + 1].strip().startswith('-')
        if not (said_here or said_next):
            bare.append(line.strip())
    return bare


HELPS = [
    ('mnopt.check',), ('mnopt.benchmark',), ('mnopt.launch',),
    ('mnopt.server',), ('mnopt.netsim',), ('mnopt.netsim', 'up'),
    ('mnopt.netsim', 'run'), ('mnopt.netsim', 'exec'),
    ('mnopt.netsim', 'down'), ('mnopt.report',),
]


@pytest.mark.parametrize('command', HELPS, ids=' '.join)
def test_help_prints_help_on_every_option(command):
    proc = run(*(command + ('--help',)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith('usage: python -m %s' % ' '.join(command)), \
        proc.stdout[:500]
    assert 'options:' in proc.stdout or 'optional arguments:' in proc.stdout
    assert options_without_help(proc.stdout) == [], proc.stdout
    # --help ran nothing: the check's report never began.
    assert not re.search(r'mnopt check: \d+ ranks', proc.stdout)
    assert proc.stderr == ''


def test_the_help_checker_finds_an_option_without_help():
    # The checker above can fail: a bare option is named.
    text = ('options:\n  -h, --help   show this help\n  --reps REPS\n'
            '  --quick      fewer cases\n  --compute-ms COMPUTE_MS\n'
            '               simulated compute\n')
    assert options_without_help(text) == ['--reps REPS']


BAD = [
    (('mnopt.check', '--bogus'), 'unrecognized arguments: --bogus'),
    (('mnopt.benchmark', '--dtypes', 'fp16'),
     "argument --dtypes: invalid choice: 'fp16'"),
    (('mnopt.benchmark', '--reps', '0'),
     "argument --reps: '0' is not an integer > 0"),
    (('mnopt.benchmark', '--communicators', 'flatt'),
     "argument --communicators: invalid choice: 'flatt'"),
    (('mnopt.launch', '--max-restarts', '-1', '--', 'true'),
     "argument --max-restarts: '-1' is not an integer >= 0"),
    (('mnopt.launch', '--delay', 'soon', '--', 'true'),
     "argument --delay: 'soon' is not a number >= 0"),
    (('mnopt.launch', '--delay', 'inf', '--max-restarts', '1', '--',
      'false'), "argument --delay: 'inf' is not a number >= 0"),
    (('mnopt.benchmark', '--compute-ms', 'inf'),
     "argument --compute-ms: 'inf' is not a number >= 0"),
    (('mnopt.server', '--memory', '0'),
     "argument --memory: '0' is not an integer > 0"),
    (('mnopt.netsim', 'up', '--nodes', '0'),
     "argument --nodes: '0' is not an integer in 1..64"),
    (('mnopt.netsim', 'up', '--nodes', '2', '--link', '3:1gbit'),
     "argument --link: --link takes K=RATE"),
    (('mnopt.netsim', 'run', '--nodes', '2', '--timeout', 'nan', '--',
      'true'), "argument --timeout: 'nan' is not a number > 0"),
    (('mnopt.netsim', 'fly'), "argument COMMAND: invalid choice: 'fly'"),
]


@pytest.mark.parametrize('argv,error', BAD, ids=lambda v: ' '.join(v)
                         if isinstance(v, tuple) else None)
def test_a_bad_value_is_an_argparse_error(argv, error):
    proc = run(*argv)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    assert 'error: ' + error in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith('usage: python -m %s' % argv[0]), \
        proc.stderr[-3000:]
    assert 'Traceback' not in proc.stderr


@pytest.mark.parametrize('command', HELPS, ids=' '.join)
def test_help_is_for_users_not_developers(command):
    # The architecture rule's note ("One idea, over 400 lines") is for
    # mnopt's developers, not in a command's --help.
    proc = run(*(command + ('--help',)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert cli.DEVELOPER_NOTE not in proc.stdout, proc.stdout
    assert '400 lines' not in proc.stdout
    # Plain text: no reST markup (``run``) from the module's docstring.
    assert '``' not in proc.stdout, proc.stdout


def test_a_developer_note_is_left_out_of_the_epilog():
    doc = 'Title.\n\n    usage line\n\nFor users.\n\nOne idea, over 400 ' \
          'lines: this.\n\nAlso for users.\n'
    assert cli.help_epilog(doc) == 'usage line\n\nFor users.\n\nAlso for ' \
                                   'users.'


@pytest.mark.parametrize('name', ['check', 'benchmark'])
def test_mnopt_help_and_the_commands_help_show_the_same_command(name):
    # A user finds the check from either help, typed the same way.
    from mnopt import __main__ as entry
    how, = [run_line for command, run_line, _ in entry.COMMANDS
            if command == name]
    assert how in run('mnopt', '--help').stdout
    assert how in run('mnopt.' + name, '--help').stdout


def test_mnopt_help_fits_80_columns():
    proc = run('mnopt', '--help')
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'mnopt.check' in proc.stdout
    assert [line for line in proc.stdout.splitlines() if len(line) > 80] \
        == [], proc.stdout
