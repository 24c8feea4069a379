"""python -m mnopt.check: a launch described, its optional parts listed,
and its problems found."""

import re
import types

import pytest

from conftest import run_mpi
from mnopt import check

ROW = {'host': 'a', 'python': '3.11.7', 'numpy': '2.4.6', 'mpi4py': '4.1.2',
       'mpi': 'MPICH Version: 5.0.2', 'chainer': '7.8.1', 'cupy': None,
       'nccl': None, 'gpus': 0, 'thread_level': 'MPI_THREAD_MULTIPLE',
       'gpu_problem': "CuPy is not installed (pip install 'mnopt[gpu]')"}
#: A CPU install with every C loop built.
PARTS = [('_halfcast', 'C float16/bfloat16 codec', True, 'built'),
         ('_signbits', 'C sign codec', True, 'built'),
         ('_mpiwait', 'C MPI wait loop', True, 'built'),
         ('_startwatch', 'C watch of the start', True, 'built'),
         ('CuPy, NCCL', 'GPU arrays, pure_nccl', False, ROW['gpu_problem']),
         ('GPU kernels', "the GPU codec's CUDA", True,
          'not checked: no usable GPU')]
#: What every line of the check's output fits in.
COLUMNS = 80


def row(parts=PARTS, **fields):
    return dict(ROW, parts=list(parts), **fields)


def without(name, state='not built'):
    return [(p, what, False, state) if p == name else (p, what, ok, s)
            for p, what, ok, s in PARTS]


def test_agreeing_ranks_have_no_problems():
    rows = [(r, r % 2, 2, r // 2, row()) for r in range(4)]
    assert check.problems(rows) == []


def test_version_disagreement_is_a_problem():
    rows = [(r, 0, 1, r, row()) for r in range(3)]
    rows[2][4]['numpy'] = '1.26.4'
    assert check.problems(rows) == [
        'ranks disagree on numpy: 2.4.6 on ranks [0, 1]; 1.26.4 on ranks [2]']


def test_more_ranks_than_gpus_is_a_problem():
    rows = [(r, r, 4, 0, row(gpus=2, host='gpu1')) for r in range(4)]
    assert check.problems(rows) == [
        'node 0 (gpu1) runs 4 ranks but sees 2 GPU(s): one process per GPU '
        'for pure_nccl']


def test_the_thread_level_is_mpis_name_for_it():
    from mpi4py import MPI
    assert check.thread_level_name(MPI.THREAD_MULTIPLE) == \
        'MPI_THREAD_MULTIPLE'
    assert check.thread_level_name(MPI.THREAD_SINGLE) == 'MPI_THREAD_SINGLE'


def test_a_cpu_install_with_every_c_loop_has_no_warning():
    rows = [(r, 0, 1, r, row()) for r in range(2)]
    assert check.missing_parts(rows) == []
    assert check.fixes(rows) == []


def test_a_missing_c_loop_is_a_warning_with_its_cost_and_its_fix():
    rows = [(0, 0, 1, 0, row()), (1, 0, 1, 1, row(without('_halfcast')))]
    assert check.missing_parts(rows) == [
        '_halfcast (the C float16/bfloat16 codec) is not built on ranks [1]: '
        'the float16 and bfloat16 wires cast in numpy, about 10x slower.']
    fix, = check.fixes(rows)
    assert 'C compiler' in fix and 'pip install' in fix


def test_a_broken_gpu_stack_is_a_warning():
    # CuPy installed but unusable: the user meant to use GPUs.
    problem = 'CuPy 14.2.0 has no NCCL (...): pip install nvidia-nccl-cu13'
    rows = [(0, 0, 1, 0, row(without('CuPy, NCCL', problem),
                             cupy='cupy-cuda13x 14.2.0'))]
    assert check.missing_parts(rows) == [
        'GPUs are unusable on every rank: ' + problem]


def test_what_runs_says_which_wires_are_slow_without_their_c_loop():
    rows = [(0, 0, 1, 0, row(without('_halfcast')))]
    said = dict(check.runs_here(rows))
    assert said['communicators'].startswith(
        'naive, flat, hierarchical, reduction_server; not pure_nccl')
    assert said['wires'] == 'float32, float64, float16, bfloat16 (numpy ' \
                            'casts: slower)'
    assert said['compressions'] == 'sign, powersgd, auto'


def report_of(rows, found=()):
    comm = types.SimpleNamespace(size=len(rows),
                                 inter_size=len({r[3] for r in rows}))
    check.report(comm, rows, True, list(found), check.missing_parts(rows))


def test_the_report_ends_ok_only_when_every_part_is_there(capsys):
    report_of([(0, 0, 1, 0, row())])
    out = capsys.readouterr().out
    assert out.startswith('mnopt check: 1 rank on 1 node\n')
    assert 'mean of 1 rank ok' in out
    assert 'thread_level  MPI_THREAD_MULTIPLE' in out
    assert out.rstrip().endswith('\nmnopt check: OK')
    report_of([(0, 0, 1, 0, row(without('_mpiwait')))])
    out = capsys.readouterr().out
    assert 'WARNING: _mpiwait (the C MPI wait loop) is not built' in out
    assert out.rstrip().endswith('mnopt check: OK, 1 warning (see WARNING '
                                 'above)')


def test_the_report_fits_80_columns(capsys):
    long_host = 'a-node-with-a-long-name.cluster.example.org'
    rows = [(r, r % 2, 2, r // 2, row(without('_halfcast'), host=long_host))
            for r in range(4)]
    report_of(rows, found=['ranks disagree on numpy: ' + '2.4.6 ' * 20])
    out = capsys.readouterr().out
    assert 'mnopt check: 4 ranks on 2 nodes' in out
    assert [line for line in out.splitlines() if len(line) > COLUMNS] == []


def lines_over(text, columns=COLUMNS):
    return [line for line in text.splitlines() if len(line) > columns]


@pytest.mark.spawn
@pytest.mark.every_stack  # reports the MPI library's versions
def test_check_runs_under_mpiexec():
    proc = run_mpi(2, 'import runpy\nrunpy.run_module("mnopt.check", '
                      'run_name="__main__")\n', timeout=60,
                   env={'MNOPT_RANKS_PER_NODE': '1'})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'mnopt check: 2 ranks on 2 nodes' in proc.stdout
    assert 'averaging     flat, mean of 2 ranks ok' in proc.stdout
    assert re.search(r'^thread_level  MPI_THREAD_\w+$', proc.stdout, re.M)
    # OK, and as many warnings as the stack's missing parts (a stack with
    # CuPy but no GPU has one).
    warned = proc.stdout.count('\nWARNING: ')
    last = proc.stdout.rstrip().splitlines()[-1]
    assert last == 'mnopt check: OK' if not warned else \
        last.startswith('mnopt check: OK, %d warning' % warned), proc.stdout
    assert lines_over(proc.stdout) == []


NO_C_LOOPS = r'''
import runpy
import sys

# As where pip found no C compiler: importing them fails, so every user of
# them falls back (to numpy, or to waits polled from Python).
for name in ('wire._halfcast', 'codecs._signbits', 'transport._mpiwait',
             'stall._startwatch'):
    sys.modules['mnopt.' + name] = None
runpy.run_module('mnopt.check', run_name='__main__')
'''


@pytest.mark.spawn
def test_check_warns_where_the_c_loops_are_missing():
    proc = run_mpi(1, NO_C_LOOPS, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert 'mnopt check: 1 rank on 1 node' in out
    for part in ('_halfcast', '_signbits', '_mpiwait', '_startwatch'):
        assert re.search(r'^  %s .* not built$' % part, out, re.M), out
        assert 'WARNING: %s (the C ' % part in out, out
    assert 'float16, bfloat16 (numpy casts: slower)' in out
    assert 'FIX: to get the C loops: pip builds them where it finds a C ' \
           'compiler' in out
    assert 'mnopt check: OK\n' not in out + '\n'
    assert re.search(r'mnopt check: OK, [3-9] warnings \(see WARNING above\)'
                     r'\n$', out), out
    assert lines_over(out) == []
