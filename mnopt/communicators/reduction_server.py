"""The reduction_server communicator: workers push shards of the packed
gradients to reduction servers and pull back their mean."""

import collections
import functools
import time
import weakref

import numpy
from mpi4py import MPI

from mnopt.transport import waiting
from mnopt.server import job as server_job
from mnopt.server import loop as server_loop
from mnopt.server import protocol
from mnopt.transport.layouts import LayoutMismatchError
from mnopt.averaging import tuning
from mnopt.communicators.arguments import tunable_argument, whole_argument
from mnopt.communicators.base import MpiCommunicatorBase
from mnopt.communicators.colocated import ColocatedServers, chunk_spans
from mnopt.averaging.group import Group
from mnopt.averaging.janitor import release_after_collection


class ServerChannel(object):
    """reduction_server's state of a group (``Group.state``): the channel
    its exchanges run on (the job's, or its colocated servers': freed by
    them) and the second host buffer the means arrive in."""

    def __init__(self, chan):
        self.chan = chan
        self.result = None

    def free(self):
        pass


class ReductionServerCommunicator(MpiCommunicatorBase):
    """Push shards of the packed gradients to reduction servers, pull back
    their mean (see mnopt/server/process.py).  Each worker moves S bytes
    each way.

    ``mpi_comm``, ``rank`` and ``size`` describe the workers only.  Without
    server processes every worker also reduces one shard (colocated).
    GPU gradients are staged through pinned host memory.
    """

    name = 'reduction_server'

    @classmethod
    def check_arguments(cls, chunk_bytes=protocol.DEFAULT_CHUNK_BYTES,
                        window=protocol.DEFAULT_WINDOW,
                        server_memory=protocol.DEFAULT_MEMORY,
                        stats=False,
                        vote=None, **kwargs):
        if vote is not None:
            raise ValueError('the reduction_server communicator counts votes '
                             'on its servers; vote=%r is for ring '
                             'communicators' % (vote,))
        settings = super(ReductionServerCommunicator, cls).check_arguments(
            **kwargs)
        settings.update(
            chunk_bytes=tunable_argument('chunk_bytes', chunk_bytes, 1),
            window=tunable_argument('window', window, 1),
            # Any bound makes progress: a server always has one chunk's slot.
            server_memory=whole_argument('server_memory', server_memory, 1),
            stats=bool(stats), vote=None)
        tuning.check(cls.name, settings)
        return settings

    def __init__(self, mpi_comm, **kwargs):
        settings = self.check_arguments(**kwargs)
        job = server_job.job(stall_warning=settings['stall_warning'],
                     timeout=settings['timeout'])
        if job.servers:
            if mpi_comm != MPI.COMM_WORLD:
                raise ValueError('with reduction servers in the job, the '
                                 'reduction_server communicator runs over '
                                 'MPI.COMM_WORLD')
            # Shared by every such communicator of this process; with double
            # buffering on several of them at once, their background
            # averagings would interleave on the async channel: one at a time.
            mpi_comm, channels = job.channels()
            self._servers = list(job.servers)
            self._workers = list(job.workers)
        else:
            channels = [mpi_comm.Dup(), mpi_comm.Dup()]
            self._servers = list(range(mpi_comm.size))
            self._workers = list(range(mpi_comm.size))
        self._channels = channels
        self._unused_channels = list(channels)  # sync group, then async
        self.stats = server_loop.Stats() if settings['stats'] else None
        self._colocated = None  # with servers, the job says goodbye at exit
        # How this worker's exchanges poll (mnopt/transport/waiting.py):
        # beside server processes the job's processes outnumber the cores
        # they wait on; colocated, three threads of each process share it.
        self._pace = waiting.PATIENT if job.servers else waiting.PROMPT
        super(ReductionServerCommunicator, self).__init__(mpi_comm,
                                                          **settings)
        if not job.servers:  # colocated: this worker serves shard `rank`
            self._colocated = ColocatedServers(
                channels, mpi_comm.rank, settings['server_memory'],
                self._monitor, self.timeline)
            # Garbage collection stops them too (after it, as it frees
            # the rest: release_after_collection): nothing here holds
            # the communicator.
            weakref.finalize(self, release_after_collection,
                             functools.partial(self._colocated.close, False))
        self.vote = 'server'

    def _make_monitor(self, mpi_comm, label, **settings):
        job = server_job.job()
        if not job.servers:
            return super(ReductionServerCommunicator, self)._make_monitor(
                mpi_comm, label, **settings)
        # Workers and servers together: made once by the job, at start-up.
        monitor = job.monitor()
        problem = server_job.stall_settings_problem(
            settings.get('stall_warning'), settings.get('timeout'))
        if problem is not None:
            raise problem
        return monitor

    def _owns_monitor(self):
        # With server processes the job's monitor serves every
        # communicator of the process.
        return not server_job.job().servers

    #: The chunk and window now: the settings, or with 'auto' the
    #: candidate being timed, then the choice (tuning.py).
    chunk_bytes = property(
        lambda self: self.averaging.tuner.current()['chunk_bytes'])
    window = property(lambda self: self.averaging.tuner.current()['window'])

    @property
    def n_servers(self):
        return len(self._servers)

    def _make_group(self, comm):
        if self._unused_channels[0] is not self._channels[0]:
            self._claim_async_channel(comm)
        return Group(comm, ServerChannel(self._unused_channels.pop(0)))

    def _buffer_options(self):
        # Everything is packed (nothing is summed in place), divided by the
        # number of workers as every communicator does, so that a mean that
        # fits the wire never overflows; the servers add up the shares.
        return {'bucket_bytes': 1 << 62}

    def _pack_sum_unpack(self, buffer, group, arrays, step=None):
        if not buffer.can_stream(arrays):
            return super(ReductionServerCommunicator, self)._pack_sum_unpack(
                buffer, group, arrays, step)
        # Each chunk is packed from the arrays just before it leaves and
        # each mean unpacked into them as it arrives: both copies hide
        # behind the network (one 'wire' span holds their spans).
        with self._wire_span(step, buffer.nbytes):
            self._stream(buffer, group, arrays)

    def _stream(self, buffer, group, arrays):
        def pack(part):
            buffer.pack_range(arrays, part.start, part.stop,
                              self._pack_divisor())

        def unpack(part, means):
            buffer.unpack_range(arrays, means, part.start, part.stop)
        if self.timeline:   # each chunk's pack and unpack, inside the wire
            pack, unpack = chunk_spans(self.timeline, buffer, pack, unpack)
        self._exchange(
            group, buffer.wire, self._result_buffer(group, buffer),
            buffer.layout.wire, buffer.layout.digest,
            on_push=pack, on_result=unpack)

    def _sum(self, buffer, group):
        data = next(iter(buffer.host_parts()), None)
        if data is None:
            return
        result = self._result_buffer(group, buffer)
        self._exchange(group, data, result, buffer.layout.wire,
                       buffer.layout.digest)
        # The means arrived in the second buffer: adopt it, keep the other.
        group.state.result = buffer.swap_host(result)
        buffer.from_host()

    def _traffic(self, nbytes, op):
        """A worker pushes its buffer to the servers and pulls the mean
        back: the payload each way (the vote's bits likewise)."""
        if op == 'vote':
            return super(ReductionServerCommunicator, self)._traffic(
                nbytes, op)
        return nbytes, nbytes

    def _vote(self, group, bits, n_elements, step):
        """Bernstein et al.'s scheme: push the packed sign bits, the
        servers count the votes and push back the majority bits."""
        self.vote_stats = {}
        majority = numpy.empty_like(bits)
        self._exchange(group, bits, majority, 'sign',
                       group.sign_codec.layout.digest, step)
        self.vote_stats = {'bytes_sent': bits.nbytes}
        return majority

    def _claim_async_channel(self, comm):
        """With server processes, every communicator of a process shares
        the job's async channel: two of them averaging in the background
        at once would interleave their requests (on each worker in its
        own order).  The first to average in the background holds it
        until it is finalized or collected; another is refused, on every
        worker at the same call."""
        job = server_job.job()
        if not job.servers:
            return
        holder = job.async_user() if job.async_user else None
        if holder is not None and holder is not self:
            comm.Free()
            raise RuntimeError(
                'with reduction servers, one reduction_server communicator '
                'per process averages in the background at a time (they '
                'share the servers\' async channel) and %r does: finalize() '
                'it first, or average this one synchronously' % (holder,))
        job.async_user = weakref.ref(self)

    def _release_async_channel(self):
        job = server_job.job()
        if job.async_user is not None and job.async_user() is self:
            job.async_user = None

    @staticmethod
    def _result_buffer(group, buffer):
        """The second host buffer the means arrive in (kept per group,
        swapped with the buffer's own): made by the buffer, so pinned
        where a GPU copies it."""
        channel = group.state
        if channel.result is None or not buffer.fits_host(channel.result):
            channel.result = buffer.new_host_buffer()
        return channel.result

    def _exchange(self, group, data, result, wire, digest, step=0,
                  on_push=None, on_result=None):
        """Push ``data`` (a contiguous numpy array) in shards to the
        servers, pull what they make of it into ``result``.
        ``on_push(part)`` runs just before a chunk leaves, ``on_result(part,
        values)`` as soon as its result is in."""
        if not data.size:
            return
        chunk = max(1, self.chunk_bytes // data.itemsize)
        bounds = protocol.shard_bounds(data.size, self.n_servers)
        chan = group.state.chan
        if self._colocated is not None:
            self._colocated.wake(chan)
        t0 = time.perf_counter()
        # Workers start at different servers and go round them chunk by
        # chunk, so no server's link takes every worker's data at once
        # (incast) while other servers idle.
        n_servers = self.n_servers
        order = [(self.rank + k) % n_servers for k in range(n_servers)]
        statuses, pending = [], {}
        for j in order:
            server = self._servers[j]
            header = numpy.array(
                [protocol.KIND_REDUCE, protocol.PROTOCOL_VERSION,
                 len(self._workers), data.size, bounds[j], bounds[j + 1] - bounds[j], chunk,
                 protocol.WIRE_CODES[wire], digest, step], numpy.int64)
            chan.Send([header, MPI.INT64_T], dest=server,
                      tag=protocol.TAG_HEADER)
            status = numpy.empty(protocol.STATUS_BYTES, numpy.uint8)
            statuses.append((status, chan.Irecv([status, MPI.BYTE],
                                                source=server,
                                                tag=protocol.TAG_STATUS)))
            pending[j] = collections.deque(
                slice(bounds[j] + p.start, bounds[j] + p.stop)
                for p in protocol.chunk_slices(bounds[j + 1] - bounds[j],
                                               chunk))
        sends, recvs, owner = [], [], []

        def push(j):
            part, server = pending[j].popleft(), self._servers[j]
            if on_push is not None:
                on_push(part)
            sends.append(chan.Isend([data[part], MPI.BYTE], dest=server,
                                    tag=protocol.TAG_DATA))
            recvs.append(chan.Irecv([result[part], MPI.BYTE], source=server,
                                    tag=protocol.TAG_RESULT))
            owner.append((j, part))

        # A window of chunks in flight per server: a new chunk leaves when
        # a mean comes back.  Posting everything at once fills the links'
        # queues, and each server's first mean then waits behind them.
        for _ in range(self.window):
            for j in order:
                if pending[j]:
                    push(j)
        problems = []
        for status, request in statuses:
            waiting.wait_all([request], self._pace)
            text = status.tobytes().rstrip(b'\0').decode()
            if text:
                problems.append(text)
        if problems:
            for j in order:  # the servers drain everything
                while pending[j]:
                    push(j)
            waiting.wait_all(sends, self._pace)
            for r in recvs:
                r.Cancel()
            waiting.wait_all(recvs, self._pace)
            raise LayoutMismatchError('the reduction servers refused: %s'
                                      % '; '.join(sorted(set(problems))))
        t_sent = None
        while True:
            done = waiting.next_completed(recvs, self._pace)
            if done is None:
                break
            for i in done:
                j, part = owner[i]
                if pending[j]:
                    push(j)
                if on_result is not None:
                    on_result(part, result[part])
            if t_sent is None and not any(pending.values()):
                t_sent = time.perf_counter()
        waiting.wait_all(sends, self._pace)
        t1 = t_sent or time.perf_counter()
        if self.stats is not None:
            self.stats.add('send', t1 - t0)
            self.stats.add('recv', time.perf_counter() - t0)
            self.stats.bytes += 2 * data.nbytes

    def finalize(self):
        try:
            super(ReductionServerCommunicator, self).finalize()
        finally:
            self._release_async_channel()
            if self._colocated is not None:
                self._colocated.close(wait=True)
