"""Settings and start-up: a split keeps every setting; every setting is
checked before the first collective; the settings every rank must share
are compared at start-up, naming the setting and the ranks.  Runs serially
and under mpiexec -n 2/3 (the spawned job: serially)."""

import inspect
import os
import shutil
import tempfile

import numpy
import pytest
from mpi4py import MPI

import mnopt
from mnopt import communicators
from conftest import run_mpi

# Also under mpiexec -n 3: a middle rank disagrees.
pytestmark = pytest.mark.many_ranks

WORLD = MPI.COMM_WORLD

#: Where the split test's timelines go (each rank's own directory: the
#: setting is not shared), removed after the module.
TRACES = tempfile.mkdtemp(prefix='mnopt-settings-timeline-')

#: A value other than the default for every keyword a communicator takes.
#: A keyword missing here fails test_every_keyword_is_known: add it, and
#: the split test checks it too.
NON_DEFAULT = {
    'allreduce_grad_dtype': 'float64', 'bucket_bytes': 4096,
    'segment_bytes': 65536,
    'compression': 'sign', 'error_feedback': False, 'warmup_steps': 3,
    'vote': 'alltoall', 'stall_warning': 45.0, 'timeout': 450.0,
    'on_overflow': 'ignore', 'batched_copy': False,
    # reduction_server's own
    'chunk_bytes': 1024, 'window': 2, 'server_memory': 1 << 20,
    'stats': True,
    'timeline': os.path.join(TRACES, 'trace.json'),
}
#: PowerSGD's, which sign compression refuses: their own split test.
LOW_RANK_NON_DEFAULT = {'compression': 'powersgd', 'powersgd_rank': 3,
                        'min_compression_rate': 4.0, 'warm_start': False,
                        'warmup_steps': 2, 'error_feedback': False}
#: create_communicator's keywords that say how to create, not what.
CREATION_ONLY = ('communicator_name', 'mpi_comm', 'abort_on_exception')
KINDS = ('naive', 'flat', 'hierarchical', 'reduction_server')


@pytest.fixture(scope='module', autouse=True)
def remove_traces():
    yield
    shutil.rmtree(TRACES, ignore_errors=True)


def keywords(function):
    return [name for name, p in inspect.signature(function).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and name not in ('self', 'cls') + CREATION_ONLY]


def class_keywords(cls):
    """Every keyword of the class's check_arguments, and its bases'."""
    names = []
    for klass in cls.__mro__:
        if 'check_arguments' in vars(klass):
            names += keywords(vars(klass)['check_arguments'].__func__)
    return set(names)


def non_default(name):
    settings = {k: v for k, v in NON_DEFAULT.items()
                if k in class_keywords(communicators.communicator_class(name))
                or k in keywords(communicators.create_communicator)}
    if name == 'reduction_server':
        del settings['vote']   # it votes on its servers
        del settings['segment_bytes']   # no ring: refused
    return settings


@pytest.mark.parametrize('name', KINDS)
def test_every_keyword_is_known(name):
    cls = communicators.communicator_class(name)
    unknown = (class_keywords(cls) | set(keywords(
        communicators.create_communicator))) - set(NON_DEFAULT) - \
        set(LOW_RANK_NON_DEFAULT)
    assert not unknown, 'add a non-default value to NON_DEFAULT'


@pytest.mark.parametrize('name', KINDS)
def test_a_split_keeps_the_powersgd_settings(name):
    comm = mnopt.create_communicator(name, **LOW_RANK_NON_DEFAULT)
    sub = comm.split(comm.rank % 2, comm.rank)
    try:
        for key, value in LOW_RANK_NON_DEFAULT.items():
            assert comm.settings[key] == value, key
            assert sub.settings[key] == value, key
        # What they do, on the split one: the state it makes.
        grads = [('/w', numpy.ones((40, 30), numpy.float32)),
                 ('/v', numpy.ones((12, 10), numpy.float32))]
        for _ in range(3):   # the third is compressed (warmup_steps=2)
            sub.mean_grads(grads)
        (state,) = sub.averaging.low_rank.states.values()
        assert (state.rank, state.min_compression_rate, state.warm_start,
                state.use_error_feedback) == (3, 4.0, False, False)
        # 12 x 10 at rank 3: 120 elements, 66 in its factors, under 4x
        assert [e.rank for e in state.plan] == [3, 0]
    finally:
        sub.finalize()
        comm.finalize()


@pytest.mark.parametrize('name', KINDS)
def test_a_split_keeps_every_setting(name):
    given = non_default(name)
    comm = mnopt.create_communicator(name, **given)
    sub = comm.split(comm.rank % 2, comm.rank)
    try:
        assert type(sub) is type(comm)
        for key in (class_keywords(type(comm)) | set(keywords(
                communicators.create_communicator))):
            assert key in comm.settings, key
            assert sub.settings[key] == comm.settings[key], key
        for key, value in given.items():
            assert comm.settings[key] == value, key
        # What the settings do, on the split one.
        assert (sub.compression, sub.error_feedback, sub.warmup_steps,
                sub.allreduce_grad_dtype, sub.bucket_bytes) == (
            'sign', False, 3, 'float64', 4096)
        assert sub.get_config('batched_copy') is False
        if name == 'reduction_server':
            assert sub.stats is not None
        else:
            assert sub.vote == 'alltoall'
    finally:
        sub.finalize()
        comm.finalize()


def test_a_split_keeps_a_wire_set_later():
    comm = mnopt.create_communicator('flat')
    comm.set_config('allreduce_grad_dtype', numpy.float16)
    sub = comm.split(0, comm.rank)
    try:
        assert sub.allreduce_grad_dtype == 'float16'
    finally:
        sub.finalize()
        comm.finalize()


@pytest.mark.parametrize('name', ['flat', 'reduction_server'])
def test_a_split_sign_compressed_communicator_votes(name):
    comm = mnopt.create_communicator(name, compression='sign',
                                     error_feedback=False)
    sub = comm.split(comm.rank % 2, comm.rank)
    try:
        pattern = numpy.array([1, -1, 2, -2], numpy.float32)
        grads = [('/g', pattern * (comm.rank + 1))]
        sub.mean_grads(grads)
        peers = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
        # every rank's signs agree: the majority is the pattern's sign,
        # times the mean of the scales mean(|g|) = 1.5 (r + 1)
        scale = numpy.mean([1.5 * (r + 1) for r in peers])
        numpy.testing.assert_allclose(grads[0][1],
                                      numpy.sign(pattern) * scale, rtol=1e-6)
    finally:
        sub.finalize()
        comm.finalize()


def needs_two_ranks():
    if WORLD.size == 1:
        pytest.skip('a disagreement needs two ranks (the spawned job below '
                    'runs it serially)')


def test_bucket_bytes_that_differ_are_an_error_on_every_rank():
    needs_two_ranks()
    with pytest.raises(ValueError, match=r'bucket_bytes \(rank 0: 4096, '
                                         r'rank 1: 8192'):
        mnopt.create_communicator(
            'flat', bucket_bytes=4096 if WORLD.rank == 0 else 8192)


def test_an_algorithm_that_differs_is_an_error_on_every_rank(monkeypatch):
    needs_two_ranks()
    monkeypatch.setenv('MNOPT_ALLREDUCE', 'ring' if WORLD.rank else 'mpi')
    with pytest.raises(ValueError, match=r"MNOPT_ALLREDUCE \(rank 0: 'mpi', "
                                         r"rank 1: 'ring'"):
        mnopt.create_communicator('flat')


def test_settings_of_ones_own_may_differ(monkeypatch):
    if WORLD.rank % 2:
        monkeypatch.setenv('MNOPT_BLAS_THREADS', '0')  # the library's own
    comm = mnopt.create_communicator('reduction_server', window=1 + WORLD.rank,
                                     stall_warning=30 + WORLD.rank)
    try:
        grads = [('/g', numpy.full(5, WORLD.rank, numpy.float32))]
        comm.mean_grads(grads)
        numpy.testing.assert_allclose(grads[0][1], (WORLD.size - 1) / 2.0)
    finally:
        comm.finalize()


# Each rank's lines are gathered and printed by rank 0: lines two ranks
# print at once can run into each other in mpiexec's output.
PER_RANK_SETTINGS = '''
import os, sys
from mpi4py import MPI
import mnopt
rank = MPI.COMM_WORLD.rank
said = []
cases = [('MNOPT_BLAS_THREADS', 'two'), ('MNOPT_RANKS_PER_NODE', 'x'),
         ('MNOPT_ALLREDUCE', 'mpi'), ('MNOPT_RANKS_PER_NODE', '1')]
for name, value in cases:
    if rank == 1:
        os.environ[name] = value
    try:
        comm = mnopt.create_communicator('hierarchical')
        said.append('rank %d %s=%s: no error' % (rank, name, value))
    except Exception as e:
        said.append('rank %d %s=%s: %s: %s' % (rank, name, value,
                                               type(e).__name__, e))
    os.environ.pop(name, None)
try:
    mnopt.create_communicator('flat', bucket_bytes=4096 << rank)
except ValueError as e:
    said.append('rank %d bucket_bytes: %s' % (rank, e))
said.append('rank %d done' % rank)
everyone = MPI.COMM_WORLD.gather(said)
if rank == 0:
    print('\\n'.join(line for lines in everyone for line in lines),
          flush=True)
'''


@pytest.mark.spawn
def test_a_setting_one_rank_gets_wrong_is_an_error_on_every_rank():
    proc = run_mpi(2, PER_RANK_SETTINGS, timeout=90,
                   env={'MNOPT_TIMEOUT': '0', 'MNOPT_STALL_WARNING': '0'})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for rank in (0, 1):
        assert 'rank %d done' % rank in lines
        assert 'rank %d bucket_bytes: ranks disagree on the settings of ' \
            "create_communicator('flat'): bucket_bytes (rank 0: 4096, " \
            'rank 1: 8192)' % rank in lines
        said = dict(line.split(': ', 1) for line in lines
                    if line.startswith('rank %d MNOPT' % rank))
        # the bad value: that rank's own error, the other's names it
        for case in ('MNOPT_BLAS_THREADS=two', 'MNOPT_RANKS_PER_NODE=x'):
            assert case.split('=')[0] in said['rank %d %s' % (rank, case)]
            assert said['rank %d %s' % (rank, case)].startswith(
                'ValueError' if rank == 1 else 'RuntimeError: create_')
        # good values that differ: the same ValueError on both ranks
        for case, value in (('MNOPT_ALLREDUCE=mpi', "'auto', rank 1: 'mpi'"),
                            ('MNOPT_RANKS_PER_NODE=1',
                             "not set, rank 1: 1")):
            message = said['rank %d %s' % (rank, case)]
            assert message.startswith('ValueError: ranks disagree'), message
            assert '%s (rank 0: %s)' % (case.split('=')[0], value) \
                in message, message


def test_a_timeline_one_rank_cannot_write_is_an_error_on_every_rank(
        tmp_path):
    """The last rank's timeline path runs through a file: every rank gets
    the error (that rank a ValueError, the others a RuntimeError naming
    it), none hangs; the file is opened before the start-up exchange."""
    blocker = tmp_path / 'a_file'
    blocker.write_text('')
    last = MPI.COMM_WORLD.rank == MPI.COMM_WORLD.size - 1
    path = str(blocker / 't.json') if last else str(tmp_path / 't.json')
    with pytest.raises(ValueError if last else RuntimeError) as error:
        mnopt.create_communicator('flat', timeline=path)
    assert 'the timeline file cannot be written' in str(error.value)
    assert 'a_file' in str(error.value)   # the last rank's path


# ------------------------------------------------- create_multi_node_optimizer
# Its keywords and the wrapped optimizer are compared in one exchange when
# it is made: a mix of modes would otherwise hang at the second update (a
# double-buffered rank's mean_grads_async against another's mean_grads)
# and hyperparameters that differ would let the replicas drift apart.

def optimizer_disagreement(comm, optimizer, **keywords):
    """The ValueError create_multi_node_optimizer raises, as a string,
    after which the communicator still averages (every rank left the
    exchange together)."""
    with pytest.raises(ValueError) as error:
        mnopt.create_multi_node_optimizer(optimizer, comm, **keywords)
    grads = [('/g', numpy.full(3, WORLD.rank, numpy.float32))]
    comm.mean_grads(grads)
    numpy.testing.assert_allclose(grads[0][1], (WORLD.size - 1) / 2.0)
    return str(error.value)


@pytest.mark.parametrize('keyword', ['double_buffering', 'overlap',
                                     'shard_state', 'zero_fill'])
def test_an_optimizer_keyword_that_differs_is_an_error_on_every_rank(
        naive_comm, keyword):
    needs_two_ranks()
    chainer = pytest.importorskip('chainer')
    said = optimizer_disagreement(naive_comm, chainer.optimizers.SGD(),
                                  **{keyword: WORLD.rank == 0})
    assert said.startswith('ranks disagree on create_multi_node_optimizer: '
                           '%s (rank 0: True, rank 1: False' % keyword), said
    assert said.count('rank 0:') == 1, said   # that keyword alone
    assert said.endswith('every rank must pass the same (see '
                         'docs/settings.md)'), said


def test_an_optimizer_of_another_class_or_rate_is_an_error_on_every_rank(
        naive_comm):
    needs_two_ranks()
    chainer = pytest.importorskip('chainer')
    said = optimizer_disagreement(
        naive_comm, chainer.optimizers.SGD(lr=0.1 * (1 + WORLD.rank)))
    assert 'actual_optimizer.lr (rank 0: 0.1, rank 1: 0.2' in said, said
    said = optimizer_disagreement(
        naive_comm, chainer.optimizers.MomentumSGD() if WORLD.rank else
        chainer.optimizers.SGD())
    assert ("actual_optimizer (rank 0: 'chainer.optimizers.sgd.SGD', "
            "rank 1: 'chainer.optimizers.momentum_sgd.MomentumSGD'") \
        in said, said
    assert 'actual_optimizer.momentum (rank 0: not set, rank 1: 0.9' \
        in said, said


def test_an_optimizer_one_rank_gets_wrong_is_an_error_on_every_rank(
        naive_comm):
    """That rank's own TypeError; a RuntimeError naming it on the
    others, none waiting for the rest."""
    needs_two_ranks()
    chainer = pytest.importorskip('chainer')
    wrong = WORLD.rank == 1
    with pytest.raises(TypeError if wrong else RuntimeError) as error:
        mnopt.create_multi_node_optimizer(
            chainer.optimizers.SGD if wrong else chainer.optimizers.SGD(),
            naive_comm)
    assert 'not the class SGD' in str(error.value)
    if not wrong:
        assert str(error.value).startswith(
            'create_multi_node_optimizer failed on rank 1: TypeError: ')


def test_equal_optimizer_settings_make_an_optimizer(naive_comm):
    """NaN, which is not equal to itself, is the same rate on two ranks."""
    chainer = pytest.importorskip('chainer')
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(lr=float('nan')), naive_comm,
        double_buffering=True)
    assert type(opt).__name__ == 'DoubleBufferingOptimizer'


def test_an_optimizer_hook_on_one_rank_before_wrapping_is_an_error(
        naive_comm):
    """A hook added to the set-up optimizer before wrapping: compared in
    create_multi_node_optimizer's one exchange, its setting too."""
    needs_two_ranks()
    chainer = pytest.importorskip('chainer')
    optimizer = chainer.optimizers.SGD().setup(chainer.links.Linear(2, 2))
    optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(
        0.5 if WORLD.rank == 1 else 0.25))
    said = optimizer_disagreement(naive_comm, optimizer)
    assert "optimizer hooks (rank 0: 'WeightDecay: WeightDecay(rate=0.25)'" \
        ", rank 1: 'WeightDecay: WeightDecay(rate=0.5)'" in said, said


@pytest.mark.parametrize('mode', [{}, {'double_buffering': True},
                                  {'overlap': True}, {'shard_state': True}],
                         ids=['plain', 'double_buffering', 'overlap',
                              'shard_state'])
def test_an_optimizer_hook_on_one_rank_after_wrapping_is_an_error(
        naive_comm, mode):
    """ChainerMN's order (wrap, setup, add_hook): the hooks are compared
    in the first update's own exchange, an error on every rank naming
    each rank's hooks; then the averaging goes on."""
    needs_two_ranks()
    chainer = pytest.importorskip('chainer')
    model = chainer.links.Linear(3, 2)
    optimizer = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(), naive_comm, **mode).setup(model)
    if WORLD.rank == 1:
        optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(0.5))
    x = numpy.ones((1, 3), numpy.float32)
    with pytest.raises(ValueError) as error:
        optimizer.update(lambda: chainer.functions.sum(model(x)))
    said = str(error.value)
    assert said.startswith('the optimizer hooks differ across ranks (rank '
                           '0: none; rank 1: WeightDecay: WeightDecay('
                           'rate=0.5)'), said
    assert 'add the same hooks with the same settings on every rank' in said
    grads = [('/g', numpy.full(3, WORLD.rank, numpy.float32))]
    naive_comm.mean_grads(grads)
    numpy.testing.assert_allclose(grads[0][1], (WORLD.size - 1) / 2.0)
