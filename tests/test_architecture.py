"""mnopt's shape holds: imports run down the layers of docs/architecture.md,
no module is in an import circle, none imports another's private name, the
Chainer layer reaches MPI only through the communicator, files stay one
idea each, and the architecture page names every file.

Read from the source with ``ast`` (every import, also those inside
functions), so the check needs nothing installed and runs anywhere."""

import ast
import os
import re

import pytest

from conftest import REPO

# The same at any number of ranks: the serial pass only (see the Makefile).
pytestmark = pytest.mark.one_rank

PACKAGE = os.path.join(REPO, 'mnopt')
ARCHITECTURE = os.path.join(REPO, 'docs', 'architecture.md')

#: The layers, bottom first.  A module belongs to the layer of the longest
#: prefix below that matches its dotted name; it may import its own layer
#: and those below.  docs/architecture.md draws the same table.
LAYERS = [
    ('leaves', ['mnopt._env', 'mnopt._sched', 'mnopt.log', 'mnopt.cores',
                'mnopt.stall', 'mnopt.stall_settings', 'mnopt.stall_report',
                'mnopt.stall_last_word',
                'mnopt.stall_watchdog', 'mnopt.arrays', 'mnopt.cli',
                'mnopt.launched',
                'mnopt.wire_dtypes', 'mnopt.timeline', 'mnopt.timeline_window',
                'mnopt.step_stats',
                'mnopt.global_except_hook', 'mnopt.failure_summary']),
    ('gpu', ['mnopt.gpu']),
    ('transport', ['mnopt.transport']),
    ('codecs', ['mnopt.grad_buffer', 'mnopt.sign', 'mnopt.overflow',
                'mnopt.powersgd']),
    ('server', ['mnopt.server', 'mnopt.server_protocol', 'mnopt.server_job',
                'mnopt.server_loop']),
    ('communicators', ['mnopt.communicators', 'mnopt.any_communicator']),
    ('chainer', ['mnopt.optimizers', 'mnopt.zero', 'mnopt.extensions',
                 'mnopt.links', 'mnopt.functions', 'mnopt.iterators',
                 'mnopt.datasets', 'mnopt.evaluator']),
    ('entry points', ['mnopt', 'mnopt.__main__', 'mnopt.check',
                      'mnopt.benchmark', 'mnopt.benchmarking',
                      'mnopt.netsim', 'mnopt.launch', 'mnopt.elastic',
                      'mnopt.elastic_hosts', 'mnopt.elastic_probe',
                      'mnopt.elastic_snapshots',
                      'mnopt.launch_attempt',
                      'mnopt.report',
                      'mnopt.report_rules', 'mnopt.report_plot',
                      'mnopt.trace_analysis',
                      'mnopt.tune']),
]
CHAINER_LAYER = 'chainer'
#: What the Chainer layer may not import: it talks to the communicator.
BELOW_THE_COMMUNICATOR = ('mpi4py', 'mnopt.transport', 'mnopt.gpu',
                          'mnopt.server')
MAX_LINES = 400
#: mnopt's C extensions: leaves (they import nothing of mnopt).
C_EXTENSIONS = ('mnopt._halfcast', 'mnopt._signbits', 'mnopt._mpiwait',
                'mnopt._startwatch')


def _modules():
    """{dotted name: path} of every Python file in mnopt/."""
    found = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith('.py'):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path[:-3], REPO).replace(os.sep, '.')
                if dotted.endswith('.__init__'):
                    dotted = dotted[:-len('.__init__')]
                found[dotted] = path
    return found


MODULES = _modules()


def _is_package(module):
    return MODULES[module].endswith('__init__.py')


def _imports(module):
    """(imported module, imported name or None, line) for every import of
    an mnopt module in ``module``; other imports as (name, None, line)."""
    tree = ast.parse(open(MODULES[module]).read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module if _is_package(module) else \
                    module.rsplit('.', 1)[0]
                for _ in range(node.level - 1):
                    base = base.rsplit('.', 1)[0]
                base = base + ('.' + node.module if node.module else '')
            else:
                base = node.module or ''
            for alias in node.names:
                child = base + '.' + alias.name
                if child in MODULES or child in C_EXTENSIONS:
                    found.append((child, None, node.lineno))
                else:
                    found.append((base, alias.name, node.lineno))
    return found


def _owner(name):
    """The mnopt module that ``name`` (a dotted import) lives in, or None
    for another library and for mnopt's C extensions."""
    if name in C_EXTENSIONS:
        return None
    while name and name not in MODULES:
        name = name.rsplit('.', 1)[0] if '.' in name else ''
    return name or None


def layer_of(module):
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            # The package itself ('mnopt') is its __init__ only.
            if module == prefix or (prefix != 'mnopt' and
                                    module.startswith(prefix + '.')):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    return None if best is None else best[0]


def _edges():
    """(importer, imported module, name, line) for imports between mnopt's
    own modules; a package's __init__ importing its children (re-exports)
    left out."""
    edges = []
    for module in MODULES:
        for target, name, line in _imports(module):
            owner = _owner(target)
            if owner is None or owner == module:
                continue
            if _is_package(module) and owner.startswith(module + '.'):
                continue
            edges.append((module, owner, name, line))
    return edges


EDGES = _edges()


def test_every_module_has_a_layer():
    assert [m for m in MODULES if layer_of(m) is None] == []


def test_imports_run_down_the_layers():
    upward = ['%s (%s) imports %s (%s), line %d' % (
        m, LAYERS[layer_of(m)][0], t, LAYERS[layer_of(t)][0], line)
        for m, t, _, line in EDGES if layer_of(t) > layer_of(m)]
    assert upward == []


def test_no_import_circle():
    graph = {m: sorted({t for s, t, _, _ in EDGES if s == m}) for m in MODULES}
    circles, state = [], {}

    def visit(node, path):
        state[node] = 'open'
        for target in graph[node]:
            if state.get(target) == 'open':
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = 'done'

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []


def test_no_import_of_another_modules_private_name():
    private = ['%s imports %s from %s, line %d' % (m, name, t, line)
               for m, t, name, line in EDGES
               if name and name.startswith('_') and not name.startswith('__')]
    assert private == []


def test_the_chainer_layer_talks_only_to_the_communicator():
    reached = []
    for module in MODULES:
        if LAYERS[layer_of(module)][0] != CHAINER_LAYER:
            continue
        for target, _, line in _imports(module):
            if target.startswith(BELOW_THE_COMMUNICATOR):
                reached.append('%s imports %s, line %d' % (module, target,
                                                          line))
    assert reached == []


def _docstring(module):
    return ast.get_docstring(ast.parse(open(MODULES[module]).read())) or ''


def test_every_file_says_its_job():
    assert [m for m in MODULES if not _docstring(m).strip()] == []


def test_files_stay_one_idea():
    """Over MAX_LINES only where the docstring says it is one idea."""
    long = []
    for module, path in MODULES.items():
        lines = sum(1 for _ in open(path))
        if lines > MAX_LINES and not re.search(
                r'\bone idea\b', _docstring(module), re.I):
            long.append('%s: %d lines' % (module, lines))
    assert long == []


def test_the_architecture_page_names_every_file():
    page = open(ARCHITECTURE).read()
    missing = [os.path.relpath(path, REPO) for path in MODULES.values()
               if os.path.relpath(path, REPO) not in page]
    assert missing == []


@pytest.mark.parametrize('name', [layer for layer, _ in LAYERS])
def test_the_architecture_page_draws_every_layer(name):
    assert name in open(ARCHITECTURE).read()


def test_the_checks_can_fail(tmp_path, monkeypatch):
    """An upward import, a circle and a private import are each found."""
    assert layer_of('mnopt.transport.ring') < layer_of('mnopt.communicators')
    assert layer_of('mnopt.optimizers.factory') == [
        n for n, _ in LAYERS].index(CHAINER_LAYER)
    fake = [('mnopt.stall', 'mnopt.optimizers', None, 1)]
    assert [e for e in fake if layer_of(e[1]) > layer_of(e[0])] == fake
