"""Sharing a node's cores between its ranks.

NumPy's BLAS (OpenBLAS in the wheels) starts one thread per core it can
run on, in every process.  With several ranks on one node and no binding
(MPICH's mpiexec binds nothing by default), k ranks on c cores run k*c
BLAS threads, which spin while they wait for work: on 2 idle cores, 2 ranks
of the ImageNet example ran `make run` about 3x slower than with one BLAS
thread each (52 s against 17 s, docs/install.md).  PyTorch's launcher
sets OMP_NUM_THREADS=1 for the same reason.

So a communicator, when it is made, gives each rank of a node its share of
the cores it may run on: cores // ranks on the node (at least 1), or the
cores a binding left it.  The user's own choice stands: nothing changes
where OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS or
MNOPT_BLAS_THREADS is set (MNOPT_BLAS_THREADS=0 keeps the library's
default), nor where the script limited the threads itself (threadpoolctl)
before the communicator was made.  The limit is applied with
threadpoolctl, at run time (the BLAS library read its environment when
NumPy was imported); without threadpoolctl nothing changes.
"""

import os

from mnopt.common import _env

#: Set by the user, these settle the BLAS threads: mnopt leaves them be.
USER_SETTINGS = ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS',
                 'MKL_NUM_THREADS')


def usable_cores():
    """The cores this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def share(ranks_on_node, cores=None, machine_cores=None):
    """BLAS threads for one of ``ranks_on_node`` ranks: the cores it may
    run on, divided among the node's ranks unless a binding already gave
    it fewer than the whole machine."""
    cores = usable_cores() if cores is None else cores
    machine_cores = (os.cpu_count() or cores) if machine_cores is None \
        else machine_cores
    if cores < machine_cores:  # bound by the launcher: that is its share
        return max(1, cores)
    return max(1, cores // max(1, ranks_on_node))


def blas_threads_setting():
    """MNOPT_BLAS_THREADS: None (unset: share the cores), 0 (keep the
    library's default) or a number of threads."""
    return _env.whole_number('MNOPT_BLAS_THREADS', None, 0)


#: The limit mnopt applied last in this process (None: none yet).
_applied = None


def _limited_by_the_script(pools):
    """Whether the script itself limited a BLAS pool (threadpoolctl's
    ``threadpool_limits``, or the library's own call): it runs neither the
    library's default, one thread per core this process may run on
    (OpenBLAS counts the affinity mask), nor the limit mnopt set.  A
    library whose default is another count (MKL counts physical cores)
    reads as limited, and is left as it is."""
    return any(p['num_threads'] not in (usable_cores(), _applied)
               for p in pools)


def limit_blas_threads(ranks_on_node):
    """Limit this process's BLAS threads to its share of the node's cores
    (see the module's docstring); returns the limit applied, or None where
    nothing changed."""
    global _applied
    setting = blas_threads_setting()
    if setting == 0 or (setting is None and any(
            os.environ.get(name) for name in USER_SETTINGS)):
        return None
    threads = setting or share(ranks_on_node)
    try:
        import threadpoolctl
    except ImportError:
        return None
    pools = [p for p in threadpoolctl.threadpool_info()
             if p.get('user_api') == 'blas']
    if not pools or (setting is None and (
            all(p['num_threads'] <= threads for p in pools)
            or _limited_by_the_script(pools))):
        return None
    threadpoolctl.threadpool_limits(limits=threads, user_api='blas')
    _applied = threads
    return threads
