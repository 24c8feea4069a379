"""Scheduling of mnopt's own threads: they wait on the network, so they
should run as soon as there is something to do, not get a fair share of a
busy core.

Why.  A background averaging is latency-bound: MPI moves a bucket in a few
dozen short bursts of progress (a rendezvous answered, a socket drained),
each needing the thread on a core right away.  Under MPI_THREAD_MULTIPLE,
MPICH's blocking calls yield the core after every poll, and Linux's EEVDF
scheduler (6.6 and later) answers each yield by pushing the thread's
deadline a whole slice later.  Next to a rank's compute thread on a busy
core the averaging thread then ran about once every 3.7 ms: measured on 2
simulated nodes at 500 Mbit/s (2 cores, one rank each), a 4 MiB bucket took
0.10 s during backward against 0.07 s alone, the thread runnable but not
running for 0.099 s of its 0.104.  Asking for a short slice (Linux 6.12+,
``sched_setattr``'s ``sched_runtime`` for normal threads, allowed without
privileges) makes each push small: the same bucket took 0.07 s during
backward, and backward's own CPU time did not grow.

Only the slice changes: policy, nice value and the rest are read first and
written back as they were.  Elsewhere (another OS, an older kernel, a
real-time policy) nothing happens.
"""

import ctypes
import functools
import platform
import sys

from mnopt.common import _env

#: Requested slice of mnopt's communication threads, microseconds; the
#: kernel accepts 100 to 100000.  MNOPT_THREAD_SLICE_US overrides it (0: leave
#: the scheduler's default).
DEFAULT_SLICE_US = 100

_SCHED_OTHER, _SCHED_BATCH, _SCHED_IDLE = 0, 3, 5

# sched_setattr / sched_getattr: x86-64, and the generic table (arm64,
# RISC-V, LoongArch).
_SYSCALLS = {'x86_64': (314, 315), 'aarch64': (274, 275),
             'arm64': (274, 275), 'riscv64': (274, 275),
             'loongarch64': (274, 275)}


class _SchedAttr(ctypes.Structure):
    # struct sched_attr, SCHED_ATTR_SIZE_VER1 (Linux 4.13+).
    _fields_ = [('size', ctypes.c_uint32), ('sched_policy', ctypes.c_uint32),
                ('sched_flags', ctypes.c_uint64),
                ('sched_nice', ctypes.c_int32),
                ('sched_priority', ctypes.c_uint32),
                ('sched_runtime', ctypes.c_uint64),
                ('sched_deadline', ctypes.c_uint64),
                ('sched_period', ctypes.c_uint64),
                ('sched_util_min', ctypes.c_uint32),
                ('sched_util_max', ctypes.c_uint32)]


def _syscalls():
    if not sys.platform.startswith('linux'):
        return None
    return _SYSCALLS.get(platform.machine())


def slice_us():
    """The slice to request, from MNOPT_THREAD_SLICE_US or the default."""
    return _env.whole_number('MNOPT_THREAD_SLICE_US', DEFAULT_SLICE_US, 0,
                             'microseconds')


def _get_attr(calls):
    """The calling thread's struct sched_attr, or None."""
    attr = _SchedAttr()
    # syscall() is variadic: give every argument its C type.
    if _libc().syscall(ctypes.c_long(calls[1]), ctypes.c_int(0),
                       ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr)),
                       ctypes.c_uint(0)) != 0:
        return None
    return attr


def _set_attr(calls, attr):
    return _libc().syscall(ctypes.c_long(calls[0]), ctypes.c_int(0),
                           ctypes.byref(attr), ctypes.c_uint(0)) == 0


@functools.lru_cache(maxsize=None)
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def thread_slice_ns():
    """The calling thread's requested slice in nanoseconds, or None where
    that cannot be read."""
    calls = _syscalls()
    attr = None if calls is None else _get_attr(calls)
    return None if attr is None else attr.sched_runtime


def prefer_low_latency():
    """Ask for a short scheduler slice for the calling thread (see the
    module's docstring).  Returns True where the kernel took it."""
    us = slice_us()
    calls = _syscalls()
    if not us or calls is None:
        return False
    attr = _get_attr(calls)
    if attr is None or attr.sched_policy not in (_SCHED_OTHER, _SCHED_BATCH,
                                                 _SCHED_IDLE):
        return False   # real-time or deadline: the slice means nothing
    attr.size = ctypes.sizeof(attr)
    attr.sched_flags &= 0x01   # SCHED_FLAG_RESET_ON_FORK, if it was set
    attr.sched_runtime = us * 1000
    if not _set_attr(calls, attr):
        return False
    now = _get_attr(calls)   # older kernels accept it and ignore it
    return now is not None and now.sched_runtime == us * 1000
