"""A script started without its launcher: one process that its
environment says is one of many.

``python train.py`` inside an allocation of 4 tasks, or a launcher whose
MPI library is not the one mpi4py was built with, starts MPI as a
singleton: every such process trains alone, as rank 0 of 1, and nothing
fails.  The launchers say how many processes they started, each in its
own variable; a process started by a matching launcher sees an MPI world
of that size, so only a world of 1 beside a count above 1 is a mismatch.
Processes started side by side with no launcher and no such variable
cannot be told from one process alone and are not detected.

Two more things only the process a launcher started has to know:

- whether it is that process (``mark_launched_process``,
  ``started_by_a_rank``): a helper a rank starts (``os.system``,
  ``subprocess``) inherits the launcher's variables but is no rank, and
  must neither start MPI nor abort the job;
- how long it waits in MPI's start (``start_mpi``), which holds Python's
  GIL until every rank has started it: a C thread (mnopt/stall/_startwatch.c)
  warns at the stall warning and ends the process at the timeout, so
  that a rank that exited before it does not leave the others waiting
  for ever.
"""

import logging
import os
import signal
import sys

from mnopt.common import log

#: The variables in which launchers give the number of processes of the
#: job: MPICH's and Intel MPI's Hydra, Open MPI,
#: MVAPICH2, and Slurm (also set in an sbatch script, where a plain
#: ``python train.py`` is one process of an allocation of several).
SIZE_VARIABLES = log.SIZE_VARIABLES

#: How to launch, for the messages.
HOW_TO_LAUNCH = ('start it with the launcher of the MPI library mpi4py was '
                 'built with (mpiexec -n N python train.py, or srun '
                 'python train.py inside an allocation)')

logger = log.get('mnopt')
_warned = False


def job_sizes(environ):
    """{variable: number of processes} the environment announces, for
    every size variable set to a whole number."""
    sizes = {}
    for name in SIZE_VARIABLES:
        try:
            sizes[name] = int(environ.get(name, ''))
        except ValueError:   # unset, empty or not a number: says nothing
            pass
    return sizes


def problem(environ, world_size):
    """A sentence when an MPI world of ``world_size`` processes is alone
    though ``environ`` says the job has several; else None."""
    if world_size != 1:
        return None
    several = sorted((name, n) for name, n in job_sizes(environ).items()
                     if n > 1)
    if not several:
        return None
    return ('this process is alone in its MPI world, rank 0 of 1, though '
            'its environment says the job has more processes (%s): each '
            'such process will train alone, averaging with no one; %s' % (
                ', '.join('%s=%d' % kv for kv in several), HOW_TO_LAUNCH))


def warn_if_alone(world_size, environ=None):
    """Log ``problem`` as a warning on logger 'mnopt' (once a process;
    by default on stderr, mnopt/common/log.py)."""
    import os
    global _warned
    said = problem(os.environ if environ is None else environ, world_size)
    if said is not None and not _warned:
        _warned = True
        logger.warning('mnopt: warning: %s', said)
    return said


#: The variable in which the process a launcher started marks itself
#: (its pid and the launcher's variables it saw), for its children.
MARK_VARIABLE = 'MNOPT_LAUNCHED_PROCESS'
#: Variables that tell one launch from another, beside the rank and size
#: (Hydra's PMI socket, PMIx's namespace, Slurm's job and step).
JOB_VARIABLES = ('PMI_FD', 'PMI_PORT', 'PMI_ID', 'PMIX_NAMESPACE',
                 'OMPI_MCA_ess_base_jobid', 'SLURM_JOB_ID', 'SLURM_STEP_ID')


def _launch_identity(environ):
    """The launcher's variables of this process, as one string."""
    names = log.RANK_VARIABLES + SIZE_VARIABLES + JOB_VARIABLES
    return ' '.join('%s=%s' % (name, environ[name]) for name in names
                    if name in environ)


def started_by_a_rank(environ=None):
    """Whether this process inherited its launcher's variables from a
    rank that marked itself (``mark_launched_process``): another process
    of the same launch, with the same variables, not itself."""
    environ = os.environ if environ is None else environ
    pid, _, identity = environ.get(MARK_VARIABLE, '').partition(' ')
    return pid.isdigit() and int(pid) != os.getpid() and \
        identity == _launch_identity(environ)


def mark_launched_process():
    """Mark this process as the one the launcher started, in the
    environment its children inherit."""
    os.environ[MARK_VARIABLE] = '%d %s' % (os.getpid(),
                                           _launch_identity(os.environ))


# ------------------------------------------------------------ MPI's start
try:
    from mnopt.stall import _startwatch
except ImportError:   # not built (no C compiler): see _start_unwatched
    _startwatch = None

#: Whether this process entered MPI's start through ``start_mpi`` (an
#: exception raised there, Ctrl-C, came after MPI had started).
_start_entered = False


def exit_watch():
    """The C watch of a failing exit (mnopt/stall/_startwatch.c), or None
    where it is not built."""
    return _startwatch


def start_entered():
    """Whether MPI's start was entered (through ``start_mpi``)."""
    return _start_entered


def _mpi_module():
    return sys.modules.get('mpi4py.MPI')


#: Why a rank waits in MPI's start.
NOT_ARRIVED = ('not every rank has arrived (one may have exited or failed '
               'before it)')


def start_mpi(where, stall_warning=None, timeout=None):
    """Start MPI (``from mpi4py import MPI``) from ``where`` (what the
    user called), under the stall warning and the timeout (the arguments,
    else $MNOPT_STALL_WARNING and $MNOPT_TIMEOUT): MPI's start waits for
    every rank, so a rank that exited before it would leave this one
    there for ever.  Once MPI runs, a failing exit of this process is no
    longer watched here (mnopt/global_except_hook.py): the communicators'
    own failure reports take over.  Returns mpi4py's MPI module."""
    global _start_entered
    mpi = _mpi_module()
    if mpi is None:
        from mnopt.stall import settings as stall_settings
        warning, limit = stall_settings.settings_or_defaults(stall_warning,
                                                             timeout)
        _start_entered = True
        if _startwatch is not None:
            mpi = _start_watched(where, warning or 0, limit or 0)
        else:
            mpi = _start_unwatched(where, limit)
    if _startwatch is not None:
        _startwatch.unwatch_exit()
    return mpi


def _start_watched(where, warning, limit):
    who = log.rank_name()

    def waited(seconds):
        return "mnopt: %s has been waiting in MPI's start at %s for %g s: " \
            '%s' % (who, where, seconds, NOT_ARRIVED)

    warning_text = log.tagged(waited(warning) + '; %s' % (
        'it ends the job at %g s (MNOPT_TIMEOUT)' % limit if limit
        else 'it waits for ever (MNOPT_TIMEOUT=0)')) + '\n'
    timeout_text = log.tagged(waited(limit) + (
        '.  Ending the job: the other ranks\' output above says why one '
        'did not arrive; if they only start far apart, raise the timeout '
        "(create_communicator's timeout=, or MNOPT_TIMEOUT; 0 waits for "
        'ever)')) + '\n'
    # Ctrl-C cannot reach Python until MPI's start returns: the C handler
    # ends the process at once instead, where Python's own handler is in
    # place (a user's handler is left alone).
    interrupt_text = None
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        interrupt_text = log.tagged(
            "mnopt: %s interrupted (SIGINT) while waiting in MPI's start "
            'at %s (%s); ending the job' % (who, where, NOT_ARRIVED)) + '\n'
    _startwatch.arm(warning, limit, warning_text, timeout_text,
                    interrupt_text)
    try:
        from mpi4py import MPI
    finally:
        _startwatch.disarm()
    return MPI


def _start_unwatched(where, limit):
    """Without the C watch: Python's fault handler ends the process at
    the timeout (its traceback, then exit status 1); nothing warns
    before, so one line says so where the job has several ranks."""
    import faulthandler
    if limit and any(n > 1 for n in job_sizes(os.environ).values()):
        log.say(logger, logging.WARNING,
                "mnopt: %s starts MPI at %s, which waits for every rank; if "
                'one never arrives (it exited or failed before it), this '
                'process ends after %g s (MNOPT_TIMEOUT) with a traceback '
                "in MPI's start (mnopt's C extension _startwatch is not "
                'built: no warning before, and Ctrl-C waits too)',
                log.rank_name(), where, limit)
    if limit:
        faulthandler.dump_traceback_later(limit, exit=True)
    try:
        from mpi4py import MPI
    finally:
        if limit:
            faulthandler.cancel_dump_traceback_later()
    return MPI
