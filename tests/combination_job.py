"""One phase of the combination matrix (tests/test_combinations.py), run
under mpiexec: every case of a JSON list in turn, in this one job.

    python -m mpi4py tests/combination_job.py CASES.json PHASE OUT

PHASE ``first``: train each case from scratch (to the end for a case
without resume, else to the last snapshot).  PHASE ``second``: resume each
case from its snapshots (at this job's number of ranks) and finish, and
train the uninterrupted reference beside it where one is promised.

Rank 0 prints one ``CASE {json}`` line per case: each rank's error (or
None), what it resumed from, the digest of its parameters, the samples it
saw twice within an epoch.  The test decides; this script only observes.
"""

import contextlib
import hashlib
import json
import os
import sys
import traceback

import numpy
from mpi4py import MPI

import mnopt  # before Chainer: Chainer's NumPy 2 names
from mnopt.timeline import recorder as timelines
import chainer
import chainer.links as L

WORLD = MPI.COMM_WORLD
SNAPSHOTS = [3, 5]     # iterations a snapshot is written at
STOP = 7               # every case ends here
#: What observing a run must show: the CommunicationReport's keys in the
#: log, the timeline's phases in this rank's trace.
OBSERVED = ('comm/exposed', 'comm/hidden', 'comm/bytes_sent',
            'comm/bytes_received')
PHASES = ('step', 'forward', 'backward', 'update', 'wire')
#: observe='window': MNOPT_TIMELINE_STEPS, the job's steps (update()
#: calls over the whole run, a resume going on from its snapshot's count):
#: the window leaves out the first step and the last, and a resume at
#: SNAPSHOTS lands inside it.
WINDOW = (1, 6)
N_SAMPLES, BATCH = 48, 4   # 12 / 8 iterations an epoch at 2 / 3 ranks
#: What 'auto' tunes on each kind (naive tunes nothing: it refuses).
TUNED = {'naive': ['bucket_bytes'],
         'flat': ['bucket_bytes', 'segment_bytes'],
         'hierarchical': ['bucket_bytes', 'segment_bytes'],
         'reduction_server': ['chunk_bytes', 'window']}
MODES = {
    'sync': {},
    'double_buffering': {'double_buffering': True},
    'overlap': {'overlap': True},
    'shard_state': {'shard_state': True},
    'stage2': {'shard_state': True, 'overlap': True},
    # DiLoCo (docs/local_sgd.md): a sync every 2 inner updates; runs and
    # snapshots end mid-H or at a sync (with accumulation or without).
    'local_steps': {'local_steps': 2},
}


def dataset():
    """Samples that carry their own index (the third column)."""
    rng = numpy.random.RandomState(7)
    x = rng.standard_normal((N_SAMPLES, 8)).astype(numpy.float32)
    t = ((x[:, 0] > 0).astype(numpy.int32) + (x[:, 1] > 0)
         + (x[:, 2] > 0)).astype(numpy.int32)
    return chainer.datasets.TupleDataset(x, t, numpy.arange(N_SAMPLES))


def communicator(case, out):
    kwargs = {'allreduce_grad_dtype': case['wire']}
    if case['observe'] in ('timeline', 'window'):
        kwargs['timeline'] = os.path.join(out, 'trace.json')
    if case['compression'] not in (None, 'hook'):
        kwargs['compression'] = case['compression']
    if case['tune'] == 'auto':
        kwargs.update({name: 'auto' for name in TUNED[case['comm']]})
    if case['observe'] == 'debug':
        # Every collective checked across ranks (docs/debugging.md); read
        # when each communicator is made, split()'s included.
        os.environ['MNOPT_DEBUG'] = 'detail'
    if case['observe'] == 'window':
        # Agreed at start-up, read when the timeline opens.
        os.environ['MNOPT_TIMELINE_STEPS'] = '%d:%d' % WINDOW
    try:
        base = mnopt.create_communicator(case['comm'], **kwargs)
        made = [base]
        if case['split']:
            # The same ranks, as a communicator of the same kind made by
            # split(): it must keep every setting of the one it came from.
            made.insert(0, base.split(0, base.rank))
    finally:
        os.environ.pop('MNOPT_DEBUG', None)
        os.environ.pop('MNOPT_TIMELINE_STEPS', None)
    if case['compression'] == 'hook':
        made[0].register_comm_hook({}, topk_hook)
    return made[0], made


def topk_hook(residuals, bucket, comm):
    """A user's comm hook (docs/hooks.md's top-k, a quarter of each
    bucket sent), its residuals in the snapshots."""
    grad = bucket.buffer() + residuals.get(bucket.key(), 0)
    k = max(1, grad.size // 4)
    top = numpy.argpartition(abs(grad), grad.size - k)[-k:]
    indices, values = comm.allgather(top), comm.allgather(grad[top])
    grad[top] = 0
    residuals[bucket.key()] = grad
    total = numpy.zeros_like(grad)
    numpy.add.at(total, indices.ravel(), values.ravel())
    return total / comm.size


class Recorder(object):
    """The converter: drops the index column and records, per epoch, the
    indices this rank trained on."""

    def __init__(self, iterator):
        self.iterator, self.seen = iterator, {}

    def __call__(self, batch, device=None):
        it = self.iterator
        # next() has run: a batch that ended an epoch belongs to it, but
        # for its last current_position samples, the next epoch's first
        # (a resumed epoch's rest need not be whole batches).
        if not it.is_new_epoch:
            return self.add(it.epoch, batch, device)
        ended = len(batch) - it.current_position
        self.seen.setdefault(it.epoch, []).extend(
            int(b[2]) for b in batch[ended:])
        return self.add(it.epoch - 1, batch[:ended], device, whole=batch)

    def add(self, epoch, batch, device=None, whole=None):
        """``batch`` recorded as one of ``epoch``; ``whole`` (or
        ``batch``) as arrays."""
        self.seen.setdefault(epoch, []).extend(int(b[2]) for b in batch)
        return chainer.dataset.concat_examples(
            [b[:2] for b in (batch if whole is None else whole)], device)

    def twice(self):
        """{epoch: indices seen more than once in it}, for epochs with any."""
        out = {}
        for epoch, indices in self.seen.items():
            counts = numpy.bincount(indices, minlength=N_SAMPLES)
            if (counts > 1).any():
                out[epoch] = numpy.flatnonzero(counts > 1).tolist()
        return out


class JoinedEpochs(chainer.training.updaters.StandardUpdater):
    """data 'uneven+join': each iteration is one epoch of this rank's own
    batches, one batch fewer on each rank after the first, under
    mnopt.join (docs/uneven_inputs.md).  Its batches follow from the
    epoch alone (the iterator hands out one token per epoch), so a resume
    at any number of ranks sees the epochs an uninterrupted run sees."""

    def __init__(self, optimizer, shard, recorder, seed):
        super(JoinedEpochs, self).__init__(
            chainer.iterators.SerialIterator([0], 1, shuffle=False),
            optimizer)
        rank = optimizer.communicator.rank
        self.shard, self.recorder, self.seed = shard, recorder, seed
        self.own = len(shard) - BATCH * rank   # this rank's samples
        #: Every rank's batches (join's ``batches``) in each epoch run.
        self.batches = []

    def update_core(self):
        self.get_iterator('main').next()
        optimizer, epoch = self.get_optimizer('main'), self.iteration
        order = numpy.random.RandomState(self.seed * 100 + epoch) \
            .permutation(len(self.shard))[:self.own]
        with mnopt.join(optimizer) as joined:
            for i in range(0, len(order) - BATCH + 1, BATCH):
                x, t = self.recorder.add(epoch, [self.shard[int(j)] for j in
                                                 order[i:i + BATCH]])
                optimizer.update(optimizer.target, x, t)
        self.batches.append(joined.batches)


def join_missed(updater, size):
    """What a joined run missed: an epoch whose ranks did not hold
    BATCH fewer samples each, one after the other, as every rank says."""
    want = [(N_SAMPLES // size - BATCH * r) // BATCH for r in range(size)]
    return ['join: batches per rank %s, expected %s in every epoch'
            % (b, want) for b in updater.batches if b != want][:1]


def window_missed(path, first, calls):
    """What a run with MNOPT_TIMELINE_STEPS=WINDOW missed: steps
    recorded outside the window, or its steps (of the ``calls``
    update() calls this process made from the job's step ``first`` on,
    at least) not recorded."""
    events = timelines.load(path)
    steps = sorted(e['args']['step'] for e in events
                   if e.get('name') == 'step' and e.get('ph') == 'X')
    want = list(range(max(WINDOW[0], first),
                      min(WINDOW[1], first + calls)))
    missed = []
    if steps != want:
        missed.append('window: steps %s recorded, expected %s'
                      % (steps, want))
    if sum(e.get('name') == 'forward' for e in events) > len(steps):
        missed.append('window: a forward outside the recorded steps')
    if not any(e.get('name') == 'mnopt_window' for e in events):
        missed.append('window: the file does not say it is one')
    return missed


def averages_within(case, resumed, stop):
    """Whether the iterations after ``resumed`` up to ``stop`` average
    anything (a 'wire' in the timeline): local_steps averages only at its
    syncs, after local steps 2, 4, ... (update 1 is the broadcast; an
    update every ``accumulation`` iterations), which a short run with
    accumulation may not reach."""
    if case['mode'] != 'local_steps':
        return True
    acc, h = case['accumulation'], MODES['local_steps']['local_steps']
    return any(i % acc == 0 and i // acc > 1 and (i // acc - 1) % h == 0
               for i in range(resumed + 1, stop + 1))


def train(case, out, stop, snapshots):
    """Train ``case`` to ``stop`` with snapshots (autoloaded) in ``out``;
    returns (iteration resumed from, parameter digest, samples seen twice,
    whether the parameters moved after the resume, what observing the run
    missed: OBSERVED's keys absent from the log or phases absent from the
    timeline)."""
    comm, made = communicator(case, out)
    iterator = None
    try:
        numpy.random.seed(case['seed'])   # initial weights, orders
        model = L.Classifier(chainer.Sequential(
            L.Linear(8, 16), chainer.functions.relu, L.Linear(16, 4)))
        shuffled = case['data'] != 'plain+serial'
        joined = case['data'] == 'uneven+join'
        train_set = mnopt.scatter_dataset(dataset(), comm, shuffle=shuffled,
                                          seed=case['seed'])
        if case['data'] == 'shuffled+multiprocess':
            iterator = chainer.iterators.MultiprocessIterator(
                train_set, BATCH, shuffle=True, n_processes=1)
        else:
            iterator = chainer.iterators.SerialIterator(
                train_set, BATCH, shuffle=shuffled)
        actual = chainer.optimizers.MomentumSGD(lr=0.05)
        optimizer = mnopt.create_multi_node_optimizer(
            actual, comm, accumulation_steps=case['accumulation'],
            **MODES[case['mode']])
        optimizer.setup(model)
        recorder = Recorder(iterator)
        updater = JoinedEpochs(optimizer, train_set, recorder,
                               case['seed']) if joined else \
            chainer.training.StandardUpdater(iterator, optimizer,
                                             converter=recorder)
        trainer = chainer.training.Trainer(updater, (stop, 'iteration'),
                                           out=out)
        if snapshots:
            # ChainerMN's default, one replica set, writes rank 0's file
            # only (its iterator stands for every rank's); a set per rank
            # keeps every rank's own iterator.
            # 'one+async': written in the background.
            sets = [[r] for r in range(comm.size)] \
                if case['sets'] == 'per_rank' else []
            snap = mnopt.extensions.multi_node_snapshot(
                comm, chainer.training.extensions.snapshot(autoload=True),
                sets, asynchronous=case['sets'] == 'one+async')
            trainer.extend(snap, trigger=chainer.training.triggers.
                           ManualScheduleTrigger(snapshots, 'iteration'))
            snap.initialize(trainer)   # the autoload (run() does it again)
        if case['observe'] == 'report':
            trainer.extend(mnopt.extensions.CommunicationReport(comm))
            log = chainer.training.extensions.LogReport(
                trigger=(1, 'iteration'), filename=None)
            trainer.extend(log)
        resumed = trainer.updater.iteration
        # The job's step the window counts from (the snapshot's count of
        # update() calls, restored by the autoload; 0 without one).
        first_step = getattr(optimizer, '_updates', 0)
        before = [p.array.copy() for _, p in sorted(model.namedparams())]
        trainer.run()
        after = [p.array for _, p in sorted(model.namedparams())]
        moved = any((a != b).any() for a, b in zip(after, before))
        # local_steps: the replicas differ between syncs by design; the
        # synced parameters (what a user evaluates) must agree.
        with getattr(optimizer, 'using_synced_parameters',
                     contextlib.nullcontext)():
            after = [p.array.copy() for _, p in sorted(model.namedparams())]
        digest = hashlib.sha1(b''.join(a.tobytes() for a in after))
        missed = []
        if case['observe'] == 'report' and resumed < stop:
            missed = sorted(set(OBSERVED) - set(log.log[-1]))
        if case['mode'] in ('shard_state', 'stage2') and not any(
                len(ranks) > 1 for ranks in optimizer.owners.values()):
            missed += ['ZeRO: no parameter spans ranks']
        if case['observe'] == 'debug' and comm.check_calls is None:
            missed = ['MNOPT_DEBUG=detail: no check']
        if joined:
            missed += join_missed(updater, comm.size)
            # Each epoch's update() calls: the batches of the rank with
            # the most (every rank takes part in each), at least.
            calls = sum(max(b) for b in updater.batches)
        else:
            calls = stop - resumed
    finally:
        if isinstance(iterator, chainer.iterators.MultiprocessIterator):
            iterator.finalize()
        for c in made:
            c.finalize()
    if case['observe'] == 'timeline' and resumed < stop:
        # Complete once the communicators are finalized.
        path = timelines.trace_path(os.path.join(out, 'trace.json'),
                                         WORLD.rank)
        names = {e.get('name') for e in timelines.load(path)}
        expected = set(PHASES)
        if not averages_within(case, resumed, stop):
            expected.discard('wire')
        missed += sorted(expected - names)
    if case['observe'] == 'window' and resumed < stop:
        missed += window_missed(timelines.trace_path(
            os.path.join(out, 'trace.json'), WORLD.rank), first_step, calls)
    return resumed, digest.hexdigest(), recorder.twice(), moved, missed


def run_case(case, phase, root):
    here = os.path.join(root, case['id'])
    report = {'id': case['id'], 'phase': phase, 'size': WORLD.size}
    if phase == 'first':
        if case['resume'] == 'none':
            report['run'] = train(case, os.path.join(here, 'run'), STOP, [])
        else:
            report['run'] = train(case, os.path.join(here, 'run'),
                                  SNAPSHOTS[-1], SNAPSHOTS)
            if case['resume'] == 'stale':
                # Another write of the same snapshots, whose file the test
                # puts among the first write's.
                report['other'] = train(case, os.path.join(here, 'other'),
                                        SNAPSHOTS[-1], SNAPSHOTS)
    else:
        report['run'] = train(case, os.path.join(here, 'run'), STOP,
                              SNAPSHOTS)
        if case['resume'] in ('same', 'lost', 'stale'):
            # Uninterrupted, but writing the same snapshots: saving an
            # iterator is part of the run (Chainer's MultiprocessIterator
            # drops its prefetched batches, and redraws, when saved).
            report['reference'] = train(case, os.path.join(here, 'ref'),
                                        STOP, SNAPSHOTS)
    return report


def main():
    cases_path, phase, root = sys.argv[1:4]
    with open(cases_path) as f:
        cases = json.load(f)
    for case in cases:
        try:
            report, error = run_case(case, phase, root), None
        except Exception as e:
            report = {'id': case['id'], 'phase': phase}
            error = '%s: %s' % (type(e).__name__, e)
            if os.environ.get('COMBINATION_TRACEBACKS'):
                traceback.print_exc()
        reports = WORLD.allgather((report, error))
        if WORLD.rank == 0:
            print('CASE ' + json.dumps({
                'id': case['id'], 'phase': phase,
                'errors': [e for _, e in reports],
                'ranks': [r for r, _ in reports]}), flush=True)


if __name__ == '__main__':
    main()
