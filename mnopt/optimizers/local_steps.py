"""Local steps with an outer optimizer (``create_multi_node_optimizer(
opt, comm, local_steps=H)``: DiLoCo, and with ``fragments=F`` Streaming
DiLoCo; docs/local_sgd.md).

Each rank updates its own replica with the wrapped (inner) optimizer on
its own gradients; nothing is averaged between syncs.  Every H updates a
fragment's pseudo-gradients (its synced parameters minus the local ones)
are averaged through the communicator's ``mean_grads`` (so every
communicator, wire, compression (sign, PowerSGD: each fragment a
gradient set with its own error feedback), the in-job tuner and the
timeline apply), and the fragment's outer
optimizer steps the synced parameters with their mean; the model then
holds the new synced values, bit for bit the same on every rank.  With
``fragment_sync_delay=tau`` the averaging runs in the background
(``mean_grads_async``) during the next tau inner updates and the outer
update lands after the tau-th, replacing the fragment's local values (as
torchft's DiLoCo with ``fragment_update_alpha=0``)."""

import contextlib
import warnings

import chainer
import numpy

from mnopt.optimizers import fragments as schedule
from mnopt.optimizers.hook_agreement import outer_settings
from mnopt.optimizers.protocol import BROADCAST, LOADED, RESUME
from mnopt.optimizers.protocol import MultiNodeOptimizer
from mnopt.optimizers.protocol import digest, host, state_of, stepped
from mnopt.optimizers.local_steps_mark import SNAPSHOT_KEY, read
from mnopt.optimizers.local_steps_mark import saved_settings, settings_said
from mnopt.optimizers.local_steps_settings import hook_problem
from mnopt.optimizers.shares import not_a_share
from mnopt.optimizers.synced_copy import KEY, SyncedCopy


class InFlight(object):
    """A fragment whose mean is being averaged (``handle``; None once
    done or loaded), applied after local step ``apply_at``."""

    def __init__(self, index, apply_at, handle, means):
        self.index, self.apply_at = index, apply_at
        self.handle, self.means = handle, means

    def wait(self, blocked):
        handle, self.handle = self.handle, None
        if handle is not None:
            blocked(handle.wait)
        return self.means


class LocalStepsOptimizer(MultiNodeOptimizer):
    """``local_steps=H``: see the module.  ``_done`` counts the updates
    applied since the last broadcast, the synchronous warm-up's
    (``sync_warmup_steps``) first; local step s is the s-th after it."""

    def __init__(self, actual_optimizer, communicator, zero_fill, settings):
        super(LocalStepsOptimizer, self).__init__(
            actual_optimizer, communicator, zero_fill)
        object.__setattr__(self, '_local', settings)
        object.__setattr__(self, '_template', settings.outer())
        object.__setattr__(self, '_synced', None)
        object.__setattr__(self, '_done', 0)
        object.__setattr__(self, '_in_flight', None)
        #: A loaded snapshot's parameter set, until the update after.
        object.__setattr__(self, '_loaded_set', None)

    # ------------------------------------------------------------- public
    @contextlib.contextmanager
    def using_synced_parameters(self):
        """Inside, the model holds the synced parameters (the last sync's,
        the same on every rank: what to evaluate or export); its local
        ones again after.  Before the first local step the model's own
        parameters are the synchronous ones, and stay."""
        if self._synced is None:
            yield
            return
        with self._synced.swapped_in(self.target):
            yield

    def wait(self):
        """Block until a fragment's averaging in flight is done (its outer
        update still lands at its step)."""
        if self._in_flight is not None:
            self._in_flight.wait(self._blocked)

    # --------------------------------------------------------------- step
    @stepped
    def update(self, lossfun=None, *args, **kwds):
        if lossfun is not None:
            self._backward(lossfun, args, kwds)
        if self._meets() and not self._meet():
            return
        warmup = self._local.sync_warmup_steps
        if self._done < warmup:
            self._blocked(self.communicator.multi_node_mean_grad,
                          self.target, self.zero_fill)
            self._apply(*args, **kwds)
            object.__setattr__(self, '_done', self._done + 1)
            self._copy_if_local()
            return
        self._copy_if_local()   # a load's or rank 0's state without one
        self._apply(*args, **kwds)   # the inner update: own gradients only
        object.__setattr__(self, '_done', self._done + 1)
        local_step = self._done - warmup
        self._land(local_step)
        self._start(local_step)

    def _meet(self):
        """This update's exchange (``_meets``); False where it applies
        nothing (a broadcast).  After a load, the parameter set becomes
        the one the snapshot's ranks last agreed on (rank 0's where its
        state was given to all), so a parameter that got its data since
        joins where the uninterrupted run has it join: at this update
        where that run meets here (a second exchange), else at the next
        meeting."""
        problem = hook_problem(self.communicator)   # one added since
        if problem is not None:
            raise problem
        known = self._param_set
        step = self._next_step()
        if step is BROADCAST and known is None:   # a new target
            self.wait()
            self.communicator.bcast_data(self.target)
            self._restart()
            self._copy_if_local()
            return False
        if step is BROADCAST:
            self._adopt_appeared(known)
        if step is RESUME:
            agreed = self._make_replicas_agree()
            loaded = self._loaded_set
            object.__setattr__(self, '_loaded_set', None)
            if loaded is not None:
                object.__setattr__(self, '_param_set', loaded)
            if not agreed:
                return False
            if self._meets():   # alike on every rank: the state agrees
                return self._meet()
        return True

    def _meets(self):
        """Whether this update exchanges with the other ranks: the first
        after ``setup`` or a snapshot's load, a synchronous warm-up step
        (or one without a synced copy), or a step after which a sync
        starts.  Between syncs an update is
        the inner optimizer's alone: what every rank must agree on (the
        parameter set, the hooks, a load on some ranks only) is agreed at
        the next of these, and a difference is an error there on every
        rank.  A rank that meets where the others do not (it alone
        loaded a snapshot) waits for their next meeting, which pairs
        with its own: every meeting's first exchange is the agreement."""
        if self._param_set is None or self._param_set is LOADED:
            return True
        warmup = self._local.sync_warmup_steps
        if self._done < warmup or self._synced is None:
            return True
        return bool(schedule.starting(self._done + 1 - warmup,
                                      self._local.local_steps,
                                      self._local.fragments))

    def _adopt_appeared(self, known):
        """Parameters that got their data since the last meeting (a lazy
        link, a branch first used) on every rank: rank 0's values, joined
        to the synced copy (``SyncedCopy.add``); the rest of the state
        (synced copy, outer state, the step within H) is kept.  One that
        lost its data or went is an error on every rank."""
        comm = self.communicator
        before, now = dict(known), dict(self._param_set)
        appeared = sorted(n for n, has in now.items()
                          if has and not before.get(n))
        lost = sorted(n for n, has in before.items()
                      if has and not now.get(n))
        comm.same({'appeared': appeared, 'lost': lost},
                  'the parameters that appeared since the last sync')
        if lost:
            raise RuntimeError(
                'parameters %s lost their data or left the model during '
                'local_steps: the synced copy and the outer optimizer hold '
                'them.  Keep every parameter of the model; to change the '
                'model, set up a new multi-node optimizer on it' % lost)
        params = dict(self.target.namedparams())
        values = comm.bcast_obj({n: host(params[n].array) for n in appeared}
                                if comm.rank == 0 else None)
        for name in appeared:
            params[name].array[...] = params[name].device.send(values[name])
        if appeared and self._synced is not None:
            self._synced.add(appeared, self.target)

    def _copy_if_local(self):
        """The synced copy, made where the local phase is next and there
        is none: at the end of a meeting (the broadcast, the last warm-up
        step; a load without one: the next update meets, ``_meets``), so
        that it holds the parameters every rank has alike, and one that
        gets its data later joins at a sync (``_adopt_appeared``)."""
        if self._synced is None and \
                self._done >= self._local.sync_warmup_steps:
            # The local phase starts from the replicas' common parameters.
            object.__setattr__(self, '_synced', SyncedCopy.of(
                self.target, self._template, self._local.fragments))

    def _restart(self):
        object.__setattr__(self, '_synced', None)
        object.__setattr__(self, '_loaded_set', None)
        object.__setattr__(self, '_done', 0)
        object.__setattr__(self, '_in_flight', None)

    def _land(self, local_step):
        """The outer update of the fragment in flight, if its step."""
        flight = self._in_flight
        if flight is None or flight.apply_at != local_step:
            return
        means = flight.wait(self._blocked)
        object.__setattr__(self, '_in_flight', None)
        self._outer_update(flight.index, means)

    def _start(self, local_step):
        """The syncs due after this local step: averaged now and applied
        (no delay), or started in the background."""
        delay = self._local.fragment_sync_delay
        for index in schedule.starting(local_step, self._local.local_steps,
                                       self._local.fragments):
            if index == 0:   # before any averaging runs in the background
                self._blocked(self._synced.average_persistents,
                              self.communicator, self.target, local_step)
            named = self._synced.pseudo_gradients(self.target, index)
            if not named:
                continue   # a fragment without arrays: on every rank
            if delay == 0:
                self._blocked(self.communicator.mean_grads, named)
                self._outer_update(index, named)
                continue
            handle = self._blocked(self.communicator.mean_grads_async, named)
            object.__setattr__(self, '_in_flight', InFlight(
                index, local_step + delay, handle, named))

    def _outer_update(self, index, means):
        """Fragment ``index``'s outer update, with the hyperparameters the
        caller's outer optimizer has now (an outer lr schedule sets them
        there: each fragment's copy takes them)."""
        with self._timeline().span('update', 'compute'):
            self._synced.apply(index, means, self.target,
                               self._template.hyperparam.get_dict())

    def _compared(self):
        """Also the outer optimizer's hyperparameters, at each meeting: a
        schedule must set them alike on every rank."""
        return super(LocalStepsOptimizer, self)._compared() + (
            outer_settings(self._template),)

    # ---------------------------------------------------------- snapshots
    def _of_my_mode(self, deserializer):
        return not_a_share(deserializer)

    def _serialize_state(self, serializer):
        """Also this mode's state (``_serialize_local``).  The inner
        optimizer's state and the model's parameters are each rank's own
        between syncs: every rank's snapshot file holds its own (a
        snapshot written by rank 0 alone resumes every rank from rank 0's
        replica)."""
        self.wait()
        super(LocalStepsOptimizer, self)._serialize_state(serializer)
        self._serialize_local(serializer[SNAPSHOT_KEY])

    def _serialize_local(self, serializer):
        """The updates done since the broadcast, the settings they count
        in, the synced copy with its outer state, and the fragment in
        flight with its (finished) mean: the same on every rank, and on
        any number of ranks (means and synced values)."""
        if not isinstance(serializer, chainer.serializer.Deserializer):
            serializer('done', numpy.int64(self._done))
            serializer('settings', numpy.array(
                [self._local.local_steps, self._local.fragments,
                 self._local.sync_warmup_steps], numpy.int64))
            serializer('outer_optimizer', numpy.array(self._outer_name()))
            serializer('outer_hyperparameters', numpy.array(
                self._outer_hyperparameters()))
            serializer('fragment_sync_delay',
                       numpy.int64(self._local.fragment_sync_delay))
            serializer('has_synced', numpy.bool_(self._synced is not None))
            known = self._agreed_set()   # '1name': it had data; '0name'
            serializer('param_set', numpy.array(
                [] if known is None else ['%d%s' % (has, name)
                                          for name, has in known], str))
            if self._synced is not None:
                self._synced.save(serializer[KEY])
            flight = self._in_flight
            serializer('in_flight', numpy.array(
                [] if flight is None else [flight.index, flight.apply_at],
                numpy.int64))
            if flight is not None:
                for i, (_, mean) in enumerate(flight.means):
                    serializer['means']('m%d' % i, mean)
            return
        self._load_local(serializer)

    def _load_local(self, serializer):
        done = read(serializer, 'done')
        if done is None:   # a snapshot of another mode: start afresh
            self._restart()
            return
        # Each setting it recorded is this optimizer's (another outer
        # optimizer class's state would be dropped, a fragment in flight
        # land at another step); the outer hyperparameters (lr, momentum)
        # may change at a resume.
        saved, mine = saved_settings(serializer), settings_said(
            self._local.local_steps, self._local.fragments,
            self._local.fragment_sync_delay, self._local.sync_warmup_steps,
            self._outer_name())
        if any(s not in mine for s in saved):
            raise ValueError(
                'the snapshot was written with %s; this optimizer has %s: '
                "pass the snapshot's settings to create_multi_node_optimizer "
                'to resume it (or start afresh without loading it)'
                % (', '.join(saved), ', '.join(mine)))
        self._warn_of_other_outer_hyperparameters(
            read(serializer, 'outer_hyperparameters'))
        synced = SyncedCopy.load(serializer[KEY], self.target,
                                 self._template) \
            if bool(read(serializer, 'has_synced')) else None
        flight = None
        where = [int(v) for v in read(serializer, 'in_flight')]
        if where:
            names = synced.names(where[0])
            params = dict(self.target.namedparams())
            means = []
            for i, name in enumerate(names):
                host = numpy.asarray(serializer['means']('m%d' % i, None))
                param = params.get(name)
                device = chainer.backend.CpuDevice() if param is None or \
                    param.array is None else param.device
                means.append((name, device.send(host)))
            flight = InFlight(where[0], where[1], None, means)
        object.__setattr__(self, '_done', int(done))
        object.__setattr__(self, '_synced', synced)
        object.__setattr__(self, '_in_flight', flight)
        known = read(serializer, 'param_set')   # None: an older snapshot
        object.__setattr__(self, '_loaded_set', None if known is None or
                           not len(known) else [(str(e)[1:], str(e)[0] == '1')
                                                for e in known])

    def _outer_hyperparameters(self):
        return ', '.join('%s=%r' % kv for kv in sorted(
            self._template.hyperparam.get_dict().items()))

    def _warn_of_other_outer_hyperparameters(self, saved):
        """The outer steps go on with this optimizer's hyperparameters
        (an outer lr schedule may change them at a resume); say so where
        they are not the snapshot's, as a changed default would not."""
        mine = self._outer_hyperparameters()
        if saved is not None and str(saved) != mine:
            warnings.warn(
                'the snapshot was written with the outer optimizer at %s; '
                'this one has %s, which the outer updates use from here on '
                '(to keep the snapshot\'s, pass an outer_optimizer with '
                'them to create_multi_node_optimizer)' % (saved, mine))

    def _agreed_set(self):
        """The parameter set the ranks last agreed on (a loaded one until
        the update after the load), or None before the first update."""
        if self._loaded_set is not None:
            return self._loaded_set
        known = self._param_set
        return known if isinstance(known, list) else None

    def _outer_name(self):
        cls = type(self._template)
        return '%s.%s' % (cls.__module__, cls.__qualname__)

    def _make_replicas_agree(self):
        """After a load: the synced copy, outer state, step count,
        fragment in flight and compression counter must be the same on
        every rank (the local
        parameters and inner state are each rank's own).  Where they
        differ (a snapshot loaded on some ranks only), every rank takes
        rank 0's whole state and replica, and this update applies
        nothing, as after a broadcast.  True where nothing moved."""
        comm = self.communicator
        shared = state_of(self._serialize_shared)
        votes = comm.everyone((digest(sorted(shared.items())), self._updates),
                              'the synced parameters of local_steps')
        object.__setattr__(self, '_updates', votes[0][1])
        if all(v[0] == votes[0][0] for v in votes):
            return True
        comm.bcast_data(self.target)
        state = comm.bcast_obj(state_of(self._serialize_state)
                               if comm.rank == 0 else None)
        if comm.rank != 0:
            self._serialize_state(chainer.serializers.NpzDeserializer(
                state, strict=False))
        return False

    def _serialize_shared(self, serializer):
        """What every rank holds alike: this mode's state and the
        communicator's shared compression state (its averaging counter,
        which decides the compression's warm-up, and 'auto''s choices)."""
        self._serialize_local(serializer[SNAPSHOT_KEY])
        self.communicator.serialize_compression(
            serializer['mnopt_compression'], local=False)

