"""What a user gets wrong, refused or said at once: an optimizer that is
not a Chainer optimizer instance (or one already wrapped), and a script
started without its launcher in a job of several processes.  Serially and
under mpiexec -n 2 / -n 3, as every test module."""

import logging
import os
import re
import subprocess
import sys

import numpy
import pytest

import mnopt
from mnopt.stall import launched
from conftest import REPO, WORLD, chainer, needs_chainer, python_path, slack

# Also under mpiexec -n 3: a middle rank misuses.
pytestmark = pytest.mark.many_ranks


# ------------------------------------------------- create_multi_node_optimizer

@needs_chainer
@pytest.mark.parametrize('options', [
    {}, {'double_buffering': True}, {'overlap': True},
    {'shard_state': True}])
def test_an_optimizer_already_wrapped_is_refused(naive_comm, options):
    """Wrapped twice, its first update would apply nothing and every later
    one average the mean again."""
    once = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(), naive_comm, **options)
    with pytest.raises(TypeError, match='an optimizer it already wrapped '
                                        r'\(\w+ around SGD\): pass the '
                                        'Chainer optimizer itself, once'):
        mnopt.create_multi_node_optimizer(once, naive_comm, **options)


@needs_chainer
def test_what_is_not_a_chainer_optimizer_is_refused(naive_comm):
    with pytest.raises(TypeError, match=r'an optimizer instance, not the '
                                        r'class MomentumSGD: pass '
                                        r'MomentumSGD\(\.\.\.\)'):
        mnopt.create_multi_node_optimizer(chainer.optimizers.MomentumSGD,
                                          naive_comm)
    for wrong, said in [(object(), 'a object object'), (None, 'None'),
                        (chainer.links.Linear(2, 3), 'a Linear object'),
                        ('Adam', 'a str object')]:
        with pytest.raises(TypeError, match=r'takes a Chainer optimizer '
                                            r'\(an instance of chainer\.'
                                            r'Optimizer, e\.g\. .*; got '
                                            + said):
            mnopt.create_multi_node_optimizer(wrong, naive_comm)


@needs_chainer
@pytest.mark.parametrize('options', [
    {}, {'double_buffering': True}, {'overlap': True},
    {'shard_state': True}])
def test_an_update_before_setup_says_to_call_setup_first(naive_comm,
                                                         options):
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(), naive_comm, **options)
    for args in [(), (lambda: None,)]:
        with pytest.raises(RuntimeError, match=r'no model yet: call '
                                               r'optimizer\.setup\(model\) '
                                               r'first'):
            opt.update(*args)
    # and then it trains
    model = chainer.links.Linear(2, 1)
    opt.setup(model)
    x = numpy.ones((1, 2), numpy.float32)
    for _ in range(3):
        opt.update(lambda: chainer.functions.sum(model(x)))


# ------------------------------------------------- the communicator

def test_gradients_in_a_dict_are_refused_saying_what_to_pass(naive_comm):
    array = numpy.ones(3, numpy.float32)
    for call in (naive_comm.mean_grads, naive_comm.mean_grads_async):
        with pytest.raises(TypeError, match=r'^%s takes a list of \(name, '
                                            r'array\) pairs: pass sorted\('
                                            r'grads\.items\(\)\), not a '
                                            r'dict$' % call.__name__):
            call({'w': array})
    with pytest.raises(TypeError, match=r'not item 1, a ndarray$'):
        naive_comm.mean_grads([('v', array), array])
    with pytest.raises(TypeError, match='not item 0, a tuple$'):
        naive_comm.mean_grads_async([('v', array, 1)])
    grads = [('w', numpy.full(3, WORLD.rank, numpy.float32))]
    naive_comm.mean_grads(grads)   # still in step on every rank
    numpy.testing.assert_allclose(grads[0][1], (WORLD.size - 1) / 2.0)


@pytest.mark.parametrize('name,covered_by', [
    ('two_dimensional', "use 'hierarchical'"),
    ('single_node', "use 'pure_nccl' on GPUs .* 'flat' otherwise"),
    ('non_cuda_aware', "use 'hierarchical' .*no CUDA-aware MPI needed"),
    ('dummy', 'mnopt has none that skips the communication.*python -m '
              'mnopt.benchmark')])
def test_chainermn_names_mnopt_lacks_say_what_covers_them(name, covered_by):
    """Every rank gets the error (create_communicator's start-up
    exchange), naming the communicator to use instead."""
    with pytest.raises(ValueError, match="ChainerMN's '%s' communicator is "
                                         'not in mnopt: %s' % (
                                             name, covered_by)):
        mnopt.create_communicator(name)


@needs_chainer
@pytest.mark.parametrize('compression,dropped', [
    ('sign', "sign compression's state .*error-feedback residuals"),
    ('powersgd', "PowerSGD's state .*warm-start factors")])
def test_a_compressed_snapshot_resumed_without_it_warns(compression,
                                                        dropped):
    from conftest import warns_on_rank_0
    saved = {}
    for given in (compression, None):
        comm = mnopt.create_communicator('flat', compression=given)
        model = chainer.links.Linear(20, 30)
        opt = mnopt.create_multi_node_optimizer(
            chainer.optimizers.SGD(), comm).setup(model)
        x = numpy.ones((2, 20), numpy.float32)
        for _ in range(3):
            opt.update(lambda: chainer.functions.sum(model(x)))
        if given:
            opt.serialize(chainer.serializers.DictionarySerializer(saved))
            assert any('mnopt_compression' in k for k in saved)
        else:
            with warns_on_rank_0(comm, 'the snapshot holds %s.*, which '
                                       'this communicator, without '
                                       'compression, drops: .*create the '
                                       'communicator '
                                       "with compression='%s'"
                                 % (dropped, compression)):
                opt.serialize(chainer.serializers.NpzDeserializer(saved))
            with _no_warning():
                # a snapshot without compression state: nothing said
                opt.serialize(chainer.serializers.NpzDeserializer(
                    {k: v for k, v in saved.items()
                     if 'mnopt_compression' not in k}, strict=False))
        comm.finalize()


def _no_warning():
    from conftest import mnopt_records
    import contextlib

    @contextlib.contextmanager
    def quiet():
        with mnopt_records() as records:
            yield
        assert [r.getMessage() for r in records
                if r.levelno >= logging.WARNING] == []
    return quiet()


def test_a_rank_file_given_as_the_snapshot_says_which_to_pass(tmp_path):
    pytest.importorskip('chainer', reason='the snapshots are Chainer\'s')
    from mnopt.extensions.loadable import rank_file_problem
    shared = tmp_path / 'snapshot_iter_80.npz'
    rank0 = tmp_path / 'snapshot_iter_80.rank0.npz'
    rank0.write_bytes(b'')
    # Without the shared file beside it, it is not a rank file of ours.
    assert rank_file_problem(str(rank0)) is None
    shared.write_bytes(b'')
    assert rank_file_problem(str(rank0)) == (
        "snapshot_iter_80.rank0.npz is rank 0's file of a snapshot, not "
        'the snapshot: pass %s (every rank then reads its own file beside '
        'it)' % shared)
    assert rank_file_problem(str(shared)) is None
    assert rank_file_problem(str(tmp_path / 'a.rank12.npz')) is None


# ------------------------------------------------- started without mpiexec

def test_alone_though_the_environment_says_several():
    """A world of 1 beside any launcher's count above 1 is a problem; a
    world of the size a launcher started (or any world of several: an
    mpiexec -n 2 inside an allocation of 4 tasks) is not."""
    for name in launched.SIZE_VARIABLES:
        said = launched.problem({name: '4'}, 1)
        assert said is not None and '(%s=4)' % name in said
        assert 'rank 0 of 1' in said and 'mpiexec -n N' in said
        assert launched.problem({name: '1'}, 1) is None
        assert launched.problem({name: '4'}, 4) is None
        assert launched.problem({name: '4'}, 2) is None
    assert launched.problem({}, 1) is None
    assert launched.problem({'SLURM_NTASKS': '', 'PMI_SIZE': 'x'}, 1) is None
    both = launched.problem({'PMI_SIZE': '2', 'SLURM_NTASKS': '8'}, 1)
    assert '(PMI_SIZE=2, SLURM_NTASKS=8)' in both


def test_the_warning_goes_to_the_mnopt_logger_once(monkeypatch, caplog):
    monkeypatch.setattr(launched, '_warned', False)
    with caplog.at_level(logging.WARNING, logger='mnopt'):
        for _ in range(2):
            launched.warn_if_alone(1, {'OMPI_COMM_WORLD_SIZE': '2'})
        launched.warn_if_alone(2, {'OMPI_COMM_WORLD_SIZE': '2'})
    said = [r for r in caplog.records if r.name == 'mnopt']
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert 'OMPI_COMM_WORLD_SIZE=2' in said[0].getMessage()


def test_a_launched_job_is_not_warned_about(caplog):
    """mpiexec's own variables (Hydra's PMI_SIZE) agree with the world it
    started: no warning, here where every rank was started by it."""
    if WORLD.size == 1:
        pytest.skip('a world of several processes, started by mpiexec')
    assert launched.problem(os.environ, WORLD.size) is None
    with caplog.at_level(logging.WARNING, logger='mnopt'):
        mnopt.create_communicator('naive').finalize()
    assert not [r for r in caplog.records if 'alone' in r.getMessage()]


ALONE = '''
import numpy, mnopt
for _ in range(2):
    comm = mnopt.create_communicator('flat')
g = [('w', numpy.full(3, 5.0, numpy.float32))]
comm.mean_grads(g)
print('rank %d of %d, mean %s' % (comm.rank, comm.size, g[0][1][0]))
'''


@pytest.mark.spawn
def test_started_without_mpiexec_in_a_job_of_several():
    """Processes started bare whose environment names a job of several
    (an sbatch script's SLURM_NTASKS, Open MPI's or Hydra's variables
    with this MPICH): each trains as rank 0 of 1, warned once on stderr;
    ``python -m mnopt.check`` fails with the reason.  MPICH's singleton
    start is not disturbed by a PMI_SIZE without a process manager.  A
    bare process in a clean environment checks OK."""
    clean = {k: v for k, v in os.environ.items()
             if k not in launched.SIZE_VARIABLES}
    clean['PYTHONPATH'] = python_path()
    runs = {
        'check, SLURM_NTASKS=4': (['-m', 'mnopt.check'],
                                  {'SLURM_NTASKS': '4'}),
        'check, clean': (['-m', 'mnopt.check'], {}),
        'train, OMPI_COMM_WORLD_SIZE=2': (['-c', ALONE],
                                          {'OMPI_COMM_WORLD_SIZE': '2'}),
        'train, PMI_SIZE=2': (['-c', ALONE], {'PMI_SIZE': '2'}),
    }
    procs = {what: subprocess.Popen(
        [sys.executable] + argv, env=dict(clean, **extra), cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for what, (argv, extra) in runs.items()}
    done = {what: p.communicate(timeout=slack(120)) + (p.returncode,)
            for what, p in procs.items()}

    out, err, rc = done['check, SLURM_NTASKS=4']
    assert rc == 1, (out, err)
    # The check wraps its lines within 80 columns: read it unwrapped.
    flat_out = ' '.join(out.split())
    assert 'PROBLEM: this process is alone in its MPI world, rank 0 of 1, ' \
        'though its environment says the job has more processes ' \
        '(SLURM_NTASKS=4)' in flat_out, out
    assert out.rstrip().endswith('mnopt check: 1 problem(s)')
    # Averaging itself is right (alone, the mean is its own gradient).
    assert 'averaging flat, mean of 1 rank ok' in flat_out, out
    assert err.count('mnopt: warning: this process is alone') == 1, err

    out, err, rc = done['check, clean']
    # OK, or OK with warnings for optional parts this install lacks (the
    # core stack has CuPy without a GPU).
    assert rc == 0 and re.search(r'mnopt check: OK(, \d+ warnings? '
                                 r'\(see WARNING above\))?$',
                                 out.rstrip()), (out, err)
    assert 'alone' not in err

    for what in ('train, OMPI_COMM_WORLD_SIZE=2', 'train, PMI_SIZE=2'):
        out, err, rc = done[what]
        variable = what.split(', ')[1]
        assert rc == 0, (what, err)
        assert out.strip() == 'rank 0 of 1, mean 5.0', (what, out)
        warnings = [line for line in err.splitlines()
                    if line.startswith('mnopt: warning:')]
        assert len(warnings) == 1 and '(%s)' % variable in warnings[0] \
            and 'each such process will train alone' in warnings[0], err


def test_subclassing_the_interface_as_a_communicator_says_where_to_go():
    """CommunicatorBase is the interface (as ChainerMN's); a communicator
    that says how to sum a buffer subclasses MpiCommunicatorBase, and the
    old way says so instead of 'takes no arguments'."""
    from mnopt.communicators.base import CommunicatorBase
    from mnopt.communicators.naive import NaiveCommunicator

    class Mine(CommunicatorBase):
        _sum = NaiveCommunicator._sum

    with pytest.raises(TypeError, match='subclasses mnopt.communicators.'
                                        'base.MpiCommunicatorBase'):
        Mine(WORLD)
