"""The synced copy of ``local_steps`` (mnopt/optimizers/local_steps.py):
the parameters as of each fragment's last sync, the same on every rank,
each fragment with its own copy of the outer optimizer set up on them;
the pseudo-gradients (synced minus local), the outer update of a
fragment from their mean, and its snapshot.  Also the model's
floating-point persistents (batch normalization's running statistics),
averaged over the ranks at each sync of the first fragment: what
``using_synced_parameters`` swaps in with the parameters.

The copy is kept in float32 at least (float16 parameters get a float32
copy, as DiLoCo's outer state), so pseudo-gradients are computed and the
outer optimizer steps in float32; the wire is the communicator's
``allreduce_grad_dtype``.  Each fragment's outer optimizer is a copy of
the one given, updating that fragment's parameters only (a Chainer
optimizer updates every parameter of its target, and would move the
others with zero gradients)."""

import contextlib
import copy

import chainer
import numpy

from mnopt.timeline import step_stats
from mnopt.timeline import recorder as timelines
from mnopt.common.arrays import as_array_like, to_host
from mnopt.optimizers.fragments import split_by_bytes
from mnopt.optimizers.protocol import StatesMayBeAbsent

#: Where a snapshot keeps it (under the optimizer's key).
KEY = 'synced'


def copy_dtype(dtype):
    """The synced copy's dtype: the parameter's, float32 at least."""
    return numpy.promote_types(dtype, numpy.float32)


class Fragment(object):
    """Some parameters' synced copy (``link``: p0, p1, ... in the order
    of ``names``) and their outer optimizer."""

    def __init__(self, names, arrays, template):
        self.names = list(names)
        self.link = chainer.Link()
        with self.link.init_scope():
            for i, array in enumerate(arrays):
                setattr(self.link, 'p%d' % i, chainer.Parameter(array))
        self.outer = copy.deepcopy(template)
        self.outer.setup(self.link)

    def params(self):
        return [getattr(self.link, 'p%d' % i) for i in range(len(self.names))]

    def add(self, name, array):
        """``name``'s synced copy ``array`` joins, last, with a fresh
        state in the outer optimizer (the others' kept)."""
        with self.link.init_scope():
            setattr(self.link, 'p%d' % len(self.names),
                    chainer.Parameter(array))
        param = getattr(self.link, 'p%d' % len(self.names))
        param.update_rule = self.outer.create_update_rule()
        self.names.append(name)


def float_persistents(target):
    """``[(path, link, name), ...]`` of ``target``'s floating-point
    persistent arrays (batch normalization's ``avg_mean``, ``avg_var``),
    in the order of their paths."""
    found = []
    for link_path, link in sorted(target.namedlinks()):
        # Chainer lists a link's persistent names only in _persistent.
        for name in sorted(link._persistent):
            value = link.__dict__.get(name)
            if hasattr(value, 'dtype') and value.dtype.kind == 'f' and \
                    getattr(value, 'ndim', 0) > 0:
                found.append(('%s/%s' % (link_path.rstrip('/'), name),
                              link, name))
    return found


class SyncedCopy(object):
    """Every fragment's synced parameters and outer optimizer, and the
    persistents' last mean (``persistents``: {path: numpy array})."""

    def __init__(self, fragments, persistents=None):
        self.fragments = fragments
        self.persistents = dict(persistents or {})

    def average_persistents(self, comm, target, key=None):
        """At a sync: every float persistent of ``target`` becomes its
        mean over the ranks (summed in the synced copy's dtype: float32 at
        least), kept as the synced one; its bytes counted as the
        communicator's averagings' are (``counted_allreduce``, ``key``).
        Ranks whose persistents differ get a ValueError on every rank."""
        found = float_persistents(target)
        values = [link.__dict__[name] for _, link, name in found]
        comm.same({'persistents': [(path, tuple(v.shape), v.dtype.name)
                                   for (path, _, _), v in zip(found, values)]},
                  'the persistent values (batch normalization statistics) '
                  'that local_steps averages at its syncs')
        if not found:
            return
        dtype = numpy.result_type(*[copy_dtype(v.dtype) for v in values])
        total = to_host(counted_allreduce(comm, numpy.concatenate(
            [to_host(v).astype(dtype).ravel() for v in values]), key))
        total /= dtype.type(comm.size)
        start = 0
        for (path, link, name), value in zip(found, values):
            mean = total[start:start + value.size].reshape(
                value.shape).astype(value.dtype)
            start += value.size
            # A copy of its own: the model's is updated in place.
            link.__dict__[name] = as_array_like(mean.copy(), value)
            self.persistents[path] = mean

    @classmethod
    def of(cls, target, template, count):
        """A copy of ``target``'s parameters now, cut into ``count``
        fragments of about equal bytes."""
        params = dict(target.namedparams())
        named = sorted((n, p.array) for n, p in params.items()
                       if p.array is not None)
        cuts = split_by_bytes([(n, a.nbytes) for n, a in named], count)
        return cls([Fragment(names, [_copy_of(params[n].array)
                                     for n in names], template)
                    for names in cuts])

    def add(self, names, target):
        """Parameters of ``target`` that appeared after the copy was made
        (``names``; their values the same on every rank): each joins the
        fragment that holds the name before it in order (the first
        fragment if none), whose next sync is its first."""
        params = dict(target.namedparams())
        held = {n for fragment in self.fragments for n in fragment.names}
        for name in sorted(set(names) - held):   # each held once
            index = 0
            for i, fragment in enumerate(self.fragments):
                if any(n < name for n in fragment.names):
                    index = i
            self.fragments[index].add(name, _copy_of(params[name].array))

    def names(self, index):
        return self.fragments[index].names

    def pseudo_gradients(self, target, index):
        """``[(name, synced - local), ...]`` of fragment ``index`` in the
        copy's dtype: what the communicator averages."""
        params = dict(target.namedparams())
        fragment = self.fragments[index]
        out = []
        for name, synced in zip(fragment.names, fragment.params()):
            local = params[name].array
            with chainer.using_device(params[name].device):
                out.append((name, synced.array - local.astype(
                    synced.array.dtype, copy=False)))
        return out

    def apply(self, index, means, target, hyperparameters=None):
        """The outer update of fragment ``index`` from the mean
        pseudo-gradients ``[(name, array), ...]``, its outer optimizer's
        ``hyperparameters`` ({name: value}) set first where given; the
        model's parameters of the fragment then take the new synced
        values (the same on every rank, bit for bit)."""
        fragment = self.fragments[index]
        for name, value in (hyperparameters or {}).items():
            setattr(fragment.outer.hyperparam, name, value)
        for param, (_, mean) in zip(fragment.params(), means):
            param.grad = mean
        # Parameters that joined after these means were taken: not moved.
        joined = fragment.params()[len(means):]
        for param in joined:
            param.update_rule.enabled = False
        fragment.outer.update()
        for param in joined:
            param.update_rule.enabled = True
        params = dict(target.namedparams())
        for name, synced, _ in zip(fragment.names, fragment.params(), means):
            synced.grad = None
            local = params[name]
            local.array[...] = synced.array.astype(local.array.dtype,
                                                   copy=False)

    @contextlib.contextmanager
    def swapped_in(self, target):
        """The model's parameters are the synced ones inside (cast to
        their dtype), its local ones again after."""
        params = dict(target.namedparams())
        saved, saved_persistents = {}, []
        try:
            for fragment in self.fragments:
                for name, synced in zip(fragment.names, fragment.params()):
                    param = params[name]
                    saved.setdefault(name, param.array)   # the local one
                    param.array = synced.array.astype(param.array.dtype)
            for path, link, name in float_persistents(target):
                if path in self.persistents:
                    value = link.__dict__[name]
                    saved_persistents.append((link, name, value))
                    link.__dict__[name] = as_array_like(
                        self.persistents[path].copy(), value)
            yield
        finally:
            for name, array in saved.items():
                params[name].array = array
            for link, name, value in saved_persistents:
                link.__dict__[name] = value

    # ------------------------------------------------------------ snapshots
    def save(self, serializer):
        """Each fragment's names, synced parameters and outer state."""
        serializer('count', numpy.int64(len(self.fragments)))
        for i, fragment in enumerate(self.fragments):
            sub = serializer['f%d' % i]
            sub('names', numpy.array(fragment.names, dtype=str))
            fragment.link.serialize(sub['params'])
            fragment.outer.serialize(sub['outer'])
        paths = sorted(self.persistents)
        sub = serializer['persistents']
        sub('paths', numpy.array(paths, dtype=str))
        for i, path in enumerate(paths):
            sub('v%d' % i, self.persistents[path])

    @classmethod
    def load(cls, serializer, target, template):
        """The copy a snapshot holds, on the devices of ``target``'s
        parameters (the host for those without data yet)."""
        params = dict(target.namedparams())
        fragments = []
        for i in range(int(serializer('count', None))):
            sub = serializer['f%d' % i]
            names = [str(n) for n in sub('names', None)]
            arrays = []
            for j, name in enumerate(names):
                host = numpy.asarray(sub['params']('p%d' % j, None))
                param = params.get(name)
                device = param.device if param is not None and \
                    param.array is not None else chainer.backend.CpuDevice()
                arrays.append(device.send(host))
            fragment = Fragment(names, arrays, template)
            # Before the first outer update of a fragment: no state yet.
            fragment.outer.serialize(StatesMayBeAbsent(sub['outer']))
            fragments.append(fragment)
        persistents = {}
        sub = serializer['persistents']
        try:
            paths = sub('paths', None)
        except KeyError:   # a snapshot from before they were kept
            paths = None
        paths = [] if paths is None else [str(p) for p in paths]
        for i, path in enumerate(paths):
            persistents[path] = numpy.array(sub('v%d' % i, None))
        return cls(fragments, persistents)


def counted_allreduce(comm, array, key):
    """``comm.allreduce(array)`` (a plain sum: no wire dtype, no
    compression, no averaging counter), its bytes and time counted as the
    communicator's averagings' are: in ``comm.communication_stats()`` and
    as a 'wire' of its timeline (args ``persistents``: ``key``, the same
    on every rank; no ``seq``, which is the averagings' counter)."""
    stats = getattr(comm, 'step_stats', None)
    if stats is None or comm.size == 1:   # no figures, or nothing moves
        return comm.allreduce(array)
    name = getattr(comm, 'timeline_name', None)
    span = getattr(comm, 'timeline', timelines.NULL).span(
        'wire', 'comm', op='allreduce', comm=name, persistents=key,
        bytes=array.nbytes)
    with stats.timed('caller'):
        stats.arrive()   # a late rank is waited for in allreduce's check
        with stats.wire_timer(
                span, (name, 'persistents', key), array.nbytes, 'allreduce',
                lambda nbytes, op: step_stats.traffic(op, nbytes, comm.size)):
            return comm.allreduce(array)


def _copy_of(array):
    """A copy of ``array`` in the synced copy's dtype, on its device."""
    return array.astype(copy_dtype(array.dtype), copy=True)
