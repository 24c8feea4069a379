"""Check a launch: who runs where, on what, and whether averaging works.

    mpiexec -n 2 python -m mpi4py -m mnopt.check      (or srun python -m ...)

Rank 0 prints one line per rank (host, node, rank in node, GPU it would
use), the versions every rank runs (Python, NumPy, mpi4py, the MPI
library, Chainer, CuPy, NCCL) and MPI's thread level; then mnopt's
optional parts, one line each (its C loops: the float16/bfloat16 codec,
the sign codec, the MPI wait loop; CuPy with NCCL; the GPU kernels), and
which communicators, wires and compressions this install runs.  Last it
averages one small gradient on the ``flat`` communicator and checks the
mean.

It ends with ``mnopt check: OK`` (exit 0) when everything is there and
works; ``mnopt check: OK, N warning(s)`` (exit 0) when training works but
an optional part is missing, with one ``WARNING:`` line each saying what
is slower and how to get the part; or with one ``PROBLEM:`` line each
(exit 1): ranks running different versions, more ranks on a node than
GPUs where GPUs are used, a wrong mean, a process alone in its MPI world
though its environment says the job has several (started without its
launcher, or with another MPI library's).
"""

import importlib
import os
import platform
import socket
import sys
import textwrap

import numpy

from mnopt.common import cli

#: Output lines stay within a terminal's 80 columns.
WIDTH = 79

#: mnopt's C loops: (name, what it is, what runs without it).  setup.py
#: compiles them where it finds a C compiler and skips them silently
#: where it does not; mnopt then computes the same in numpy or Python.
C_LOOPS = (
    ('_halfcast', 'C float16/bfloat16 codec',
     'the float16 and bfloat16 wires cast in numpy, about 10x slower'),
    ('_signbits', 'C sign codec',
     "compression='sign' packs signs and counts votes in numpy, slower"),
    ('_mpiwait', 'C MPI wait loop',
     'waits poll MPI from Python: they hold the GIL and use a core'),
    ('_startwatch', 'C watch of the start',
     "a rank's failing exit before MPI starts leaves the others waiting "
     'until MNOPT_TIMEOUT; Ctrl-C in MPI\'s start waits for every rank'),
)
#: Where each C loop lives: beside the module that loads it.
C_LOOP_MODULES = {'_halfcast': 'mnopt.wire._halfcast',
                  '_signbits': 'mnopt.codecs._signbits',
                  '_mpiwait': 'mnopt.transport._mpiwait',
                  '_startwatch': 'mnopt.stall._startwatch'}
HOW_TO_BUILD = ('pip builds them where it finds a C compiler: install one '
                '(gcc: apt install build-essential, or dnf install gcc) and '
                "reinstall mnopt from its source without pip's cache (pip "
                'install --no-cache-dir --force-reinstall --no-deps ., or '
                'pip install -e . in a checkout), or install a wheel built '
                'where a compiler is (pip wheel --no-deps .)')
KERNELS_HINT = ("CuPy compiles mnopt's GPU kernels with NVRTC: pip install "
                'nvidia-cuda-nvrtc-cu12 (CuPy 13) or nvidia-cuda-nvrtc-cu13 '
                '(CuPy 14)')
CPU_COMMUNICATORS = ('naive', 'flat', 'hierarchical', 'reduction_server')
THREAD_LEVELS = ('THREAD_SINGLE', 'THREAD_FUNNELED', 'THREAD_SERIALIZED',
                 'THREAD_MULTIPLE')


def _version(module):
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or fails to import
        return None


def thread_level_name(level):
    """MPI's name of a thread level (``MPI_THREAD_MULTIPLE``)."""
    from mpi4py import MPI
    for name in THREAD_LEVELS:
        if getattr(MPI, name) == level:
            return 'MPI_' + name
    return str(level)


def c_loop_state(name):
    """(in use, what the check says) for C loop ``name`` of C_LOOPS."""
    try:
        importlib.import_module(C_LOOP_MODULES[name])
    except ImportError:
        return False, 'not built'
    if name == '_halfcast':
        from mnopt.wire import dtypes as wire_dtypes
        if wire_dtypes.halfcast is None:
            return False, 'built from older sources: unused'
    if name == '_mpiwait':
        from mnopt.transport import waiting
        try:
            kind = waiting.kind()
        except ValueError as e:  # a bad MNOPT_WAIT
            return False, str(e)
        if kind != 'c':
            if os.environ.get('MNOPT_WAIT') == 'python':
                return True, 'built; off (MNOPT_WAIT=python)'
            return False, 'built, unused: no MPI_Testsome in the MPI library'
    return True, 'built'


def gpu_kernels_state(gpu_problem):
    """(works, what the check says) for the GPU codec's kernels: one
    float32 array through the float16 wire and back on the GPU."""
    if gpu_problem is not None:
        return True, 'not checked: no usable GPU'
    try:
        from mnopt.gpu import codec, device
        cp = device.cupy()
        grads = cp.arange(8, dtype=cp.float32)
        wire = cp.zeros(8, cp.float16)
        gpu_codec = codec.Codec('float16', [8], [0])
        gpu_codec.pack([grads], wire, 2.0)
        back = cp.zeros(8, cp.float32)
        gpu_codec.unpack(wire, [back])
        if not bool((back == grads / 2).all()):
            return False, 'compiled, but a round trip gave wrong values'
    except Exception as e:  # NVRTC missing, a compile error, ...
        return False, 'failed (%s: %s); %s' % (type(e).__name__, e,
                                               KERNELS_HINT)
    return True, 'compiled and ran'


def describe_process():
    """What this process runs on, as a dict of strings and numbers."""
    from mpi4py import MPI
    from mnopt.gpu import device, diagnosis
    cupys = diagnosis.cupy_distributions()
    info = {
        'host': socket.gethostname(),
        'python': platform.python_version(),
        'numpy': numpy.__version__,
        'mpi4py': _version('mpi4py'),
        'mpi': ' '.join(MPI.Get_library_version().split()[:3]),
        'thread_level': thread_level_name(MPI.Query_thread()),
        'chainer': _version('chainer'),
        'cupy': ', '.join('%s %s' % kv for kv in sorted(cupys.items()))
        or None,
        'nccl': None, 'gpus': 0,
        'gpu_problem': diagnosis.gpu_problem(),
        'cuda_visible_devices': os.environ.get('CUDA_VISIBLE_DEVICES'),
    }
    if info['gpu_problem'] is None:
        cupy = device.cupy()
        from cupy.cuda import nccl
        info['nccl'] = nccl.get_version()
        info['gpus'] = cupy.cuda.runtime.getDeviceCount()
    info['parts'] = optional_parts(info)
    return info


def optional_parts(info):
    """[(part, what it is, present, state)] of this process: the C
    loops, CuPy with NCCL, the GPU kernels."""
    parts = [(name, what) + c_loop_state(name) for name, what, _ in C_LOOPS]
    problem = info['gpu_problem']
    gpu = 'CuPy %s, NCCL %s, %d GPU(s)' % (
        info['cupy'], info['nccl'], info['gpus']) if problem is None \
        else problem
    parts.append(('CuPy, NCCL', 'GPU arrays, pure_nccl', problem is None,
                  gpu))
    parts.append(('GPU kernels', "the GPU codec's CUDA",)
                 + gpu_kernels_state(problem))
    return parts


#: Fields every rank must agree on.
SAME_EVERYWHERE = ('python', 'numpy', 'mpi4py', 'mpi', 'chainer', 'cupy',
                   'nccl')


def problems(rows):
    """Lines describing what is wrong with a launch, from every rank's
    (rank, intra_rank, intra_size, node, info)."""
    out = []
    for field in SAME_EVERYWHERE:
        values = {}
        for rank, _, _, _, info in rows:
            values.setdefault(info[field], []).append(rank)
        if len(values) > 1:
            out.append('ranks disagree on %s: %s' % (field, '; '.join(
                '%s on ranks %s' % (v, r) for v, r in sorted(
                    values.items(), key=lambda kv: kv[1][0]))))
    for rank, intra_rank, intra_size, node, info in rows:
        if info['gpus'] and intra_size > info['gpus']:
            out.append('node %d (%s) runs %d ranks but sees %d GPU(s): one '
                       'process per GPU for pure_nccl' % (
                           node, info['host'], intra_size, info['gpus']))
            break
    return out


def _ranks_lacking(rows, index):
    """{state: [ranks]} of the ranks whose optional part ``index`` is
    missing or broken."""
    lacking = {}
    for rank, _, _, _, info in rows:
        _, _, present, state = info['parts'][index]
        if not present:
            lacking.setdefault(state, []).append(rank)
    return lacking


def fixes(rows):
    """How to get the optional parts missing on some rank (one line for
    all the C loops)."""
    lacking_c = any(_ranks_lacking(rows, index)
                    for index in range(len(C_LOOPS)))
    return ['to get the C loops: %s.' % HOW_TO_BUILD] if lacking_c else []


def missing_parts(rows):
    """One line per optional part missing on some rank: which ranks,
    and what is slower or unavailable without it."""
    out = []
    n_ranks = len(rows)
    for index, (part, what, _, _) in enumerate(rows[0][4]['parts']):
        for state, ranks in sorted(_ranks_lacking(rows, index).items()):
            where = 'on every rank' if len(ranks) == n_ranks else \
                'on ranks %s' % ranks
            if index < len(C_LOOPS):
                out.append('%s (the %s) is %s %s: %s.' % (
                    part, what, state, where, C_LOOPS[index][2]))
            elif part == 'CuPy, NCCL':
                if rows[0][4]['cupy'] is None and len(ranks) == n_ranks:
                    continue   # a CPU install: the table row says it
                out.append('GPUs are unusable %s: %s' % (where, state))
            else:
                out.append('%s: %s %s' % (part, state, where))
    return out


def runs_here(rows):
    """[(what, the names this install runs)]: communicators, wires and
    compressions, on every rank."""
    everywhere = {part: all(r[4]['parts'][i][2] for r in rows)
                  for i, (part, _, _, _) in enumerate(rows[0][4]['parts'])}
    communicators = ', '.join(CPU_COMMUNICATORS)
    if everywhere['CuPy, NCCL'] and everywhere['GPU kernels']:
        communicators += ', pure_nccl'
    else:
        communicators += '; not pure_nccl (it needs CuPy, NCCL and a GPU)'
    slow = '' if everywhere['_halfcast'] else ' (numpy casts: slower)'
    return [('communicators', communicators),
            ('wires', 'float32, float64, float16, bfloat16' + slow),
            ('compressions', "sign%s, powersgd, auto" % (
                '' if everywhere['_signbits'] else ' (numpy: slower)'))]


def _say(label, text):
    """``label`` then ``text``, wrapped within WIDTH columns under it."""
    print(textwrap.fill(text, WIDTH, initial_indent='%-14s' % label,
                        subsequent_indent=' ' * 14,
                        break_on_hyphens=False, break_long_words=False))


def report(comm, rows, averaged_right, found, warned):
    """Rank 0's report (module docstring)."""
    print('mnopt check: %s on %s' % (_count(comm.size, 'rank'),
                                     _count(comm.inter_size, 'node')))
    print('%5s  %-24s %4s %9s %5s  %s' % ('rank', 'host', 'node',
                                          'in node', 'GPU', 'GPUs seen'))
    for rank, intra_rank, intra_size, node, row in rows:
        device = intra_rank % row['gpus'] if row['gpus'] else '-'
        print('%5d  %-24s %4d %4d of %-2d %5s  %s' % (
            rank, row['host'][:24], node, intra_rank, intra_size, device,
            row['gpus'] or 'none'))
    first = rows[0][4]
    for field in SAME_EVERYWHERE + ('thread_level',):
        _say(field, str(first[field] if first[field] is not None
                        else 'not installed'))
    print('optional parts (rank 0):')
    for part, what, present, state in first['parts']:
        print(textwrap.fill(state, WIDTH, initial_indent='  %-12s %-25s '
                            % (part, what), subsequent_indent=' ' * 41,
                            break_on_hyphens=False, break_long_words=False))
    for what, names in runs_here(rows):
        _say(what, names)
    _say('averaging', 'flat, mean of %s %s' % (
        _count(comm.size, 'rank'), 'ok' if averaged_right else 'WRONG'))
    for label, lines in (('WARNING: ', warned), ('FIX: ', fixes(rows)),
                         ('PROBLEM: ', found)):
        for line in lines:
            print(textwrap.fill(line, WIDTH, initial_indent=label,
                                subsequent_indent='    ',
                                break_on_hyphens=False,
                                break_long_words=False))
    if found:
        print('mnopt check: %d problem(s)' % len(found))
    elif warned:
        print('mnopt check: OK, %s (see WARNING above)' % _count(
            len(warned), 'warning'))
    else:
        print('mnopt check: OK')


def _count(n, noun):
    return '%d %s%s' % (n, noun, '' if n == 1 else 's')


def parser():
    import argparse
    return argparse.ArgumentParser(
        prog='python -m mnopt.check',
        description=__doc__.split('\n')[0],
        epilog=cli.help_epilog(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter)


def main(argv=None):
    # No options but --help: which must print the help, not run the check.
    cli.parse_args(parser(), argv)
    from mpi4py import MPI
    import mnopt
    from mnopt.stall import launched
    world = MPI.COMM_WORLD
    comm = mnopt.create_communicator('flat')
    info = describe_process()
    rows = comm.allgather_obj((comm.rank, comm.intra_rank, comm.intra_size,
                               comm.inter_rank, info))
    grads = [('check', numpy.full(3, float(comm.rank), numpy.float32))]
    comm.mean_grads(grads)
    means = comm.allgather_obj(grads[0][1].tolist())
    found = problems(rows)
    alone = launched.problem(os.environ, world.Get_size())
    if alone is not None:
        found.append(alone)
    want = (comm.size - 1) / 2.0
    averaged_right = all(m == [want] * 3 for m in means)
    if not averaged_right:
        found.append('averaging gave %s, not %s on every rank' % (means, want))
    if world.rank == 0:
        report(comm, rows, averaged_right, found, missing_parts(rows))
        sys.stdout.flush()
    comm.finalize()
    return 1 if found else 0


if __name__ == '__main__':
    sys.exit(main())
