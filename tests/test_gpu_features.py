"""What users reach for, with CuPy arrays on a real GPU: gradient
accumulation (every training mode), ``mnopt.join`` with uneven inputs,
comm hooks, the debug mode (``MNOPT_DEBUG=detail``) and the in-job tuner
on ``hierarchical``.  Each runs the same steps with NumPy and with CuPy
gradients and asks for the same bits.

The model is linear in its parameters (loss = sum of p * c), so every
gradient is the constant c exactly on either device: whatever differs is
mnopt's, not cuDNN's or cuBLAS's.  SGD's rate is a power of two, so its
update rounds once on either device.

Run as tests/test_gpu.py is (benchmarks/gpu_check.sh: serially and under
``mpiexec -n 2``/``-n 3``, the ranks sharing one GPU; without a GPU they
skip, and ``MNOPT_REQUIRE_GPU=1`` turns the skip into a failure).
"""

import numpy
import pytest

import mnopt
from mnopt.communicators import comm_hooks
from mnopt.transport import collective_check
from conftest import WORLD, chainer, needs_chainer
from test_gpu import same_bits

needs_ranks = pytest.mark.skipif(
    WORLD.size < 2, reason='needs two ranks (mpiexec -n 2): the gpu_check '
                           'ranks stage runs it')

CPU_KINDS = ('naive', 'flat', 'hierarchical', 'hierarchical-2-per-node')
SHAPES = [(3, 5), (700,), (40, 33), (7,), (2500,)]
LR = 0.5
STEPS = 5


@pytest.fixture(params=CPU_KINDS)
def kind(request, monkeypatch, cupy):
    name = request.param
    if name == 'hierarchical-2-per-node':
        monkeypatch.setenv('MNOPT_RANKS_PER_NODE', '2')
        name = 'hierarchical'
    return name


def constants(step, rank, xp):
    """This rank's gradients at ``step``: the c of loss = sum(p * c)."""
    rng = numpy.random.RandomState(1000 * step + rank)
    return [xp.asarray(rng.standard_normal(s).astype(numpy.float32))
            for s in SHAPES]


def linear_model(xp):
    model = chainer.Chain()
    with model.init_scope():
        for i, shape in enumerate(SHAPES):
            setattr(model, 'p%d' % i, chainer.Parameter(
                numpy.full(shape, 0.25 * i, numpy.float32)))
    if xp is not numpy:
        model.to_gpu()
    return model


def loss_of(model, cs):
    import chainer.functions as F
    params = [getattr(model, 'p%d' % i) for i in range(len(SHAPES))]
    return sum(F.sum(p * c) for p, c in zip(params, cs))


def host_params(model):
    return {n: chainer.backends.cuda.to_cpu(p.array)
            for n, p in model.namedparams()}


def train(xp, name, updates=STEPS, settings=None, hook=None, **options):
    """The parameters (host copies) after ``updates`` calls of update;
    ``hook``: a comm hook registered first."""
    comm = mnopt.create_communicator(name, bucket_bytes=4096,
                                     **(settings or {}))
    comm.skip_single_rank = False
    if hook is not None:
        comm.register_comm_hook(None, hook)
    try:
        model = linear_model(xp)
        opt = mnopt.create_multi_node_optimizer(
            chainer.optimizers.SGD(lr=LR), comm, **options).setup(model)
        for step in range(updates):
            cs = constants(step, comm.rank, xp)
            opt.update(lambda: loss_of(model, cs))
        if hasattr(opt, 'wait'):
            opt.wait()
        return host_params(model)
    finally:
        comm.finalize()


def assert_same(numpy_params, cupy_params):
    assert sorted(numpy_params) == sorted(cupy_params)
    for n in numpy_params:
        assert same_bits(numpy_params[n], cupy_params[n]), n


def expected_params(updates, k):
    """The parameters a synchronous step gives, from the constants alone
    (an independent reference): the first update broadcasts rank 0's
    parameters and applies nothing; each later one applies LR times the
    mean over the ranks of its k micro-steps' mean constant."""
    params = {'/p%d' % i: numpy.full(s, 0.25 * i, numpy.float64)
              for i, s in enumerate(SHAPES)}
    for u in range(1, updates):
        means = [sum(constants(u * k + j, r, numpy)[i].astype(numpy.float64)
                     for j in range(k)) / k
                 for r in range(WORLD.size) for i in range(len(SHAPES))]
        for i in range(len(SHAPES)):
            mean = sum(means[r * len(SHAPES) + i]
                       for r in range(WORLD.size)) / WORLD.size
            params['/p%d' % i] -= LR * mean
    return params


def assert_near(got, want):
    for n in want:
        numpy.testing.assert_allclose(got[n], want[n], rtol=1e-5,
                                      atol=1e-5, err_msg=n)


MODES = {'sync': {}, 'double_buffering': {'double_buffering': True},
         'overlap': {'overlap': True}, 'zero1': {'shard_state': True},
         'zero2': {'shard_state': True, 'overlap': True}}


@needs_chainer
@pytest.mark.parametrize('mode', sorted(MODES))
def test_accumulation_on_the_gpu_is_accumulation_on_the_host(cupy, kind,
                                                             mode):
    options = dict(MODES[mode], accumulation_steps=2)
    on_host = train(numpy, kind, updates=2 * STEPS, **options)
    on_gpu = train(cupy, kind, updates=2 * STEPS, **options)
    assert_same(on_host, on_gpu)
    if mode != 'double_buffering':   # (its updates apply the last step's)
        # The K micro-steps' mean, not their last one or their sum.
        assert_near(on_gpu, expected_params(STEPS, 2))


@needs_chainer
@pytest.mark.parametrize('wire', [None, 'float16'])
def test_accumulation_on_a_16_bit_wire_on_the_gpu(cupy, wire):
    settings = {'allreduce_grad_dtype': wire}
    on_host = train(numpy, 'flat', updates=6, settings=settings,
                    accumulation_steps=3)
    on_gpu = train(cupy, 'flat', updates=6, settings=settings,
                   accumulation_steps=3)
    assert_same(on_host, on_gpu)
    if wire is None:
        assert_near(on_gpu, expected_params(2, 3))


def join_train(xp, name, counts):
    comm = mnopt.create_communicator(name)
    comm.skip_single_rank = False
    try:
        model = linear_model(xp)
        opt = mnopt.create_multi_node_optimizer(
            chainer.optimizers.SGD(lr=LR), comm).setup(model)
        opt.update()          # the first broadcasts rank 0's parameters
        with mnopt.join(opt) as joined:
            for step in range(counts[comm.rank]):
                cs = constants(step, comm.rank, xp)
                opt.update(lambda: loss_of(model, cs))
        return host_params(model), joined.batches
    finally:
        comm.finalize()


@needs_chainer
def test_join_with_uneven_inputs_on_the_gpu(cupy, kind):
    """Ranks out of data take part with zero gradients on the GPU."""
    counts = [4 - r % 3 for r in range(WORLD.size)]   # 4, 3, 2, ...
    on_host, batches = join_train(numpy, kind, counts)
    on_gpu, gpu_batches = join_train(cupy, kind, counts)
    assert batches == gpu_batches == counts
    assert_same(on_host, on_gpu)


def cupy_copy(cupy, named):
    return [(n, cupy.asarray(a)) for n, a in named]


@pytest.mark.parametrize('hook', ['allreduce_hook', 'float16_compress_hook',
                                  'own'])
def test_a_comm_hook_takes_cupy_gradients(cupy, kind, hook):
    def own_hook(state, bucket, c):   # a user's: sum, then divide
        state['calls'] = state.get('calls', 0) + 1
        return c.sum(bucket.buffer()) / c.size

    fn = own_hook if hook == 'own' else getattr(comm_hooks, hook)
    comm = mnopt.create_communicator(kind, bucket_bytes=4096)
    comm.skip_single_rank = False
    # An independent reference: the averaging each hook stands for, with
    # no hook (float16_compress_hook's is the float16 wire's).  Equal
    # within rounding only: at three ranks the hook's collective may sum
    # in another order than the communicator's own averaging.
    wire = 'float16' if hook == 'float16_compress_hook' else None
    plain = mnopt.create_communicator(kind, bucket_bytes=4096,
                                      allreduce_grad_dtype=wire)
    plain.skip_single_rank = False
    state = {} if hook == 'own' else None
    try:
        comm.register_comm_hook(state, fn)
        for step in range(3):
            rng = numpy.random.RandomState(100 * step + comm.rank)
            a = [('p%d' % i, rng.standard_normal(s).astype(numpy.float32))
                 for i, s in enumerate(SHAPES)]
            hooked_on_host = [(n, x.copy()) for n, x in a]
            b = cupy_copy(cupy, a)
            plain.mean_grads(a)
            comm.mean_grads(hooked_on_host)
            calls = state['calls'] if state else 0
            comm.mean_grads(b)
            if hook == 'own':   # the hook ran on the CuPy buckets
                assert state['calls'] > calls
            for (_, x), (_, h), (_, y) in zip(a, hooked_on_host, b):
                assert isinstance(y, cupy.ndarray)
                y = cupy.asnumpy(y)
                assert same_bits(h, y)
                if wire:   # the means crossed as float16
                    assert same_bits(y, y.astype(numpy.float16)
                                     .astype(numpy.float32))
                    # (each sums float16 values in its own order: a few
                    # float16 steps apart)
                    numpy.testing.assert_allclose(y, x, rtol=4e-3,
                                                  atol=2e-3)
                else:
                    numpy.testing.assert_allclose(y, x, rtol=1e-6,
                                                  atol=1e-7)
    finally:
        comm.finalize()
        plain.finalize()


@needs_chainer
@pytest.mark.parametrize('mode', ['sync', 'double_buffering', 'overlap'])
def test_a_comm_hook_through_the_optimizer_on_the_gpu(cupy, mode):
    hook = comm_hooks.float16_compress_hook
    assert_same(train(numpy, 'flat', hook=hook, **MODES[mode]),
                train(cupy, 'flat', hook=hook, **MODES[mode]))


@needs_ranks
@needs_chainer
def test_the_debug_mode_checks_cupy_collectives(cupy, kind, monkeypatch):
    """MNOPT_DEBUG=detail with CuPy gradients (checked at two ranks or
    more; one rank has nothing to compare): every call is described by its
    CuPy shapes and dtypes, and the steps keep their bits."""
    plain = train(cupy, kind)
    monkeypatch.setenv('MNOPT_DEBUG', 'detail')
    checked = []
    real = collective_check.digest

    def counting(value):
        checked.append(repr(value))
        return real(value)

    monkeypatch.setattr(collective_check, 'digest', counting)
    debugged = train(cupy, kind)
    assert_same(plain, debugged)
    assert checked, 'MNOPT_DEBUG=detail checked no collective'
    assert not [c for c in checked if 'unreadable' in c], checked


@needs_ranks
def test_the_debug_mode_names_cupy_shapes_that_differ(cupy, monkeypatch):
    monkeypatch.setenv('MNOPT_DEBUG', 'detail')
    comm = mnopt.create_communicator('flat')
    try:
        n = 5 + (comm.rank == comm.size - 1)
        with pytest.raises(collective_check.CollectiveMismatchError,
                           match=r'mean_grads\(1 arrays \(5 elements, '
                                 r'float32\)\) at .*\n.*mean_grads\(1 '
                                 r'arrays \(6 elements, float32\)\)'):
            comm.mean_grads([('w', cupy.zeros(n, numpy.float32))])
        # Nothing ran: the ranks are in step, the next call works.
        named = [('w', cupy.ones(5, numpy.float32))]
        comm.mean_grads(named)
        assert float(named[0][1].sum()) == 5.0
    finally:
        comm.finalize()


@pytest.mark.many_ranks
@pytest.mark.parametrize('per_node', [None, '2'])
def test_the_tuner_on_hierarchical_takes_cupy_gradients(cupy, monkeypatch,
                                                        per_node):
    """bucket_bytes='auto' and segment_bytes='auto' on hierarchical, tuned
    on CuPy gradients: every averaging has the bits of a communicator with
    the settings it ran with, given NumPy gradients, and every rank ends
    with the same choice."""
    from test_tune import SMALL, budget_of, grads
    from mnopt.averaging import tuning
    from mnopt.transport import agreement
    monkeypatch.setattr(tuning, 'CANDIDATES', dict(SMALL))
    monkeypatch.setenv('MNOPT_SINGLE_RANK_AVERAGING', '1')
    monkeypatch.setenv('MNOPT_ALLREDUCE', 'ring')
    if per_node:
        monkeypatch.setenv('MNOPT_RANKS_PER_NODE', per_node)
    options = {'bucket_bytes': 'auto', 'segment_bytes': 'auto'}
    comm = mnopt.create_communicator('hierarchical', **options)
    record = []
    try:
        tuner = comm.averaging.tuner
        ran_with = []
        timed = tuner.measure

        def measure(seconds, name, value):   # the settings it ran with
            ran_with.append(dict(tuner.current()))
            return timed(seconds, name, value)

        tuner.measure = measure
        for step in range(budget_of(comm) + 2):
            before = len(ran_with)
            named = cupy_copy(cupy, grads(step, comm.rank))
            comm.mean_grads(named)
            used = ran_with[-1] if len(ran_with) > before else \
                dict(tuner.current())
            record.append((used, [cupy.asnumpy(a) for _, a in named]))
        chosen = comm.tuned_settings
        assert chosen is not None
        tried = {tuple(sorted(u.items())) for u, _ in record}
        assert len(tried) > 1, tried
        assert agreement.everyone(WORLD, chosen, 'test') == \
            [chosen] * WORLD.size
    finally:
        comm.finalize()
    fixed = {}
    try:
        for step, (used, result) in enumerate(record):
            key = tuple(sorted((n, used[n]) for n in options))
            if key not in fixed:
                fixed[key] = mnopt.create_communicator('hierarchical',
                                                       **dict(key))
            named = grads(step, WORLD.rank)
            fixed[key].mean_grads(named)
            for (_, want), got in zip(named, result):
                assert same_bits(want, got), (step, key)
    finally:
        for c in fixed.values():
            c.finalize()
