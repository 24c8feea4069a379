"""mnopt's runtime warnings and reports go through logging
(mnopt/common/log.py): a user's handler on 'mnopt' captures them, a level
silences them, and with nothing configured they reach stderr with the text
mnopt always wrote.  The stall report and the overflow warning as whole
mpiexec jobs; the default handler's rules and the flush before an abort in
this process."""

import logging
import time

import pytest

from conftest import run_mpi, slack
from mnopt.common import log
from mnopt.stall import report as stall_report

# argv: how the script configures logging.  Rank 1 sleeps past rank 0's
# stall warning time (1 s) before averaging a gradient that overflows the
# float16 wire.
REPORTS = r'''
import logging, sys, time, numpy, mnopt
how = sys.argv[1]
said = []
if how == 'handler':
    handler = logging.Handler()
    handler.emit = lambda record: said.append(
        (record.name, record.levelname, record.getMessage()))
    logging.getLogger('mnopt').addHandler(handler)
elif how == 'quiet':
    logging.getLogger('mnopt').setLevel(logging.ERROR)
comm = mnopt.create_communicator('naive', allreduce_grad_dtype='float16',
                                 stall_warning=1, timeout=0)
if comm.rank == 1:
    time.sleep(2.5)
comm.mean_grads([('big', numpy.full(4, 1e5, numpy.float32))])
comm.finalize()
for name, level, message in said:
    print('CAPTURED %d %s %s %s' % (comm.rank, name, level, message))
'''

STALL = 'mnopt: rank 0 has waited '
STALL_REST = (' in naive#0.mean_grads #1; not arrived: rank 1 (busy outside '
              'naive#0: computing, or stuck before its next call); arrived: '
              'rank 0. Still waiting.')
OVERFLOW = ('mnopt: warning: averaging #0 on the float16 wire overflowed: '
            "the mean of 'big' is not finite though every rank's gradients "
            'were')


def run_reports(how):
    proc = run_mpi(2, REPORTS, timeout=60, args=[how])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.spawn
def test_by_default_the_reports_reach_stderr_as_before():
    proc = run_reports('default')
    stalls = [line for line in proc.stderr.splitlines()
              if line.startswith('[rank 0] ' + STALL)]
    # The bare message, one line, as sys.stderr.write gave it: no level,
    # no logger name (tests and users grep these lines), only the rank
    # that said it, as a ChainerMN user's mpiexec -prepend-rank would.
    assert len(stalls) == 1 and stalls[0].endswith(STALL_REST), \
        proc.stderr[-3000:]
    overflows = [line for line in proc.stderr.splitlines()
                 if line.startswith('[rank 0] ' + OVERFLOW)]
    assert len(overflows) == 1, proc.stderr[-3000:]
    assert 'CAPTURED' not in proc.stdout


@pytest.mark.spawn
def test_a_users_handler_on_mnopt_captures_them_instead():
    proc = run_reports('handler')
    captured = [line.split(' ', 4)[1:] for line in proc.stdout.splitlines()
                if line.startswith('CAPTURED ')]
    stalls = [c for c in captured if c[3].startswith(STALL)]
    overflows = [c for c in captured if c[3].startswith(OVERFLOW)]
    assert len(stalls) == 1 and stalls[0][:3] == \
        ['0', 'mnopt.stall', 'WARNING'], captured
    assert stalls[0][3].endswith(STALL_REST), stalls
    assert len(overflows) == 1 and overflows[0][:3] == \
        ['0', 'mnopt.overflow', 'WARNING'], captured
    # The user's handler took them: not also on stderr.
    assert STALL not in proc.stderr and OVERFLOW not in proc.stderr, \
        proc.stderr[-3000:]


@pytest.mark.spawn
def test_a_level_on_mnopt_silences_the_warnings():
    proc = run_reports('quiet')
    assert STALL not in proc.stderr and 'overflowed' not in proc.stderr, \
        proc.stderr[-3000:]


# Rank 0 times out waiting for rank 1 (asleep) and aborts the job; its
# handler buffers every record until flushed (a MemoryHandler), so the
# report reaches stdout only if mnopt flushes the handlers before MPI_Abort.
ABORTS = r'''
import logging, logging.handlers, sys, time, numpy, mnopt
handler = logging.handlers.MemoryHandler(
    1000, flushLevel=logging.CRITICAL + 1,
    target=logging.StreamHandler(sys.stdout))
handler.setFormatter(logging.Formatter('BUFFERED %(message)s'))
handler.target.setFormatter(logging.Formatter('BUFFERED %(message)s'))
logging.getLogger('mnopt').addHandler(handler)
comm = mnopt.create_communicator('naive', stall_warning=0, timeout=1)
if comm.rank == 1:
    time.sleep(30)
comm.mean_grads([('w', numpy.ones(4, numpy.float32))])
'''


@pytest.mark.spawn
def test_the_timeout_report_is_flushed_before_the_abort():
    proc = run_mpi(2, ABORTS, timeout=60)
    assert proc.returncode != 0
    said = [line for line in proc.stdout.splitlines()
            if line.startswith('BUFFERED ' + STALL)]
    assert len(said) == 1 and said[0].endswith(
        'Timeout (1 s, MNOPT_TIMEOUT): aborting the MPI job.'), \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    assert STALL not in proc.stderr   # the user's handler took it


# ------------------------------------------------ the default handler here

def test_the_default_handler_steps_aside_for_any_other_handler(capsys):
    capsys.readouterr()
    logger = logging.getLogger('mnopt.stall')
    logger.warning('mnopt: first %s', 'line')
    logger.debug('mnopt: below the level, never said')
    child = logging.Handler()
    child.emit = lambda record: None
    root = logging.getLogger()
    for owner in (logger, logging.getLogger('mnopt'), root):
        # A handler of the user's anywhere on the way up (root: what
        # basicConfig adds) takes the records: not said twice.
        owner.addHandler(child)
        try:
            logger.warning('mnopt: not on stderr')
        finally:
            owner.removeHandler(child)
    # ... unless the record never reaches it.
    logging.getLogger('mnopt').propagate = False
    root.addHandler(child)
    try:
        logger.warning('mnopt: second line')
    finally:
        root.removeHandler(child)
        logging.getLogger('mnopt').propagate = True
    logger.error('mnopt: with its traceback:', exc_info=ValueError('x'))
    # (capsys: the default handler writes to sys.stderr as it is at each
    # record, which pytest swaps.)
    # (Each line tagged with the rank in a job of several: mpiexec -n 2.)
    assert capsys.readouterr().err == log.tagged(
        'mnopt: first line\nmnopt: second line\n'
        'mnopt: with its traceback:\nValueError: x') + '\n'


def test_one_default_handler_and_only_mnopts_loggers():
    defaults = [h for h in logging.getLogger('mnopt').handlers
                if isinstance(h, log.DefaultHandler)]
    assert len(defaults) == 1
    assert log.get('mnopt.stall') is logging.getLogger('mnopt.stall')
    with pytest.raises(ValueError, match='not mnopt'):
        log.get('mnoptx')


def test_stall_abort_flushes_the_handlers_first(monkeypatch):
    order = []

    class Buffering(logging.Handler):
        def emit(self, record):
            order.append('emit')

        def flush(self):
            order.append('flush')

    class World(object):
        @staticmethod
        def Abort(code):
            order.append('abort')

    class FakeMPI(object):
        COMM_WORLD = World

    handler = Buffering()
    logging.getLogger('mnopt').addHandler(handler)
    monkeypatch.setattr(stall_report, 'MPI', FakeMPI)
    monkeypatch.setattr(stall_report.time, 'sleep', lambda s: None)
    try:
        stall_report.abort()
    finally:
        logging.getLogger('mnopt').removeHandler(handler)
    assert order == ['flush', 'abort']


# A stall that times out, with logging configured in ways that would drop
# or break its report: the job must still end at the timeout, saying why.
ENDS_AT_THE_TIMEOUT = r'''
import logging, logging.config, sys, time, numpy, mnopt
how = sys.argv[1]
comm = mnopt.create_communicator('flat', stall_warning=1, timeout=3)
if how == 'raising':
    class Broken(logging.Handler):
        def emit(self, record):
            raise RuntimeError('a user handler broke')
    logging.getLogger('mnopt').addHandler(Broken())
elif how == 'dictconfig':
    # Per-rank logging set up once the rank is known: disables the
    # existing 'mnopt.*' loggers (disable_existing_loggers defaults True).
    logging.config.dictConfig({'version': 1, 'root': {'level': 'INFO'}})
elif how == 'critical':
    logging.getLogger().setLevel(logging.CRITICAL)
if comm.rank == 1:
    time.sleep(60)
comm.mean_grads([('w', numpy.ones(4, numpy.float32))])
'''


@pytest.mark.spawn
@pytest.mark.parametrize('how', ['raising', 'dictconfig', 'critical'])
def test_the_timeout_aborts_and_says_why_whatever_logging_does(how):
    # A handler that raises must not stop the watchdog; a configuration
    # that drops the report must not leave the abort unexplained.
    start = time.monotonic()
    proc = run_mpi(2, ENDS_AT_THE_TIMEOUT, timeout=120, args=[how])
    assert proc.returncode != 0
    assert 'mnopt: rank 0 has waited' in proc.stderr and \
        'Timeout (3 s, MNOPT_TIMEOUT): aborting the MPI job' in \
        proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - start < slack(40)
