"""The timeline window's steps are the job's: an optimizer's update()
calls over the whole job, restored by a resume from its snapshot (with
accumulation_steps, micro-steps included), so MNOPT_TIMELINE_STEPS
records the same steps in a resumed job as in one run straight through.
Under python -m mnopt.launch a restart keeps the failed attempt's
timeline file.  Serial (one rank, the whole averaging path run)."""

import os

import numpy
import pytest

chainer = pytest.importorskip('chainer', reason='resumes a Chainer optimizer')
import chainer.functions as F  # noqa: E402
import chainer.links as L  # noqa: E402

import mnopt  # noqa: E402
from mnopt.timeline import recorder as timeline  # noqa: E402
from mnopt.timeline import window as timeline_window  # noqa: E402

pytestmark = pytest.mark.one_rank


@pytest.fixture(autouse=True)
def averaging_at_one_rank(monkeypatch):
    monkeypatch.setenv('MNOPT_SINGLE_RANK_AVERAGING', '1')
    for name in (timeline.ENV, timeline_window.STEPS_ENV,
                 timeline_window.MAX_BYTES_ENV, timeline.RESTART_ENV):
        monkeypatch.delenv(name, raising=False)


def train(monkeypatch, trace, calls, steps=None, load=None, save=None,
          accumulation_steps=1):
    """``calls`` update() calls, recorded in ``trace`` (a window of
    ``steps`` where given), after loading the snapshot ``load``, before
    saving one to ``save``; the steps the trace holds."""
    monkeypatch.setenv(timeline.ENV, trace)
    if steps:
        monkeypatch.setenv(timeline_window.STEPS_ENV, steps)
    comm = mnopt.create_communicator('flat')
    model = L.Linear(3, 2, initialW=numpy.ones((2, 3), 'f'))
    opt = mnopt.create_multi_node_optimizer(
        chainer.optimizers.SGD(0.1), comm,
        accumulation_steps=accumulation_steps)
    opt.setup(model)
    if load:
        chainer.serializers.load_npz(load, opt)
    x = numpy.ones((2, 3), 'f')
    for _ in range(calls):
        opt.update(lambda: F.sum(model(x)))
    if save:
        chainer.serializers.save_npz(save, opt)
    comm.finalize()
    path = timeline.trace_path(trace, 0)
    return [e['args']['step'] for e in timeline.load(path)
            if e['name'] == 'step']


@pytest.mark.parametrize('accumulation_steps,first_calls', [(1, 6), (2, 5)])
def test_a_resumed_job_records_the_job_s_steps(monkeypatch, tmp_path,
                                               accumulation_steps,
                                               first_calls):
    snap = str(tmp_path / 'snap.npz')
    before = train(monkeypatch, str(tmp_path / 'a.json'), first_calls,
                   save=snap, accumulation_steps=accumulation_steps)
    assert before == list(range(first_calls))
    # Steps 7 and 8 of the job: the resumed run's second and third calls.
    after = train(monkeypatch, str(tmp_path / 'b.json'), 6,
                  steps='%d:%d' % (first_calls + 1, first_calls + 3),
                  load=snap, accumulation_steps=accumulation_steps)
    assert after == [first_calls + 1, first_calls + 2]


def test_a_snapshot_without_the_count_goes_on_from_its_updates(
        monkeypatch, tmp_path):
    snap = str(tmp_path / 'snap.npz')
    train(monkeypatch, str(tmp_path / 'a.json'), 6, save=snap)
    with numpy.load(snap) as saved:
        older = {k: saved[k] for k in saved.files if 'mnopt_updates' not in k}
    assert len(older) < len(numpy.load(snap).files)
    numpy.savez(snap, **older)
    # Its optimizer applied 5 updates (the first call broadcast).
    assert train(monkeypatch, str(tmp_path / 'b.json'), 2, load=snap) == \
        [5, 6]


def test_a_restart_keeps_the_failed_attempt_s_timeline(monkeypatch,
                                                       tmp_path):
    path = str(tmp_path / 'trace.rank0.json')
    first = timeline.Timeline(path, 0)
    first.instant('attempt 0')
    first.close()
    monkeypatch.setenv(timeline.RESTART_ENV, '1')
    second = timeline.Timeline(path, 0)
    second.instant('attempt 1')
    second.close()
    kept = str(tmp_path / 'trace.rank0.attempt0.json')
    assert [e['name'] for e in timeline.load(kept)
            if e['ph'] == 'i'] == ['attempt 0']
    assert [e['name'] for e in timeline.load(path)
            if e['ph'] == 'i'] == ['attempt 1']
