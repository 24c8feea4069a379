"""ChainerMN's own unit tests against mnopt, as part of ``make test``.

The conformance kit (ChainerMN 7.8.1's tests/chainermn_tests with a
names-only shim that makes ``import chainermn`` resolve to mnopt) lives
outside this repository, beside the checkout, in
``../shared/chainermn-conformance`` (or $MNOPT_CONFORMANCE_KIT).  Where it
is, this runs it at 1 and 2 ranks and fails if any module passes fewer
tests than CONFORMANCE_FLOOR below; where it is not, it says so and does
not fail.

    python tests/conformance.py [PYTHON]

The floor is what ChainerMN itself passes on a CPU machine (the kit's
baseline.txt), less the tests that reach into ChainerMN's private modules,
which a drop-in does not owe (the kit's README lists them).
"""

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
KIT = os.environ.get('MNOPT_CONFORMANCE_KIT') or os.path.join(
    os.path.dirname(REPO), 'shared', 'chainermn-conformance')

MODULES = ('communicator_tests', 'optimizer_tests', 'datasets_tests',
           'iterators_tests', 'extensions_tests', 'links_tests',
           'functions_tests')
#: extensions_tests at 2 ranks hangs on ChainerMN itself (it downloads
#: MNIST, and there is no network), so it has no baseline there.
MODULES_AT_2 = tuple(m for m in MODULES if m != 'extensions_tests')

#: (ranks, module) -> tests that must pass, and why it is below ChainerMN's
#: own count where it is.
CONFORMANCE_FLOOR = {
    ('1', 'communicator_tests'): (2, 'ChainerMN 3: test_chunked_bcast_objs '
                                     'reads the private '
                                     '_communication_utility'),
    ('1', 'optimizer_tests'): (2, ''),
    ('1', 'datasets_tests'): (6, ''),
    ('1', 'iterators_tests'): (0, 'ChainerMN 1: test_conversion reads the '
                                  'private _build_ctrl_msg'),
    ('1', 'extensions_tests'): (8, 'ChainerMN 13: test_parser x7 (private '
                                   '_parse_replica_sets), test_stats and '
                                   'test_filename_converters (private), '
                                   'test_multinode_autoload downloads MNIST'),
    ('1', 'links_tests'): (8, ''),
    ('1', 'functions_tests'): (48, ''),
    ('2', 'communicator_tests'): (14, 'ChainerMN 16: test_chunked_bcast_objs '
                                      '(private _communication_utility), '
                                      'test_config_context (private '
                                      '_configs)'),
    ('2', 'optimizer_tests'): (2, ''),
    ('2', 'datasets_tests'): (6, ''),
    ('2', 'iterators_tests'): (29, 'ChainerMN 30: test_conversion (private '
                                   '_build_ctrl_msg)'),
    ('2', 'links_tests'): (27, ''),
    ('2', 'functions_tests'): (84, ''),
}


#: Seconds after which a kit test still running counts as hung and its
#: ranks' stacks are printed (the kit ends a module after 300 s; its
#: longest module takes about 60 s in all).
HUNG_TEST_S = 100

#: The runs of the kit that take longest.
LONG = (('2', 'iterators_tests'), ('2', 'links_tests'))


def run_kit(run_sh, python, ranks, module, log):
    """The kit's summary line of one module at ``ranks`` ranks; the job's
    whole output (every rank's, one after the other) goes to ``log``."""
    # The kit's launcher, through conformance_mpiexec.sh: the kit reads
    # the job's last line, which the ranks' outputs must not interleave.
    launcher = os.environ.get('MPIEXEC') or os.path.join(
        os.path.dirname(python), 'mpiexec')
    proc = subprocess.run(
        ['bash', run_sh, ranks], cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=dict(os.environ, PY=python, MODULES=module,
                 MPIEXEC=os.path.join(HERE, 'conformance_mpiexec.sh'),
                 MNOPT_CONFORMANCE_MPIEXEC=launcher,
                 MNOPT_CONFORMANCE_LOG=log,
                 # A test still running after this long is hung: its
                 # ranks' stacks go to the log.
                 PYTEST_ADDOPTS=(os.environ.get('PYTEST_ADDOPTS', '')
                                 + ' -o faulthandler_timeout=%d'
                                 % HUNG_TEST_S)))
    # The kit's own verdict compares with ChainerMN's counts, which
    # include the private-module tests: the floor below decides.
    return ''.join(line + '\n' for line in proc.stdout.splitlines()
                   if re.match(r'\d+\s', line))


def tail(path, lines=40):
    """The last ``lines`` lines of the file at ``path`` ('' if none)."""
    try:
        with open(path, errors='replace') as f:
            return ''.join(f.readlines()[-lines:])
    except OSError:
        return ''


def main(python):
    run_sh = os.path.join(KIT, 'run.sh')
    if not os.path.exists(run_sh):
        print('== conformance: not run: the ChainerMN conformance kit is not '
              'beside this checkout (%s)' % KIT)
        return 0
    # ChainerMN's tests import mock.
    if subprocess.call([python, '-c', 'import mock'],
                       stderr=subprocess.DEVNULL) != 0:
        subprocess.check_call([python, '-m', 'pip', 'install', '-q',
                               '--disable-pip-version-check', 'mock'])
    # One run of the kit per rank count and module, two at a time, the
    # two long ones first (side by side; the short ones then fill
    # whichever lane frees first).  Their receives and collectives wait
    # without spinning, so two jobs side by side share the two cores.
    jobs = [(ranks, module) for ranks, modules in (('1', MODULES),
                                                   ('2', MODULES_AT_2))
            for module in modules]
    jobs.sort(key=lambda job: job not in LONG)
    logs = tempfile.mkdtemp(prefix='mnopt-conformance-')
    log = {job: os.path.join(logs, '%s-%s.log' % job) for job in jobs}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        lines = list(pool.map(
            lambda job: run_kit(run_sh, python, *job, log[job]), jobs))
    output = ''.join(sorted(lines, key=lambda line: (line.split()[0],
                                                      MODULES.index(
                                                          line.split()[1]))))
    print(output, end='')
    passed = {}
    for line in output.splitlines():
        m = re.match(r'(\d+)\s+(\S+)\s+(.*)', line)
        if m:
            count = re.search(r'(\d+) passed', m.group(3))
            passed[m.group(1), m.group(2)] = int(count.group(1)) \
                if count else 0
    below = [(k, floor)
             for k, (floor, _) in sorted(CONFORMANCE_FLOOR.items())
             if passed.get(k, 0) < floor]
    short = ['n=%s %s: %d passed, floor %d' % (k + (passed.get(k, 0), floor))
             for k, floor in below]
    for k, _ in below:
        print('== conformance: the end of n=%s %s\'s output:\n%s'
              % (k + (tail(log[k]) or '(nothing)\n',)), end='')
    shutil.rmtree(logs, ignore_errors=True)
    total = sum(min(passed.get(k, 0), f)
                for k, (f, _) in CONFORMANCE_FLOOR.items())
    print('== conformance: %d of the %d tests of the floor pass%s'
          % (total, sum(f for f, _ in CONFORMANCE_FLOOR.values()),
             '; below the floor: ' + ', '.join(short) if short else ''))
    return 1 if short else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else sys.executable))
