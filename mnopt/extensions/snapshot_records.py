"""What each multi_node_snapshot file records beside the trainer's state:
how many replica sets wrote the snapshot, which write it belongs to and
the epoch's position across ranks (added by the recording writer), and
how to read that back, with the number of ranks a sharded optimizer's
file was written by."""

import numpy


#: Where each set's file records how many replica sets wrote the snapshot.
N_SETS_KEY = 'multi_node_snapshot/n_replica_sets'
#: Where each file records the write it belongs to (the same in every file
#: of one snapshot).
WRITE_ID_KEY = 'multi_node_snapshot/write_id'


def write_id(path):
    """The write id recorded in the snapshot file ``path`` (a whole file),
    or None where it records none (written before mnopt recorded ids)."""
    with numpy.load(path) as f:
        return str(f[WRITE_ID_KEY]) if WRITE_ID_KEY in f.files else None


def sets_that_wrote(path):
    """How many replica sets wrote the snapshot file ``path`` (a whole
    file), or None where it does not say (written before mnopt recorded
    it)."""
    with numpy.load(path) as f:
        return int(f[N_SETS_KEY]) if N_SETS_KEY in f.files else None


def recorded_sets(path):
    """``sets_that_wrote(path)``, or None where the file cannot say (cut
    short or damaged: its own writer's check reports that)."""
    try:
        return sets_that_wrote(path)
    except Exception:
        return None


def shard_size(path):
    """The number of ranks a sharded optimizer's snapshot file ``path``
    (a whole file) was written by, or None where it holds no sharded
    optimizer (mnopt.zero's ``mnopt_shard/size``)."""
    with numpy.load(path) as f:
        for key in f.files:
            if key == 'mnopt_shard/size' or key.endswith('/mnopt_shard/size'):
                return int(f[key])
    return None


class RecordingSets(object):
    """A snapshot writer that adds the number of replica sets (so that
    autoload tells a resize from a set's missing file) and the write id to
    what it writes, then hands it to the snapshot's own writer."""

    def __init__(self, writer, n_sets):
        self.writer, self.n_sets = writer, n_sets
        self.write_id = None   # set before each write
        #: More arrays to write (the epoch's position), set before each.
        self.extra = {}

    def __call__(self, filename, outdir, target):
        # Chainer 7's snapshot hands its writer npz.serialize's dict.
        target = dict(target)
        target.update(self.extra)
        target[N_SETS_KEY] = numpy.asarray(self.n_sets)
        if self.write_id is not None:
            target[WRITE_ID_KEY] = numpy.asarray(self.write_id)
        self.writer(filename, outdir, target)

    def __getattr__(self, name):
        # finalize, _add_cleanup_hook, ...: the wrapped writer's own.
        if name == 'writer':
            raise AttributeError(name)
        return getattr(self.writer, name)
