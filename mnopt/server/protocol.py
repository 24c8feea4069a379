"""The reduction server's protocol: the messages between workers and
servers (tags, the request header, the status answer), how a request is
cut into shards and chunks, and the check of a round's headers.

Every request starts with a header from each worker to each server; the
server answers a status as soon as it has all headers, so a disagreement
(protocol version, number of workers, sizes, dtype, layout) is an error on
every worker at once, which the server also reports."""

import numpy

from mnopt.codecs import grad_buffer

#: 3: workers send their gradients divided by W; the server only sums.
PROTOCOL_VERSION = 3
# Wires: the gradient dtypes, and 'sign' (packed sign bits; the servers
# count the votes and return the majority bits, see mnopt/codecs/sign.py).
WIRES = tuple(grad_buffer.WIRE_DTYPES) + ('sign',)
WIRE_CODES = {name: i for i, name in enumerate(WIRES)}
TAG_HEADER, TAG_STATUS, TAG_DATA, TAG_RESULT = 0x3A0, 0x3A1, 0x3A2, 0x3A3
KIND_REDUCE, KIND_BYE = 1, 2
DEFAULT_CHUNK_BYTES = 1 << 18
DEFAULT_WINDOW = 6  # chunks in flight per worker and server
STATUS_BYTES = 4000  # a server's answer to a header: '' or why it refused
DEFAULT_MEMORY = 64 << 20

# Header: kind, version, n_workers, total, shard_start, shard_len, chunk,
# wire code, layout digest, step (the votes' coin for ties).
HEADER_FIELDS = 10


def shard_bounds(total, n_servers):
    return [total * j // n_servers for j in range(n_servers + 1)]


def chunk_slices(length, chunk):
    return [slice(s, min(s + chunk, length)) for s in range(0, length, chunk)]


def wire_storage(wire):
    return numpy.dtype(numpy.uint8) if wire == 'sign' else \
        grad_buffer.storage_dtype(wire)


def check_headers(headers, active, n, my_index, n_servers):
    """Why server ``my_index`` refuses a round whose headers (from the
    ``active`` of ``n`` workers) are ``headers``, or None."""
    if len(active) != n:
        return ('%d of %d workers asked for a reduction while the others '
                'finished' % (len(active), n))
    first = headers[active[0]]
    if first[1] != PROTOCOL_VERSION:
        return ('protocol version %d, server speaks %d'
                % (first[1], PROTOCOL_VERSION))
    if first[2] != n:
        return ('workers think there are %d workers, the server sees %d'
                % (first[2], n))
    for i in active:
        if not (headers[i, 1:] == first[1:]).all():
            fields = ('version', 'workers', 'total elements', 'shard start',
                      'shard length', 'chunk', 'wire dtype', 'layout digest',
                      'step')
            diff = [f for f, a, b in zip(fields, headers[i, 1:], first[1:])
                    if a != b]
            return ('worker %d and worker %d disagree on %s (protocol %d, '
                    'signature %s vs %s)' % (
                        active[0], i, ', '.join(diff), PROTOCOL_VERSION,
                        list(first[1:]), list(headers[i, 1:])))
    bounds = shard_bounds(int(first[3]), n_servers)
    if (first[4], first[5]) != (bounds[my_index],
                                bounds[my_index + 1] - bounds[my_index]):
        return 'shard %d is [%d, +%d), workers sent [%d, +%d)' % (
            my_index, bounds[my_index], bounds[my_index + 1]
            - bounds[my_index], first[4], first[5])
    return None
