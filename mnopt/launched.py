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
"""

from mnopt import log

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
    by default on stderr, mnopt/log.py)."""
    import os
    global _warned
    said = problem(os.environ if environ is None else environ, world_size)
    if said is not None and not _warned:
        _warned = True
        logger.warning('mnopt: warning: %s', said)
    return said
