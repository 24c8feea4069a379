"""The reduction server's job: who is a worker and who a server in
COMM_WORLD (agreed once per process), the channels they talk on, the job's
one stall-detection monitor, the workers' goodbyes, and the check that
stall times come from the environment in a job with server processes."""

import atexit

import numpy
from mpi4py import MPI

from mnopt.server.protocol import HEADER_FIELDS, KIND_BYE, TAG_HEADER
from mnopt.stall.monitor import Monitor
from mnopt.stall.settings import settings_or_defaults
from mnopt.transport import waiting
from mnopt.transport.stall_wait import wait_or_abort


def stall_settings_problem(stall_warning, timeout):
    """In a job with server processes the job's one monitor watches every
    process, so stall times come from the environment only: a ValueError
    for keywords that set them, else None."""
    if stall_warning is not None or timeout is not None:
        return ValueError(
            'with reduction servers, stall detection covers the whole '
            'job: set MNOPT_STALL_WARNING / MNOPT_TIMEOUT in the '
            'environment of every process instead')
    return None


_job = None
ROLES = ('worker', 'server')
#: The channels' names, in the order of ``Job.channels()``: serve counts
#: its requests per channel (two threads serve them at once).
CHANNEL_NAMES = ('sync', 'async')


class Job(object):
    """Who is what in COMM_WORLD, agreed once per process by every process
    (workers at their first create_communicator, servers at start-up)."""

    def __init__(self, roles):
        self.roles = roles
        self.servers = [r for r, role in enumerate(roles) if role == 'server']
        self.workers = [r for r, role in enumerate(roles) if role == 'worker']
        self._channels = None
        self._monitor = None
        self.async_user = None  # weakref to the communicator averaging on
        #                         the async channel in the background

    def name_of(self, world_rank):
        """'worker k' or 'server k' (k counts within the role)."""
        if world_rank in self.servers:
            return 'server %d' % self.servers.index(world_rank)
        return 'worker %d' % self.workers.index(world_rank)

    def monitor(self):
        """Stall detection over the whole job (workers and servers), made
        with the channels; shared by every process's reduction_server
        communicators."""
        self.channels()
        return self._monitor

    def channels(self):
        """(this role's communicator, [sync channel, async channel]).

        Made once per process, collectively over COMM_WORLD (servers at
        start-up, workers at their first reduction_server communicator),
        and shared by every such communicator of the process.  Workers say
        goodbye on them when the process exits."""
        if self._channels is None:
            world = MPI.COMM_WORLD
            is_server = world.rank in self.servers
            # Read before the first collective, so that a bad setting on
            # one process cannot leave the others in the Split (it is
            # reported where the arguments are checked).
            warning, timeout = settings_or_defaults()
            mine = world.Split(1 if is_server else 0, world.rank)
            self._channels = (mine, [world.Dup(), world.Dup()])
            self._monitor = Monitor(
                world, 'job', warning or 0, timeout or 0, names=self.name_of,
                helpers=self.servers)
            if not is_server:
                atexit.register(say_goodbye, self._channels[1], self.servers)
        return self._channels


def say_goodbye(channels, servers):
    """Tell every server, on every channel, that this worker is done;
    servers exit once all workers have."""
    if MPI.Is_finalized():
        return
    bye = numpy.zeros(HEADER_FIELDS, numpy.int64)
    bye[0] = KIND_BYE
    for chan in channels:
        for server in servers:
            chan.Send([bye, MPI.INT64_T], dest=server, tag=TAG_HEADER)


def job(default_role='worker', stall_warning=None, timeout=None):
    """This process's Job, agreed at the first call (collective over
    COMM_WORLD: every worker at its first create_communicator, every
    server at start-up).  With servers, the channels are made at once.

    The exchange is waited for with stall detection (``stall_warning``,
    ``timeout``, else MNOPT_STALL_WARNING / MNOPT_TIMEOUT): a process that
    never gets there (a worker that fails or exits before creating a
    communicator) ends the job at the timeout, with a report, instead of
    leaving the others waiting forever."""
    global _job
    if _job is None:
        # A process's role is its entry point's (mnopt.server serves, any
        # other script works), not MPI's APPNUM: an MPMD launch also gives
        # ranks of one script their own environments.
        roles = _exchange_roles(default_role, stall_warning, timeout)
        the_job = Job(roles)
        if the_job.servers and max(the_job.workers, default=-1) > \
                min(the_job.servers):
            # Every process sees the same roles: the same error everywhere.
            raise ValueError(
                'reduction servers must come after the workers in the '
                'job (servers at ranks %s, workers at %s): launch as in '
                'mpiexec -n W python train.py : -n S python -m mnopt.server'
                % (the_job.servers, the_job.workers))
        if the_job.servers:
            # Straight after the exchange, which every process has passed:
            # these collectives cannot wait for a process that is not
            # coming.
            the_job.channels()
        _job = the_job
    return _job


def _exchange_roles(mine, stall_warning, timeout):
    world = MPI.COMM_WORLD
    codes = numpy.empty(world.size, numpy.int32)
    request = world.Iallgather(
        [numpy.array([ROLES.index(mine)], numpy.int32), MPI.INT],
        [codes, MPI.INT])
    wait_or_abort(
        [request], 'the job start-up (every worker at its first '
        'create_communicator, every reduction server at its start)',
        stall_warning, timeout, pace=waiting.PATIENT)
    return [ROLES[c] for c in codes]
