"""MNOPT_DEBUG=detail and MNOPT_LOG_LEVEL (docs/debugging.md): every
collective checked across ranks before it runs, a mismatch one error on
every rank naming each rank's call and its line; point-to-point pairs
checked by the receiver; the setting agreed at start-up; mnopt's loggers
set without code, and what they say at INFO and DEBUG.  Serially and
under mpiexec -n 2 / -n 3 (the mismatches need two ranks or more)."""

import logging
import os
import subprocess
import sys

import numpy
import pytest

import mnopt
from mnopt.averaging import compression_guard
from mnopt.transport import collective_check
from mnopt.transport.collective_check import CollectiveMismatchError
from conftest import WORLD, chainer, needs_chainer, python_path

# Also under mpiexec -n 3: the last rank (or a middle one) differs.
pytestmark = pytest.mark.many_ranks

needs_ranks = pytest.mark.skipif(
    WORLD.size < 2, reason='a mismatch needs two ranks (mpiexec -n 2)')


@pytest.fixture
def debug_comm(monkeypatch):
    monkeypatch.setenv('MNOPT_DEBUG', 'detail')
    c = mnopt.create_communicator('flat')
    yield c
    c.finalize()


@pytest.fixture
def checks(monkeypatch):
    """The kinds checked (each check's exchange), in order."""
    seen = []
    check = collective_check.CollectiveCheck.check

    def counted(self, name, compared, shown):
        seen.append(name)
        return check(self, name, compared, shown)
    monkeypatch.setattr(collective_check.CollectiveCheck, 'check', counted)
    return seen


def here(offset=1):
    """``file:line`` of the caller's line + ``offset``, as the error says
    it."""
    frame = sys._getframe(1)
    return '%s:%d' % (frame.f_code.co_filename, frame.f_lineno + offset)


def test_ranks_that_made_the_same_call_are_named_together():
    assert collective_check.ranks_text([3]) == 'rank 3'
    assert collective_check.ranks_text([0, 2]) == 'ranks 0, 2'
    assert collective_check.ranks_text([0, 1, 2, 3, 5, 7, 8, 9]) == \
        'ranks 0-3, 5, 7-9'


def test_off_by_default_no_check_at_all(monkeypatch):
    monkeypatch.delenv('MNOPT_DEBUG', raising=False)
    comm = mnopt.create_communicator('flat')
    try:
        assert comm.check_calls is None
        assert comm.allreduce_obj(1) == comm.size
    finally:
        comm.finalize()


def test_matching_collectives_run_as_without_and_each_is_checked(
        debug_comm, checks):
    comm, r, n = debug_comm, debug_comm.rank, debug_comm.size
    x = numpy.full(3, r, numpy.float32)
    assert comm.bcast(x if r == 0 else None, 0).tolist() == [0, 0, 0]
    assert [a[0] for a in comm.allgather(x)] == list(range(n))
    gathered = comm.gather(x, root=n - 1)
    assert gathered is None if r != n - 1 else len(gathered) == n
    assert comm.scatter([numpy.full(1, k) for k in range(n)]
                        if r == 0 else None)[0] == r
    assert comm.allreduce(x).tolist() == [sum(range(n))] * 3
    assert comm.bcast_obj('hi' if r == 0 else None) == 'hi'
    assert comm.allgather_obj(r) == list(range(n))
    assert comm.allreduce_obj(r) == sum(range(n))
    grads = [('a', numpy.full(4, r, numpy.float32)),
             ('b', numpy.full(2, r, numpy.float64))]
    comm.mean_grads(iter(grads))     # an iterator: still every array
    assert grads[0][1].tolist() == [(n - 1) / 2] * 4
    assert grads[1][1].tolist() == [(n - 1) / 2] * 2
    comm.mean_grads_async(grads).wait()
    expected = ['bcast', 'allgather', 'gather', 'scatter', 'allreduce',
                'bcast_obj', 'allgather_obj', 'allreduce_obj', 'mean_grads',
                'mean_grads_async']
    assert checks == (expected if n > 1 else [])


@needs_ranks
def test_another_collective_on_one_rank_is_named_with_its_line(debug_comm):
    comm, last = debug_comm, debug_comm.size - 1
    with pytest.raises(CollectiveMismatchError) as raised:
        if comm.rank == last:
            site = here()
            comm.allreduce_obj(1)
        else:
            site = here()
            comm.bcast_obj(1)
    sites = comm.allgather_obj(site)
    others = {2: 'rank 0', 3: 'ranks 0, 1', 4: 'ranks 0-2'}[comm.size]
    assert str(raised.value).splitlines() == [
        'MNOPT_DEBUG=detail: the ranks called collectives that do not '
        'match:',
        '  %s: bcast_obj(root=0) at %s' % (others, sites[0]),
        '  rank %d: allreduce_obj() at %s' % (last, sites[last]),
        collective_check.ADVICE[0].upper() + collective_check.ADVICE[1:]]
    # Nothing ran: the ranks are in step, the next collective works.
    assert comm.allreduce_obj(1) == comm.size


@needs_ranks
def test_shapes_dtypes_and_roots_that_differ_are_named(debug_comm):
    comm, r = debug_comm, debug_comm.rank
    with pytest.raises(CollectiveMismatchError,
                       match=r'rank 0: allreduce\(shape \(2,\) float32\) '
                             r'at .*\n  rank 1: allreduce\(shape \(3,\) '
                             r'float32\)'):
        comm.allreduce(numpy.zeros(2 + r, numpy.float32))
    dtype = numpy.float64 if r == comm.size - 1 else numpy.float32
    with pytest.raises(CollectiveMismatchError,
                       match=r'mean_grads\(1 arrays \(5 elements, float64\)'
                             r'\) at '):
        comm.mean_grads([('w', numpy.zeros(5, dtype))])
    with pytest.raises(CollectiveMismatchError,
                       match=r'rank 0: bcast_obj\(root=0\) .*\n  '
                             r'ranks? 1.*: bcast_obj\(root=1\)'):
        comm.bcast_obj(r, root=min(r, 1))
    assert comm.allgather_obj(r) == list(range(comm.size))


@needs_ranks
def test_point_to_point_the_receiver_checks_the_pair(debug_comm):
    comm, sent_at, said = debug_comm, None, None
    if comm.rank == 0:
        comm.send(numpy.arange(3.0), 1, 7)
        sent_at = here(-1)
        comm.send_obj({'k': 1}, 1, 8)
        comm.send_obj('ok', 1, 9)
    elif comm.rank == 1:
        with pytest.raises(CollectiveMismatchError) as raised:
            received_at = here()
            comm.recv_obj(0, tag=7)
        said = ("MNOPT_DEBUG=detail: rank 1's recv_obj at %s received "
                "what rank 0's send(shape (3,) float64) at " % received_at,
                str(raised.value))
        with pytest.raises(CollectiveMismatchError,
                           match=r"received what rank 0's send_obj\(dict\)"):
            comm.recv(0, 8)
        # Nothing was left behind: the next message is the next one.
        assert comm.recv_obj(0, tag=9) == 'ok'
    sent_at = comm.bcast_obj(sent_at)
    if said is not None:
        assert said[0] + sent_at + ' sent: pair send with recv, and ' \
            'send_obj with recv_obj' == said[1]


def test_bad_or_differing_settings_are_refused_on_every_rank(monkeypatch):
    monkeypatch.setenv('MNOPT_DEBUG', 'yes')
    with pytest.raises(ValueError, match=r"MNOPT_DEBUG='yes': one of off, "
                                         r'detail was expected'):
        mnopt.create_communicator('flat')
    monkeypatch.setenv('MNOPT_DEBUG', 'off')
    monkeypatch.setenv('MNOPT_LOG_LEVEL', 'loud')
    with pytest.raises(ValueError, match=r"MNOPT_LOG_LEVEL='loud': one of "
                                         r'DEBUG, INFO, WARNING, ERROR'):
        mnopt.create_communicator('flat')
    monkeypatch.delenv('MNOPT_LOG_LEVEL')
    if WORLD.size > 1:
        # A rank without it would never join the checks' exchanges.
        monkeypatch.setenv('MNOPT_DEBUG', 'detail' if WORLD.rank == 0
                           else 'off')
        with pytest.raises(ValueError, match=r"MNOPT_DEBUG \(rank 0: "
                                             r"'detail', rank 1: 'off'"):
            mnopt.create_communicator('flat')


@pytest.mark.parametrize('value', ['DETAIL', 'Detail', 'OFF'])
def test_the_debug_setting_is_read_in_any_case(monkeypatch, value):
    """As MNOPT_LOG_LEVEL and PyTorch's TORCH_DISTRIBUTED_DEBUG=DETAIL;
    ranks that spell it in another case agree."""
    monkeypatch.setenv('MNOPT_DEBUG', value if WORLD.rank == 0
                       else value.lower())
    assert collective_check.mode() == value.lower()
    comm = mnopt.create_communicator('flat')
    try:
        checking = value.lower() == 'detail' and WORLD.size > 1
        assert (comm.check_calls is not None) == checking
    finally:
        comm.finalize()


@pytest.mark.spawn
@pytest.mark.parametrize('value, level', [('info', logging.INFO),
                                          ('DEBUG', logging.DEBUG),
                                          ('', logging.NOTSET),
                                          ('loud', logging.NOTSET)])
def test_log_level_sets_mnopt_loggers_at_import(value, level):
    """Without code; a bad value does not stop the import (the
    communicator refuses it, above)."""
    out = subprocess.run(
        [sys.executable, '-c', 'import logging, mnopt; '
         "print(logging.getLogger('mnopt').level)"],
        env=dict(os.environ, PYTHONPATH=python_path(),
                 MNOPT_LOG_LEVEL=value),
        capture_output=True, text=True, timeout=120, check=True)
    assert int(out.stdout) == level


def records_of(caplog, name):
    return [r.getMessage() for r in caplog.records if r.name == name]


def test_each_bucket_layout_is_logged_at_debug(caplog):
    comm = mnopt.create_communicator('flat', bucket_bytes=64)
    try:
        grads = [('a', numpy.ones(30, numpy.float32)),
                 ('b', numpy.ones(2, numpy.float32))]
        with caplog.at_level(logging.DEBUG, logger='mnopt'):
            comm.mean_grads(grads)
            comm.mean_grads(grads)     # the same layout: said once
    finally:
        comm.finalize()
    assert records_of(caplog, 'mnopt.communicators.group') == [
        'mnopt: a gradient set of 2 arrays (a ... b), 32 elements on the '
        'wire as float32, in 2 bucket(s) of up to 16 elements']


def test_a_guard_choice_is_logged_at_info_on_rank_0(caplog):
    guard = compression_guard.CompressionGuard()
    key = ('flat#0.sync', ('w1', 'w2'))
    with caplog.at_level(logging.INFO, logger='mnopt'):
        for way, seconds in [('plain', 0.010), ('compressed', 0.002)] * 2:
            guard.record(key, way, seconds,
                         lambda times: (times.index(min(times)), times))
    assert guard.choices[key] == 'compressed'
    said = records_of(caplog, 'mnopt.communicators.compression_guard')
    assert said == ([] if WORLD.rank else [
        "mnopt: compression='auto': flat#0.sync (2 arrays from w1) is "
        'averaged compressed: plain 10.00 ms, compressed 2.00 ms (the '
        "slowest rank's best of 2; compressed must take under 95% of "
        'plain)'])


@needs_chainer
def test_snapshot_writes_are_logged_at_info(caplog, tmp_path):
    comm = mnopt.create_communicator('flat')
    out = str(tmp_path)   # each rank its own directory: each writes
    try:
        model = chainer.links.Linear(2, 2)
        opt = mnopt.create_multi_node_optimizer(chainer.optimizers.SGD(),
                                                comm)
        opt.setup(model)
        data = [(numpy.ones(2, numpy.float32), numpy.int32(0))] * 4
        updater = chainer.training.StandardUpdater(
            chainer.iterators.SerialIterator(data, 2), opt,
            loss_func=lambda x, t: chainer.functions.sum(model(x)))
        trainer = chainer.training.Trainer(updater, (2, 'iteration'),
                                           out=out)
        trainer.extend(mnopt.extensions.multi_node_snapshot(
            comm, chainer.training.extensions.snapshot(),
            list(range(comm.size))), trigger=(1, 'iteration'))
        with caplog.at_level(logging.INFO, logger='mnopt'):
            trainer.run()
    finally:
        comm.finalize()
    assert records_of(caplog, 'mnopt.extensions.multi_node_snapshot') == [
        'mnopt: rank %d wrote the snapshot of iteration %d: %s' % (
            comm.rank, i, os.path.join(out, 'snapshot_iter_%d.%d'
                                       % (i, comm.rank)))
        for i in (1, 2)]


def test_a_dict_of_gradients_gets_the_usual_error(debug_comm):
    """Only iterators are read into a list before the check: a dict
    reaches mean_grads as it was given, and its error says what to do."""
    with pytest.raises(TypeError, match=r'pass sorted\(grads.items\(\)\), '
                                        r'not a dict'):
        debug_comm.mean_grads({'w': numpy.zeros(2, numpy.float32)})
    assert debug_comm.allreduce_obj(1) == debug_comm.size
