"""The timeline of a training run (create_communicator(timeline=...) or
$MNOPT_TIMELINE), in every mode: the trace of each rank is valid
trace-event JSON holding each step's phases, its 'wire' spans carry the
collective's seq and bytes, and the report's analysis reads it.  Off, no
file is written.  Every mode on every CPU communicator (reduction_server
with its colocated servers, whose threads record as 'server'): the
phases, each bucket's 'wire', ZeRO's all-gather.  Runs serially (the
averaging run at one rank: MNOPT_SINGLE_RANK_AVERAGING=1) and under
mpiexec -n 2 and -n 3 (marked many_ranks)."""

import glob
import os

import numpy
import pytest

chainer = pytest.importorskip(
    'chainer', reason='the Chainer layer (the numpy1 and numpy2 stacks run it)')
import chainer.functions as F  # NOQA
import chainer.links as L  # NOQA

import mnopt  # NOQA
from conftest import WORLD, naive_comm, shared_directory  # NOQA
from mnopt.timeline import recorder as timeline  # NOQA
from mnopt.report import trace_analysis

STEPS = 3
STEP_PHASES = {'step', 'forward', 'backward', 'update'}
AVERAGING_PHASES = {'pack', 'wire', 'unpack'}

#: mode: (create_communicator's keywords, create_multi_node_optimizer's,
#: the phases its trace must hold beyond the step's).
MODES = {
    'sync': ({}, {}, AVERAGING_PHASES | {'wait'}),
    'double_buffering': ({}, {'double_buffering': True},
                         AVERAGING_PHASES),
    'overlap': ({}, {'overlap': True}, AVERAGING_PHASES),
    'sign': ({'compression': 'sign'}, {}, AVERAGING_PHASES | {'wait'}),
    # Two averagings per step (the Ps, then the Qs), each packed and sent.
    'powersgd': ({'compression': 'powersgd'}, {},
                 AVERAGING_PHASES | {'wait'}),
    'zero': ({}, {'shard_state': True}, {'wire'}),
    'stage2': ({}, {'shard_state': True, 'overlap': True}, {'wire'}),
}
COMMUNICATORS = ('naive', 'flat', 'hierarchical', 'reduction_server')
#: Small buckets: the flat communicator's Allreduce moves several a step.
BUCKET_BYTES = 256


class Net(chainer.Chain):
    def __init__(self):
        super(Net, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(8, 16)
            self.l2 = L.Linear(16, 4)

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.l2(F.relu(self.l1(x))), t)


@pytest.fixture
def directory(naive_comm):
    """A directory every rank shares (each writes its own file there)."""
    with shared_directory(naive_comm, 'mnopt-timeline-') as path:
        yield path


@pytest.fixture(autouse=True)
def averaging_at_one_rank(monkeypatch):
    # Serially, the whole averaging path runs (else it moves nothing).
    monkeypatch.setenv('MNOPT_SINGLE_RANK_AVERAGING', '1')
    monkeypatch.delenv(timeline.ENV, raising=False)


def train(comm_options, optimizer_options, name='flat', **timeline_option):
    comm = mnopt.create_communicator(name, **dict(comm_options,
                                                  **timeline_option))
    try:
        model = Net()
        optimizer = mnopt.create_multi_node_optimizer(
            chainer.optimizers.SGD(lr=0.1), comm, **optimizer_options)
        optimizer.setup(model)
        rng = numpy.random.RandomState(comm.rank)
        for _ in range(STEPS + 1):   # the first update broadcasts
            x = rng.standard_normal((5, 8)).astype(numpy.float32)
            t = rng.randint(0, 4, 5).astype(numpy.int32)
            optimizer.update(model, x, t)
        if optimizer_options.get('double_buffering'):
            optimizer.wait()
        return comm.timeline
    finally:
        comm.finalize()


def validate(events):
    """The trace-event format's rules Perfetto relies on: every event has
    ph/ts/pid/tid/name, a complete one a dur >= 0, and every process and
    thread that records is named by metadata."""
    named, seen = set(), set()
    for ev in events:
        for key in ('ph', 'ts', 'pid', 'tid', 'name'):
            assert key in ev, (key, ev)
        assert isinstance(ev['pid'], int) and isinstance(ev['tid'], int)
        assert isinstance(ev['ts'], (int, float)), ev
        if ev['ph'] == 'X':
            assert ev['dur'] >= 0, ev
        if ev['ph'] == 'M':
            assert isinstance(ev['args'], dict), ev
            if ev['name'] in ('process_name', 'thread_name'):
                assert ev['args']['name'], ev
                named.add((ev['pid'], ev['tid'] if ev['name'] ==
                           'thread_name' else None))
        elif ev['ph'] != 'C':
            seen.add((ev['pid'], ev['tid']))
    assert {(pid, None) for pid, _ in seen} <= named, (seen, named)
    assert seen <= named, seen - named


@pytest.mark.parametrize('mode', sorted(MODES))
def test_every_phase_of_every_mode_is_in_the_trace(mode, directory):
    comm_options, optimizer_options, phases = MODES[mode]
    if True:
        template = os.path.join(directory, 'trace.json')
        tl = train(comm_options, optimizer_options, timeline=template)
        assert not tl, 'finalize closes the timeline'
        path = timeline.trace_path(template, WORLD.rank)
        assert tl.path == path
        with open(path) as f:
            assert f.read().rstrip().endswith(']'), 'closed: complete'
        events = timeline.load(path)
        validate(events)
        spans = [e for e in events if e['ph'] == 'X']
        names = {e['name'] for e in spans}
        assert STEP_PHASES | phases <= names, sorted(names)
        main = {e['name'] for e in spans if e['tid'] == 0}
        assert STEP_PHASES <= main
        assert len([e for e in spans if e['name'] == 'step']) == STEPS + 1
        wires = [e for e in spans if e['name'] == 'wire']
        for wire in wires:
            # ZeRO's all-gather: its own count, not the averagings' seq.
            key = 'gather' if wire['args']['op'] == 'allgather' else 'seq'
            assert isinstance(wire['args'][key], int), wire
            assert wire['args']['bytes'] >= 0, wire
            assert wire['args']['comm'].startswith('flat#'), wire
        assert sum(w['args']['bytes'] for w in wires) > 0
        seqs = [(w['args'].get('seq'), w['args'].get('gather'),
                 w['args'].get('bucket')) for w in wires]
        assert len(seqs) == len(set(seqs)), 'one seq per collective'
        if optimizer_options.get('double_buffering') or \
                optimizer_options.get('overlap'):
            threads = {e['args']['name'] for e in events
                       if e['name'] == 'thread_name'}
            assert 'averaging' in threads
            assert {e['name'] for e in spans if e['tid'] != 0} \
                >= phases - {'wait'}
        # Every rank's file is written: the report reads them together.
        WORLD.Barrier()
        paths = sorted(glob.glob(os.path.join(directory, 'trace.rank*.json')))
        assert len(paths) == WORLD.size
        report = trace_analysis.analyze(paths)
        overall = report['overall']
        assert overall and overall['steps'] > 0, report
        assert report['collectives']['count'] >= 1
        WORLD.Barrier()


def test_the_environment_variable_turns_it_on(monkeypatch, directory):
    if True:
        monkeypatch.setenv(timeline.ENV, os.path.join(directory, 't.json'))
        tl = train({}, {})
        assert tl.path == os.path.join(directory, 't.rank%d.json'
                                       % WORLD.rank)
        names = {e['name'] for e in timeline.load(tl.path)}
        assert {'step', 'wire', 'wait'} <= names
        WORLD.Barrier()


def test_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert train({}, {}) is timeline.NULL
    assert os.listdir(str(tmp_path)) == []


def test_a_split_shares_its_parents_timeline(directory):
    if True:
        comm = mnopt.create_communicator(
            'flat', timeline=os.path.join(directory, 'trace.json'))
        sub = comm.split(WORLD.rank % 2, WORLD.rank)
        assert sub.timeline is comm.timeline
        assert sub.timeline_name != comm.timeline_name
        grads = [('/g', numpy.ones(4, numpy.float32))]
        sub.mean_grads(grads)
        sub.finalize()
        assert comm.timeline, 'the parent still holds it'
        comm.mean_grads(grads)
        tl = comm.timeline
        comm.finalize()
        assert not tl
        wires = [e for e in timeline.load(tl.path) if e['name'] == 'wire']
        assert {w['args']['comm'] for w in wires} == {
            comm.timeline_name, sub.timeline_name}
        WORLD.Barrier()


@pytest.mark.parametrize('value', ['', 3, b'x.json'])
def test_a_timeline_that_is_not_a_path_is_refused(value):
    with pytest.raises(ValueError, match='timeline must be a path'):
        mnopt.create_communicator('flat', timeline=value,
                                  abort_on_exception=False)


def _phases_by_thread(events):
    names = {(e['tid']): e['args']['name'] for e in events
             if e['ph'] == 'M' and e['name'] == 'thread_name'}
    out = {}
    for e in events:
        if e['ph'] == 'X':
            out.setdefault(names.get(e['tid']), set()).add(e['name'])
    return out


@pytest.mark.many_ranks
@pytest.mark.parametrize('name', COMMUNICATORS)
@pytest.mark.parametrize('mode', sorted(MODES))
def test_every_mode_of_every_communicator_records_its_phases(mode, name,
                                                             directory):
    comm_options, optimizer_options, phases = MODES[mode]
    sharded = optimizer_options.get('shard_state')
    if name == 'reduction_server' and sharded:
        pytest.skip('reduction_server has no sharded path (docs/limits.md)')
    template = os.path.join(directory, 'trace.json')
    tl = train(dict(comm_options, bucket_bytes=BUCKET_BYTES),
               optimizer_options, name, timeline=template)
    events = timeline.load(tl.path)
    validate(events)
    by_thread = _phases_by_thread(events)
    recorded = set().union(*by_thread.values())
    assert STEP_PHASES <= by_thread['main'], by_thread
    assert 'wire' in recorded, by_thread
    if not sharded:
        assert recorded & {'pack', 'cast'} and 'unpack' in recorded, \
            by_thread
    wires = [e for e in events if e['ph'] == 'X' and e['name'] == 'wire'
             and 'op' in e['args'] and e['args']['op'] not in ('recv',
                                                               'send')]
    for w in wires:
        assert w['args']['comm'].startswith(name + '#'), w
        assert ('seq' in w['args']) != ('gather' in w['args']), w
        assert w['args']['bytes'] >= 0 and 'arrived' in w['args'], w
        assert w['args']['arrived'] <= w['ts'] + 1e-3, w
    buckets = {}
    for w in wires:
        if 'seq' in w['args'] and 'bucket' in w['args']:
            buckets.setdefault(w['args']['seq'], set()).add(
                w['args']['bucket'])
    if name in ('naive', 'flat') and mode not in ('sign', 'powersgd') \
            and not sharded:
        # Per array (naive), per 256-byte bucket (flat's Allreduce): the
        # first layer's weights alone are 512 bytes.
        assert buckets and max(len(b) for b in buckets.values()) >= 2, \
            wires
    gathers = [w for w in wires if w['args']['op'] == 'allgather']
    if sharded and WORLD.size > 1:
        assert gathers and all('gather' in w['args'] for w in gathers)
    if name == 'reduction_server':
        server = by_thread.get('server', set())
        assert {'sum', 'wire'} <= server, by_thread
        ops = {e['args']['op'] for e in events if e['ph'] == 'X'
               and e['name'] == 'wire' and e['tid'] in {
                   m['tid'] for m in events if m['ph'] == 'M' and
                   m['name'] == 'thread_name' and
                   m['args']['name'] == 'server'}}
        assert ops == {'recv', 'send'}, ops
    WORLD.Barrier()
    paths = sorted(glob.glob(os.path.join(directory, 'trace.rank*.json')))
    report = trace_analysis.analyze(paths)
    assert report['overall']['steps'] > 0
    if WORLD.size > 1:
        assert report['collectives']['matched'] >= 1
    WORLD.Barrier()
