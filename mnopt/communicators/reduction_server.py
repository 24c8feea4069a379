import atexit
import threading
import time

import numpy
from mpi4py import MPI

from mnopt import server as rs
from mnopt._mpi import LayoutMismatchError
from mnopt.communicators.base import CommunicatorBase, _Group


class ReductionServerCommunicator(CommunicatorBase):
    """Push shards of the packed gradients to reduction servers, pull back
    their mean (see mnopt/server.py).  Each worker moves S bytes each way.

    ``mpi_comm``, ``rank`` and ``size`` describe the workers only.  Without
    server processes every worker also reduces one shard (colocated).
    GPU gradients are staged through pinned host memory.
    """

    name = 'reduction_server'

    def __init__(self, mpi_comm, chunk_bytes=rs.DEFAULT_CHUNK_BYTES,
                 server_memory=rs.DEFAULT_MEMORY, stats=False, **kwargs):
        job = rs.job()
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
        self._chunk_bytes = int(chunk_bytes)
        self.stats = rs.Stats() if stats else None
        self._server_threads = []
        if not job.servers:  # colocated: this worker serves shard `rank`
            for chan in channels:
                t = threading.Thread(target=rs.serve, daemon=True, args=(
                    chan, self._workers, mpi_comm.rank, mpi_comm.size,
                    server_memory), name='mnopt-colocated-server')
                t.start()
                self._server_threads.append(t)
        self._said_bye = bool(job.servers)  # the job says it at exit
        super(ReductionServerCommunicator, self).__init__(mpi_comm, **kwargs)
        atexit.register(self._goodbye)

    @property
    def n_servers(self):
        return len(self._servers)

    def _make_group(self, comm):
        group = _Group(comm)
        group.chan = self._unused_channels.pop(0)
        group.result = None
        return group

    def _buffer_options(self):
        # Everything is packed (nothing is summed in place) and nothing is
        # divided here: the servers sum in float32 and divide once.
        return {'bucket_bytes': 1 << 62}

    def _pack_divisor(self):
        return 1

    def _sum(self, buffer, group):
        wire = buffer.layout.wire
        data = next(iter(buffer.host_parts()), None)
        if data is None:
            return
        if group.result is None or group.result.size != data.size:
            group.result = numpy.empty_like(data)
        result = group.result
        chunk = max(1, self._chunk_bytes // data.itemsize)
        bounds = rs.shard_bounds(data.size, self.n_servers)
        chan = group.chan
        t0 = time.perf_counter()
        statuses, requests = [], []
        for j, server in enumerate(self._servers):
            header = numpy.array(
                [rs.KIND_REDUCE, rs.PROTOCOL_VERSION, len(self._workers),
                 data.size, bounds[j], bounds[j + 1] - bounds[j], chunk,
                 rs.WIRE_CODES[wire], buffer.layout.digest], numpy.int64)
            chan.Send([header, MPI.INT64_T], dest=server, tag=rs.TAG_HEADER)
            status = numpy.empty(rs.STATUS_BYTES, numpy.uint8)
            statuses.append((status, chan.Irecv([status, MPI.BYTE],
                                                source=server,
                                                tag=rs.TAG_STATUS)))
            shard = slice(bounds[j], bounds[j + 1])
            for piece in rs.chunk_slices(shard.stop - shard.start, chunk):
                part = slice(shard.start + piece.start,
                             shard.start + piece.stop)
                requests.append(chan.Isend([data[part], MPI.BYTE],
                                           dest=server, tag=rs.TAG_DATA))
                requests.append(chan.Irecv([result[part], MPI.BYTE],
                                           source=server, tag=rs.TAG_RESULT))
        problems = []
        for status, request in statuses:
            request.Wait()
            text = status.tobytes().rstrip(b'\0').decode()
            if text:
                problems.append(text)
        if problems:
            MPI.Request.Waitall(requests[0::2])  # the servers drain these
            for r in requests[1::2]:
                r.Cancel()
            MPI.Request.Waitall(requests[1::2])
            raise LayoutMismatchError('the reduction servers refused: %s'
                                      % '; '.join(sorted(set(problems))))
        MPI.Request.Waitall(requests[0::2])
        t1 = time.perf_counter()
        MPI.Request.Waitall(requests[1::2])
        if self.stats is not None:
            self.stats.add('send', t1 - t0)
            self.stats.add('recv', time.perf_counter() - t0)
            self.stats.bytes += 2 * data.nbytes
        # The means arrived in the second buffer: adopt it, keep the other.
        group.result = buffer.swap_host(result)
        buffer.from_host()

    def _goodbye(self):
        """Colocated: stop this communicator's server threads (after every
        worker has said goodbye to them)."""
        if self._said_bye:
            return
        self._said_bye = True
        rs.say_goodbye(self._channels, self._servers)
        for t in self._server_threads:
            t.join()

    def finalize(self):
        try:
            super(ReductionServerCommunicator, self).finalize()
        finally:
            self._goodbye()
