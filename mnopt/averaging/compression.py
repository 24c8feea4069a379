"""Sign compression in a communicator: the sign-compressed mean of a
gradient set (majority vote times the mean scale, mnopt/codecs/sign.py) and the
state a snapshot keeps of it (the error-feedback residuals)."""

import weakref

import numpy

from mnopt.common import log
from mnopt.codecs import sign
from mnopt.timeline import recorder as timelines
from mnopt.common.arrays import to_host

#: The logger of mnopt.communicators.base, where this was said before.
logger = log.get('mnopt.communicators.base')


def read_optional(serializer, key):
    """``serializer(key, None)``, or None where the snapshot has no
    ``key`` (a strict deserializer raises KeyError for it)."""
    try:
        return serializer(key, None)
    except KeyError:
        return None


class SignCompression(object):
    """``compression='sign'`` for one communicator.  Holds no reference
    to it: the communicator passes its groups (an Averaging) and its vote
    (``vote(group, bits, n_elements, step)``, the algorithm's) per call."""

    def __init__(self, error_feedback):
        self.error_feedback = error_feedback
        #: Residuals from a loaded snapshot ({('sync' or 'async', parameter
        #: names): numpy array}) kept until their codec is built.
        self.loaded_residuals = {}
        #: What to say at the next averaging about the snapshot loaded
        #: (another rank's: its residuals dropped), or None.  Not said at
        #: the load: a snapshot in two parts (a shared file, then this
        #: rank's) loads this rank's own residuals second.
        self.loaded_note = None

    def mean(self, group, label, named, xp, step, vote,
             timeline=timelines.NULL, wire_span=None):
        """The sign-compressed 'mean' of ``named`` over ``group`` (labelled
        'sync' or 'async'), in place.  Runs at N=1 too: one worker's vote
        is its sign.  Recorded in ``timeline`` as 'pack' (the signs
        encoded), 'wire' (``wire_span(step, bytes, op)``: the scales'
        mean and the vote, also timed for the communicator's per-step
        figures) and 'unpack' (the majority decoded)."""
        if self.loaded_note is not None:
            logger.warning(self.loaded_note)
            self.loaded_note = None
        codec = group.sign_codec_for(named, xp, self.error_feedback)
        if self.loaded_residuals:
            residual = self.loaded_residuals.pop(
                (label, tuple(n for n, _ in named)), None)
            if residual is not None and codec.residual is not None \
                    and residual.size == codec.total:
                codec.residual[...] = xp.asarray(residual)
        arrays = [a for _, a in named]
        # Off, the timeline's spans are one shared no-op; the wire is
        # timed for the per-step figures either way.
        with timeline.span('pack', 'comm', step=step):
            bits, scales = codec.encode(arrays, step)
            bits = codec.bits_to_host(bits)
        with wire_span(step, bits.nbytes, 'vote'):
            scales = sign.mean_scales(group.comm, scales)
            majority = vote(group, bits, codec.total, step)
        with timeline.span('unpack', 'comm', step=step):
            codec.decode(codec.majority_to_device(majority), scales, arrays)

    def save(self, serializer, averaging, rank, size, shared, local):
        """Write the averaging counter (``shared``) and this rank's
        residuals (``local``): CommunicatorBase.serialize_compression."""
        if shared:
            serializer('steps', numpy.int64(averaging.steps))
        if not local:
            return
        entries = dict(self.loaded_residuals)   # loaded, not yet used
        for group in averaging.groups():
            label = averaging.label(group)
            for names, residual in group.sign_residuals().items():
                entries[(label, names)] = numpy.array(to_host(residual),
                                                      numpy.float32)
        serializer('rank', numpy.int64(rank))
        serializer('size', numpy.int64(size))
        serializer('n_residuals', numpy.int64(len(entries)))
        for i, (label, names) in enumerate(sorted(entries)):
            serializer('group%d' % i, numpy.array(label))
            serializer('names%d' % i, numpy.array(names, dtype=str))
            serializer('residual%d' % i, entries[(label, names)])

    def load(self, serializer, averaging, rank, size, shared, local):
        """Read what ``save`` wrote (a snapshot without it changes
        nothing); residuals only from this rank's own snapshot of a job of
        this size."""
        def read(key):
            return read_optional(serializer, key)

        steps = read('steps') if shared else None
        if steps is not None:
            averaging.steps = int(steps)
        saved_rank, saved_size = (read('rank'), read('size')) if local \
            else (None, None)
        if saved_rank is None or saved_size is None:
            return   # a snapshot without it: nothing changes
        loaded = {}
        self.loaded_note = None
        if read('n_residuals') is None:   # another compression's state
            logger.warning('mnopt: warning: the snapshot holds no sign '
                           'compression state (another compression): its '
                           'residuals start at zero')
            self.loaded_residuals = {}
            return
        if (int(saved_rank), int(saved_size)) != (rank, size):
            if self.error_feedback and int(serializer('n_residuals', None)):
                self.loaded_note = (
                    'mnopt: warning: rank %d loaded the snapshot of rank %d '
                    'of %d: its sign compression residuals restart at zero, '
                    'so the resumed run is not the uninterrupted one bit for '
                    'bit (%s)' % (rank, int(saved_rank), int(saved_size),
                                  why_residuals_restart(size, saved_size)))
        else:
            for i in range(int(serializer('n_residuals', None))):
                key = (str(serializer('group%d' % i, None)),
                       tuple(str(n) for n in serializer('names%d' % i, None)))
                loaded[key] = numpy.array(serializer('residual%d' % i, None),
                                          numpy.float32).reshape(-1)
        self.loaded_residuals = loaded
        for group in averaging.groups():
            group.forget_sign_codecs()


#: The communicators that said they drop a snapshot's compression state:
#: a resume loads it from more than one file (the ImageNet example: the
#: shared file, then the rank's own), and one warning says it all.
_warned_of_dropping = weakref.WeakSet()


def warn_of_dropped_state(serializer, comm):
    """A communicator ``comm`` without compression loads a snapshot
    (``serializer``: its ``mnopt_compression`` part, this rank's) written
    with one: warn once, naming the state it drops (the resumed run
    averages plainly, its error feedback lost)."""
    def read(key):
        return read_optional(serializer, key)

    kind = read('kind')
    if kind is not None and str(kind) == 'powersgd':
        dropped = ("PowerSGD's state (compression='powersgd' or 'auto': "
                   'its error-feedback residuals, its warm-start factors '
                   "and 'auto''s choices)")
        again = "compression='powersgd' (or 'auto')"
    elif read('n_residuals') is not None:
        dropped = ("sign compression's state (compression='sign': its "
                   'error-feedback residuals)')
        again = "compression='sign'"
    else:
        return
    if comm in _warned_of_dropping:
        return
    _warned_of_dropping.add(comm)
    logger.warning('mnopt: warning: the snapshot holds %s, which this '
                   'communicator, without compression, drops: the resumed '
                   'run averages uncompressed from here; create the '
                   'communicator with %s to continue it as it was',
                   dropped, again)


def why_residuals_restart(size, saved_size):
    """Why a rank's error-feedback residuals restart at zero at a load
    of another rank's snapshot, and what would keep them."""
    if int(saved_size) != size:
        return ('the snapshot\'s job had %d ranks, this one %d: the '
                'residuals are each rank\'s own, not split anew over '
                'another number of ranks' % (int(saved_size), size))
    return 'give each rank a replica set of its own for an exact resume'
