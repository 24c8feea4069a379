"""Your own communication hook (docs/hooks.md): the hooks the page shows,
run as it shows them (int8 with a scale per bucket, top-k with error
feedback, the asynchronous mean), the float16 wire as a hook, the hook
under double buffering and overlap, its state in snapshots, and what is
refused on every rank.  Serially and under mpiexec -n 2 / -n 3."""

import hashlib
import os
import re

import numpy
import pytest

import mnopt
from mnopt.communicators import comm_hooks
from conftest import REPO, WORLD, chainer, needs_chainer

# The collectives: also under mpiexec -n 3 (a sum of three rounds apart).
pytestmark = pytest.mark.many_ranks

PAGE = os.path.join(REPO, 'docs', 'hooks.md')


def page_blocks():
    """The page's Python code blocks, in order."""
    return re.findall(r'```python\n(.*?)```', open(PAGE).read(), re.S)


def page_hook(name):
    """The function ``name`` as the page defines it (its block run; the
    page's hooks find their array module through Chainer)."""
    pytest.importorskip('chainer', reason="the page's hooks import chainer")
    block = next(b for b in page_blocks() if 'def %s(' % name in b)
    scope = {}
    exec(compile(block, PAGE, 'exec'), scope)
    return block, scope[name]


def gradients(seed, sizes=(300, 1200, 7)):
    """This rank's gradients: another set on each rank."""
    rng = numpy.random.RandomState(seed * 101 + WORLD.rank)
    return [('p%d' % i, rng.standard_normal(n).astype(numpy.float32))
            for i, n in enumerate(sizes)]


def every_rank(arrays):
    """Each rank's digest of ``arrays``."""
    digest = hashlib.sha1(b''.join(a.tobytes() for a in arrays)).hexdigest()
    return WORLD.allgather(digest)


def true_mean(named):
    return [WORLD.allreduce(a.astype(numpy.float64)) / WORLD.size
            for _, a in named]


@pytest.fixture
def comm():
    c = mnopt.create_communicator('flat', bucket_bytes=2048)
    yield c
    c.finalize()


@pytest.mark.parametrize('name', ['int8_hook', 'topk_hook'])
def test_the_pages_hooks_are_under_30_lines(name):
    block, _ = page_hook(name)
    assert len(block.strip().splitlines()) < 30, block


def test_int8_hook_gives_every_rank_the_mean_within_its_rounding(comm):
    _, hook = page_hook('int8_hook')
    comm.register_comm_hook(None, hook)
    named = gradients(1)
    expected = true_mean(named)
    comm.mean_grads(named)
    assert len(set(every_rank([a for _, a in named]))) == 1
    for (_, got), want in zip(named, expected):
        # Each rank's value off by at most half its scale (max |g| / 127).
        assert numpy.abs(got - want).max() <= 4.5 / 127 * 0.5 + 1e-6
        assert numpy.abs(got - want).max() > 0   # quantized, not plain


def test_topk_hook_keeps_back_what_it_did_not_send(comm):
    _, hook = page_hook('topk_hook')
    residuals = {}
    comm.register_comm_hook(residuals, hook)
    named = gradients(2)
    mine = numpy.concatenate([a for _, a in named])
    comm.mean_grads(named)
    assert len(set(every_rank([a for _, a in named]))) == 1
    kept = numpy.concatenate([residuals[k] for k in sorted(
        residuals, key=lambda k: (int(k.split(':')[0][1:]),
                                  int(k.split(':')[1].split('+')[0])))])
    sent = mine - kept
    # Per bucket 1% (at least 1) of the values went out, the rest is kept.
    assert 0 < numpy.count_nonzero(sent) < mine.size // 20
    assert numpy.array_equal(sent + kept, mine)
    # The mean is the ranks' sent values summed over the ranks.
    total = WORLD.allreduce(sent.astype(numpy.float64))
    got = numpy.concatenate([a for _, a in named])
    numpy.testing.assert_allclose(got, total / WORLD.size, atol=1e-6)


def test_topk_error_feedback_sends_everything_in_time(comm):
    """A constant gradient: what was kept back goes out later, so the sum
    of the means approaches steps x the mean."""
    _, hook = page_hook('topk_hook')
    comm.register_comm_hook({}, hook)
    fixed = gradients(3, sizes=(200,))
    want = true_mean(fixed)[0]
    applied = numpy.zeros(200)
    steps = 400
    for _ in range(steps):
        named = [(n, a.copy()) for n, a in fixed]
        comm.mean_grads(named)
        applied += named[0][1]
    assert numpy.abs(applied / steps - want).max() < 0.25 * \
        numpy.abs(want).max()


def test_the_async_mean_hook_is_the_mean(comm):
    _, hook = page_hook('mean_async_hook')
    comm.register_comm_hook(None, hook)
    named = gradients(4)
    expected = true_mean(named)
    comm.mean_grads(named)
    for (_, got), want in zip(named, expected):
        numpy.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_float16_hook_gives_the_float16_wires_bits():
    wire = mnopt.create_communicator('flat', allreduce_grad_dtype='float16')
    hooked = mnopt.create_communicator('flat')
    # The hook runs at one rank too; the wire then moves nothing unless
    # told to (MNOPT_SINGLE_RANK_AVERAGING=1).
    wire.skip_single_rank = False
    try:
        hooked.register_comm_hook(None, comm_hooks.float16_compress_hook)
        for seed in range(3):
            a, b = gradients(seed), gradients(seed)
            wire.mean_grads(a)
            hooked.mean_grads(b)
            for (_, x), (_, y) in zip(a, b):
                assert x.tobytes() == y.tobytes()
    finally:
        wire.finalize()
        hooked.finalize()


def test_the_bucket_says_what_it_holds(comm):
    seen = []

    def recording_hook(state, bucket, c):
        seen.append((bucket.index(), bucket.is_last(), bucket.names(),
                     bucket.slices(), bucket.key(), bucket.step))
        return c.mean(bucket.buffer())

    comm.register_comm_hook(None, recording_hook)
    comm.mean_grads(gradients(5))   # 1507 float32 values, 512 a bucket
    assert [s[:3] for s in seen] == [
        (0, False, ['p0', 'p1']), (1, False, ['p1']), (2, True, ['p1', 'p2'])]
    assert seen[0][3] == [('p0', slice(0, 300), slice(0, 300)),
                          ('p1', slice(300, 512), slice(0, 212))]
    assert [s[4] for s in seen] == ['p0:0+512', 'p1:212+512', 'p1:724+483']
    assert {s[5] for s in seen} == {0}


def test_a_hook_that_returns_nothing_says_what_to_return(comm):
    comm.register_comm_hook(None, lambda state, bucket, c: None)
    with pytest.raises(TypeError, match=r'returned None for bucket 0: '
                                        'return the averaged bucket'):
        comm.mean_grads(gradients(6))


def test_another_hook_on_one_rank_is_refused_on_every_rank(comm):
    hooks = [comm_hooks.allreduce_hook, comm_hooks.float16_compress_hook]
    mine = hooks[WORLD.rank % 2]
    if WORLD.size == 1:
        comm.register_comm_hook(None, mine)   # alone: nothing to differ
        return
    with pytest.raises(ValueError, match='every rank must register the '
                                         'same hook.*float16_compress_hook'):
        comm.register_comm_hook(None, mine)
    assert comm.averaging.comm_hook is None


@pytest.mark.parametrize('settings, message', [
    ({'compression': 'sign'}, "replaces the averaging, compression='sign'"),
    ({'allreduce_grad_dtype': 'float16'}, 'allreduce_grad_dtype=None'),
    ({'bucket_bytes': 'auto'}, "bucket_bytes='auto' tunes"),
])
def test_what_a_hook_replaces_is_refused(settings, message):
    c = mnopt.create_communicator('flat', **settings)
    try:
        with pytest.raises(ValueError, match=re.escape(message)):
            c.register_comm_hook(None, comm_hooks.allreduce_hook)
    finally:
        c.finalize()


def test_what_is_not_a_function_is_refused(comm):
    with pytest.raises(TypeError, match='takes a function hook'):
        comm.register_comm_hook(comm_hooks.allreduce_hook, {})


# ------------------------------------------------------------- the optimizer

def model_and_batch(seed=0):
    numpy.random.seed(seed)
    model = chainer.links.Classifier(chainer.Sequential(
        chainer.links.Linear(6, 16), chainer.functions.relu,
        chainer.links.Linear(16, 3)))
    rng = numpy.random.RandomState(10 + WORLD.rank)
    x = rng.standard_normal((8, 6)).astype(numpy.float32)
    t = rng.randint(0, 3, 8).astype(numpy.int32)
    return model, x, t


def train(mode, hook, steps=4):
    comm = mnopt.create_communicator('flat', bucket_bytes=256)
    calls = []

    def counting(state, bucket, c):
        calls.append(bucket.step)
        return hook(state, bucket, c)

    try:
        if hook is not None:
            comm.register_comm_hook(None, counting)
        model, x, t = model_and_batch()
        opt = mnopt.create_multi_node_optimizer(
            chainer.optimizers.MomentumSGD(lr=0.1), comm, **mode)
        opt.setup(model)
        for _ in range(steps):
            opt.update(model, x, t)
        params = [p.array.copy() for _, p in sorted(model.namedparams())]
        return params, calls
    finally:
        comm.finalize()


@needs_chainer
@pytest.mark.parametrize('mode', [{}, {'double_buffering': True},
                                  {'overlap': True}])
def test_a_hook_averages_under_every_optimizer(mode):
    plain, _ = train(mode, None)
    hooked, calls = train(mode, comm_hooks.allreduce_hook)
    assert calls   # the hook ran
    assert len(set(every_rank(hooked))) == 1
    for a, b in zip(plain, hooked):
        # The plain mean divides before the sum, the hook after.
        numpy.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@needs_chainer
def test_a_sharded_optimizer_refuses_a_hook(comm):
    comm.register_comm_hook(None, comm_hooks.allreduce_hook)
    with pytest.raises(ValueError, match='a comm hook averages whole '
                                         'buckets'):
        mnopt.create_multi_node_optimizer(chainer.optimizers.SGD(), comm,
                                          shard_state=True)


@needs_chainer
@pytest.mark.parametrize('overlap', [False, True])   # ZeRO stage 1, 2
def test_a_hook_after_a_sharded_optimizer_is_refused_on_every_rank(
        comm, overlap):
    """Before its first update the sharded optimizer has run no sharded
    collective: the hook would be accepted and never called."""
    model, x, t = model_and_batch()
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(), comm, shard_state=True, overlap=overlap)
    opt.setup(model)
    with pytest.raises(ValueError, match=r'sharded optimizer \(shard_state'
                                         r'=True\) averages through this'):
        comm.register_comm_hook(None, comm_hooks.allreduce_hook)
    assert comm.averaging.comm_hook is None
    comm.register_comm_hook(None, None)   # taking none away: no problem
    del opt
    # Once it is gone, the communicator takes a hook again.
    comm.register_comm_hook(None, comm_hooks.allreduce_hook)
    assert comm.averaging.comm_hook is not None


@needs_chainer
def test_topk_residuals_are_in_the_snapshot(comm, tmp_path):
    _, hook = page_hook('topk_hook')
    residuals = {}
    comm.register_comm_hook(residuals, hook)
    model, x, t = model_and_batch()
    opt = mnopt.create_multi_node_optimizer(chainer.optimizers.SGD(), comm)
    opt.setup(model)
    for _ in range(2):   # the first update broadcasts, then averages
        opt.update(model, x, t)
    assert residuals
    path = str(tmp_path / ('opt%d.npz' % WORLD.rank))
    chainer.serializers.save_npz(path, opt)
    saved = {k: v.copy() for k, v in residuals.items()}
    residuals.clear()
    chainer.serializers.load_npz(path, opt)
    assert sorted(residuals) == sorted(saved)
    for key in saved:
        assert numpy.array_equal(residuals[key], saved[key])


MODES = [{}, {'double_buffering': True}, {'overlap': True},
         {'overlap': True, 'accumulation_steps': 2}]


def hooked_run(hook, path, mode, updates, load=0, save=False):
    """(parameters, state, [(bucket.step, bucket.key())...]) of a run of
    ``updates`` under ``mode`` with ``hook``, from this rank's snapshot
    at ``path`` if ``load`` (the updates before it), written there after
    if ``save``."""
    comm = mnopt.create_communicator('flat', bucket_bytes=256)
    seen, state = [], {}

    def logging(state, bucket, c):
        seen.append((bucket.step, bucket.key()))
        return hook(state, bucket, c)

    try:
        comm.register_comm_hook(state, logging)
        model, x, t = model_and_batch()
        opt = mnopt.create_multi_node_optimizer(
            chainer.optimizers.MomentumSGD(lr=0.1), comm, **mode)
        opt.setup(model)
        if load:   # as a trainer's snapshot holds both
            chainer.serializers.load_npz(path, opt)
            chainer.serializers.load_npz(path + '.model', model)
        for i in range(load, load + updates):   # batches of their own
            opt.update(model, x * (1 + i % 3), t)
        if hasattr(opt, 'wait'):
            opt.wait()
        if save:
            chainer.serializers.save_npz(path, opt)
            chainer.serializers.save_npz(path + '.model', model)
        return ([p.array.copy() for _, p in sorted(model.namedparams())],
                state, seen)
    finally:
        comm.finalize()


@needs_chainer
@pytest.mark.parametrize('mode', MODES)
def test_a_topk_run_resumed_from_its_snapshots_is_the_uninterrupted_one(
        tmp_path, mode):
    """Each rank's residuals come back with its own snapshot: the resumed
    run ends with the uninterrupted run's bits, its hook seeing the same
    buckets with the same steps (under overlap: the buckets of backward
    at once, not the whole set in name order as after a broadcast)."""
    _, hook = page_hook('topk_hook')
    path = str(tmp_path / ('opt%d.npz' % WORLD.rank))
    uninterrupted, state, seen = hooked_run(hook, path, mode, 12)
    run_before, _, seen_before = hooked_run(hook, path, mode, 7, save=True)
    resumed, state_after, seen_after = hooked_run(hook, path, mode, 5,
                                                  load=7)
    assert seen_after == seen[len(seen_before):]
    assert every_rank(resumed) == every_rank(uninterrupted)
    assert sorted(state_after) == sorted(state)


@needs_chainer
@pytest.mark.parametrize('mode', MODES[1:])
def test_bucket_step_numbers_the_update_alike_in_every_mode(mode):
    """step counts the averaged updates, whatever the mode: the same
    number for the same update's gradients as without double buffering
    or overlap, every bucket of one update the same (overlap's first
    update, which broadcasts, also averages: as step 0)."""
    def steps(mode):
        seen = hooked_run(comm_hooks.allreduce_hook, None, mode, 9)[2]
        return sorted(set(s for s, _ in seen)), seen
    plain, _ = steps({'accumulation_steps': mode.get('accumulation_steps',
                                                     1)})
    numbers, seen = steps(mode)
    assert numbers == plain
    assert numbers == list(range(len(numbers)))


@needs_chainer
@pytest.mark.parametrize('mode', [{'overlap': True},
                                  {'overlap': True, 'accumulation_steps': 2}])
def test_under_overlap_a_hook_sees_the_buckets_of_backward_from_the_start(
        mode):
    """The update that plans the buckets averages them as the later ones
    do: a hook's per-bucket state has one key per bucket of backward (no
    stale key of the whole set in name order)."""
    _, state, seen = hooked_run(comm_hooks.allreduce_hook, None, mode, 6)
    _, hook = page_hook('topk_hook')
    _, residuals, seen_topk = hooked_run(hook, None, mode, 6)
    last = [k for s, k in seen_topk if s == seen_topk[-1][0]]
    assert sorted(residuals) == sorted(last)
    assert set(k for _, k in seen) == set(last)
