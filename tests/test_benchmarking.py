"""The benchmark library (mnopt/benchmark/) in process: what its
training modes hand to mnopt is what mnopt accepts."""

import types

import numpy
import pytest
from mpi4py import MPI

import mnopt
from conftest import needs_chainer

#: What every line the benchmark prints fits in.
COLUMNS = 80


def lines_over(text):
    return [line for line in text.splitlines() if len(line) > COLUMNS]


def test_the_progress_counts_the_repetitions_the_table_reports(
        capsys, monkeypatch):
    """The progress line once said 'repetition 1/7' for a table of '5
    repetitions': the 2 warm-up rounds are named as such."""
    from mnopt.benchmark import harness
    monkeypatch.setattr(harness, 'shows_progress', lambda: True)
    ran = []
    times = harness.run_cases([('case', 'kind', lambda: ran.append(1))],
                              MPI.COMM_SELF, 5)
    assert times.shape == (1, 5) and len(ran) == 5 + harness.WARMUP
    said = capsys.readouterr().err
    assert [r for r in ('warm-up 1/2', 'warm-up 2/2', 'repetition 1/5',
                        'repetition 5/5') if r not in said] == []
    assert '/7' not in said and 'repetition 6' not in said


def test_no_progress_line_where_stderr_is_no_terminal(capsys):
    """Piped or written to a file, the carriage returns of the progress
    line were kept among the output: it is drawn on a terminal only."""
    from mnopt.benchmark import harness
    assert not harness.shows_progress()   # capsys: no terminal
    harness.run_cases([('case', 'kind', lambda: None)], MPI.COMM_SELF, 3)
    said = capsys.readouterr()
    assert '\r' not in said.err + said.out
    assert 'repetition' not in said.err


LONG_LABEL = 'mnopt hierarchical bfloat16 (alltoall vote), checks off'


def test_the_averaging_table_says_its_repetitions_and_fits_80_columns(
        capsys):
    from mnopt.benchmark import cases, harness
    timed = [('limit: Allreduce, 16 MiB chunks', 'limit', None),
             ('mnopt flat float16', 'flat', None),
             (LONG_LABEL, 'hierarchical', None)]
    times = numpy.array([[0.2] * 5, [0.25] * 5, [1.2345] * 5])
    args = types.SimpleNamespace(reps=5, json=None)
    cases.report(timed, times, 25557096, types.SimpleNamespace(size=2),
                 args)
    out = capsys.readouterr().out
    assert '5 repetitions after %d warm-up' % harness.WARMUP in \
        out.replace('\n# ', ' ')
    assert lines_over(out) == [], out
    # A label longer than its column is on its own line, then its numbers.
    assert '\n%s\n ' % LONG_LABEL in out
    assert 'mnopt flat float16' in out and '1.25' in out   # x limit


def test_the_size_sweep_table_fits_80_columns(capsys):
    from mnopt.benchmark import sizes
    rows = [{'bytes': b, 'case': c, 'median_s': 0.5, 'min_s': 0.4,
             'max_s': 0.6, 'algbw_GBps': 1.5, 'busbw_GBps': 1.5}
            for b in (1024, 256 << 20)
            for c in ('mpi4py Allreduce', 'mnopt hierarchical bfloat16')]
    sizes.print_sweep(rows, types.SimpleNamespace(size=2))
    out = capsys.readouterr().out
    assert '256 MiB  mnopt hierarchical bfloat16' in out
    assert lines_over(out) == [], out


@needs_chainer
@pytest.mark.parametrize('double_buffering', [False, True])
def test_the_simulated_optimizer_is_a_chainer_optimizer(double_buffering):
    """--double-buffering and --scaling wrap it: create_multi_node_optimizer
    refuses what is not a chainer.Optimizer (it once was not)."""
    import chainer
    from mnopt.benchmark.training import simulated_update
    comm = mnopt.create_communicator('flat')
    try:
        link = chainer.links.Linear(3, 2)
        opt = mnopt.create_multi_node_optimizer(
            simulated_update(), comm,
            double_buffering=double_buffering).setup(link)
        for param in link.params():
            param.grad = param.array * 0 + 1
        for _ in range(3):
            opt.update()
        # The first update broadcasts the parameters; double buffering
        # applies each mean one update later.
        assert opt.t == (1 if double_buffering else 2), opt.t
    finally:
        comm.finalize()


def test_the_old_library_names_of_mnopt_benchmark_still_resolve():
    """Scripts written against mnopt.benchmark's library names (from when
    it was one module) find them, warned."""
    import importlib
    import mnopt.benchmark as package
    for name, module in package.MOVED.items():
        with pytest.warns(DeprecationWarning, match=name):
            found = getattr(package, name)
        assert found is getattr(importlib.import_module(
            'mnopt.benchmark.' + module), name)
    with pytest.raises(AttributeError):
        package.no_such_name
