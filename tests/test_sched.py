"""mnopt's communication threads ask the kernel for a short scheduler slice
(mnopt/common/_sched.py): what changes, and what must not."""

import os
import threading

import numpy
import pytest

import mnopt
from mnopt.common import _sched


def in_new_thread(fn):
    """fn() in a fresh thread (the settings under test are per thread)."""
    out = {}

    def run():
        try:
            out['value'] = fn()
        except BaseException as e:  # re-raised in the caller
            out['error'] = e
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if 'error' in out:
        raise out['error']
    return out['value']


# Linux 6.12+ reports every normal thread's slice (its default, nonzero);
# older kernels report 0 and ignore a request, other systems cannot say.
custom_slices = pytest.mark.skipif(
    not in_new_thread(_sched.thread_slice_ns),
    reason='this kernel has no per-thread scheduler slices (Linux < 6.12, '
           'or not Linux)')


@custom_slices
def test_background_averaging_thread_runs_with_the_short_slice():
    comm = mnopt.create_communicator('flat')
    grads = [('w', numpy.ones(8, numpy.float32))]
    comm.mean_grads_async(grads).wait()
    # The executor's one thread is the one that averaged.
    seen = comm._executor.submit(_sched.thread_slice_ns).result()
    assert seen == _sched.DEFAULT_SLICE_US * 1000
    assert in_new_thread(_sched.thread_slice_ns) != seen  # others untouched
    comm.finalize()


@custom_slices
def test_only_the_slice_changes():
    def niced_then_preferred():
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, 7)   # as `nice -n 7` would
        took = _sched.prefer_low_latency()
        return took, os.getpriority(os.PRIO_PROCESS, tid), \
            _sched.thread_slice_ns()

    took, nice, slice_ns = in_new_thread(niced_then_preferred)
    assert took
    assert nice == 7
    assert slice_ns == _sched.DEFAULT_SLICE_US * 1000


@custom_slices
def test_environment_sets_or_disables_the_slice(monkeypatch):
    default = in_new_thread(_sched.thread_slice_ns)
    monkeypatch.setenv('MNOPT_THREAD_SLICE_US', '250')
    assert in_new_thread(lambda: (_sched.prefer_low_latency(),
                                  _sched.thread_slice_ns())) == (True, 250000)
    monkeypatch.setenv('MNOPT_THREAD_SLICE_US', '0')
    assert in_new_thread(lambda: (_sched.prefer_low_latency(),
                                  _sched.thread_slice_ns())) == (False,
                                                                 default)


@pytest.mark.parametrize('value', ['fast', '-5', '1.5'])
def test_bad_slice_setting_fails_at_creation(monkeypatch, value):
    monkeypatch.setenv('MNOPT_THREAD_SLICE_US', value)
    with pytest.raises(ValueError, match='MNOPT_THREAD_SLICE_US'):
        mnopt.create_communicator('flat')


def test_elsewhere_nothing_happens(monkeypatch):
    monkeypatch.setattr(_sched, '_syscalls', lambda: None)
    assert _sched.prefer_low_latency() is False
    assert _sched.thread_slice_ns() is None
