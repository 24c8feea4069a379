"""mnopt's shape holds: each folder of mnopt/ is one layer of
docs/architecture.md and says so, the top of mnopt/ is its public face
only, imports run down the layers, no module is in an import circle, none
imports another's private name, the Chainer layer reaches MPI only through
the communicator, each C extension lies beside the module that loads it,
files stay one idea each, and the architecture page draws the folders of
each layer and names every file.

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

#: The layers, bottom first: (name, its folders of mnopt/, the modules at
#: the top of mnopt/ that belong to it).  A module's layer is its folder's
#: (the folder right under mnopt/); the top of mnopt/ holds only the public
#: face (the package, ``python -m mnopt``, the ChainerMN and documented
#: modules, and the one-file commands), each listed here.  A module may
#: import its own layer and those below.  docs/architecture.md draws the
#: same table.
LAYERS = [
    ('leaves', ['common', 'stall', 'timeline', 'wire'],
     ['mnopt.global_except_hook', 'mnopt.wire_dtypes']),
    ('gpu', ['gpu'], []),
    ('transport', ['transport'], []),
    ('codecs', ['codecs'], []),
    ('server', ['server'], []),
    ('communicators', ['communicators', 'averaging'], []),
    ('chainer', ['optimizers', 'extensions', 'links', 'functions',
                 'iterators', 'datasets'], ['mnopt.zero']),
    ('entry points', ['benchmark', 'benchmarking', 'launch', 'report'],
     ['mnopt', 'mnopt.__main__', 'mnopt.check', 'mnopt.netsim']),
]
#: folder -> its layer; top-level module -> its layer.
FOLDER_LAYER = {f: i for i, (_, folders, _) in enumerate(LAYERS)
                for f in folders}
TOP_LAYER = {m: i for i, (_, _, tops) in enumerate(LAYERS) for m in tops}
CHAINER_LAYER = 'chainer'
#: What the Chainer layer may not import: it talks to the communicator.
BELOW_THE_COMMUNICATOR = ('mpi4py', 'mnopt.transport', 'mnopt.gpu',
                          'mnopt.server')
MAX_LINES = 400
#: mnopt's C extensions, each beside the module that loads it: leaves
#: (they import nothing of mnopt).
C_EXTENSIONS = ('mnopt.wire._halfcast', 'mnopt.codecs._signbits',
                'mnopt.transport._mpiwait', 'mnopt.stall._startwatch')


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
    """The layer of ``module`` (an index of LAYERS): its folder's, or for a
    module at the top of mnopt/ its own; None where it has none."""
    if module in TOP_LAYER:
        return TOP_LAYER[module]
    parts = module.split('.')
    if len(parts) > 1 and os.path.isdir(os.path.join(PACKAGE, parts[1])):
        return FOLDER_LAYER.get(parts[1])
    return None


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


def _folder(module):
    """The folder of mnopt/ that ``module`` lies in (None: the top)."""
    parts = module.split('.')
    return parts[1] if len(parts) > 2 or (
        len(parts) == 2 and _is_package(module)) else None


def _folder_pairs(edges):
    """Pairs of folders that import each other (one layer's folders too:
    within a layer one folder is put together from the other, never
    both ways)."""
    links = {(_folder(m), _folder(t)) for m, t, _, _ in edges
             if _folder(m) and _folder(t) and _folder(m) != _folder(t)}
    return sorted((a, b) for a, b in links if (b, a) in links and a < b)


def test_no_two_folders_import_each_other():
    assert _folder_pairs(EDGES) == []


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


def _c_files():
    """{dotted name: path} of every C extension's source in mnopt/."""
    found = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith('.c'):
                path = os.path.join(directory, name)
                found[os.path.relpath(path[:-2], REPO).replace(
                    os.sep, '.')] = path
    return found


def _folders():
    """The folders right under mnopt/ (packages)."""
    return sorted(name for name in os.listdir(PACKAGE) if os.path.isfile(
        os.path.join(PACKAGE, name, '__init__.py')))


def test_each_folder_is_in_one_layer():
    listed = [f for _, folders, _ in LAYERS for f in folders]
    assert sorted(listed) == sorted(set(listed)), 'a folder in two layers'
    assert sorted(listed) == _folders()


def test_the_top_of_mnopt_is_its_public_face_only():
    """Every module at the top of mnopt/ is one LAYERS lists by name."""
    top = sorted(m for m in MODULES if m.count('.') <= 1 and
                 not _is_package(m) or m == 'mnopt')
    assert top == sorted(TOP_LAYER)
    assert [n for n in os.listdir(PACKAGE) if n.endswith('.c')] == []


def _prefix(name):
    return name.lstrip('_').split('_')[0]


def test_no_three_top_level_names_share_a_prefix():
    """stall, stall_report, stall_settings... at the top is a folder
    missing (the names at the top of mnopt/: modules and folders)."""
    names = [n[:-3] if n.endswith('.py') else n
             for n in os.listdir(PACKAGE)
             if (n.endswith('.py') or n in _folders()) and
             not n.startswith('__')]
    by_prefix = {}
    for name in names:
        by_prefix.setdefault(_prefix(name), []).append(name)
    assert [sorted(v) for v in by_prefix.values() if len(v) >= 3] == []


@pytest.mark.parametrize('folder', sorted(FOLDER_LAYER))
def test_each_folder_says_its_concern_and_its_layer(folder):
    """Its __init__'s docstring names its layer: 'Layer N (name)'."""
    index = FOLDER_LAYER[folder]
    doc = _docstring('mnopt.' + folder)
    assert re.search(r'\bLayer %d \(%s\)' % (index, LAYERS[index][0]),
                     ' '.join(doc.split())), doc


def test_each_c_extension_lies_beside_the_module_that_loads_it():
    assert sorted(_c_files()) == sorted(C_EXTENSIONS)
    loaders = {}
    for module in MODULES:
        for target, _, line in _imports(module):
            if target in C_EXTENSIONS:
                loaders.setdefault(target, []).append(module)
    away = ['%s loaded by %s' % (c, m) for c, ms in loaders.items()
            for m in ms if m.rsplit('.', 1)[0] != c.rsplit('.', 1)[0]]
    assert away == []
    assert sorted(loaders) == sorted(C_EXTENSIONS)


def test_setup_builds_every_c_extension():
    setup = open(os.path.join(REPO, 'setup.py')).read()
    assert [c for c in C_EXTENSIONS if "'%s'" % c.replace('.', '/')
            not in setup] == []


#: The class paths snapshots record (local_steps' outer optimizer, by its
#: module path, compared at a resume): they stay where they are, so that a
#: snapshot written before a move still loads.
SNAPSHOT_CLASS_PATHS = ('mnopt.optimizers.outer_nesterov.OuterNesterov',)


def test_the_class_paths_snapshots_record_stay():
    for path in SNAPSHOT_CLASS_PATHS:
        module, name = path.rsplit('.', 1)
        tree = ast.parse(open(MODULES[module]).read())
        assert name in [n.name for n in tree.body
                        if isinstance(n, ast.ClassDef)], path


def test_the_architecture_page_names_every_file():
    page = open(ARCHITECTURE).read()
    paths = list(MODULES.values()) + list(_c_files().values())
    missing = [os.path.relpath(path, REPO) for path in paths
               if os.path.relpath(path, REPO) not in page]
    assert missing == []


@pytest.mark.parametrize('name', [layer for layer, _, _ in LAYERS])
def test_the_architecture_page_draws_every_layer(name):
    assert name in open(ARCHITECTURE).read()


def drawn_layers(page):
    """{layer index: (folders, top-level files)} as the page's picture (its
    first code block) draws them: a layer's rows run from its number to the
    next; a folder is written ``name/``, a top-level module ``name.py``."""
    picture = page.split('```', 2)[1]
    drawn, current = {}, None
    for row in picture.splitlines():
        m = re.match(r'\s{1,3}(\d)\s{2}', row)
        if m:
            current = int(m.group(1))
            drawn[current] = (set(), set())
        if current is None:
            continue
        drawn[current][0].update(re.findall(r'(?<![\w./])(\w+)/', row))
        drawn[current][1].update(re.findall(r'(?<![\w./])(\w+)\.py\b', row))
    return drawn


def test_the_architecture_page_draws_each_layers_folders():
    """The picture and LAYERS tell the same story: each layer's folders,
    and its modules at the top of mnopt/, in its rows."""
    assert _folder_pairs([
        ('mnopt.averaging.pipeline', 'mnopt.communicators.base', None, 1),
        ('mnopt.communicators.flat', 'mnopt.averaging.group', None, 1)]) \
        == [('averaging', 'communicators')]
    drawn = drawn_layers(open(ARCHITECTURE).read())
    assert sorted(drawn) == list(range(len(LAYERS)))
    for index, (name, folders, tops) in enumerate(LAYERS):
        files = {'__init__' if m == 'mnopt' else m.split('.', 1)[1]
                 for m in tops}
        assert drawn[index][0] == set(folders), name
        assert files <= drawn[index][1], name


def test_the_checks_can_fail(tmp_path, monkeypatch):
    """An upward import, a circle and a private import are each found;
    so are a folder's module in the wrong layer and loose modules at the
    top sharing a prefix."""
    assert layer_of('mnopt.transport.ring') < layer_of('mnopt.communicators')
    assert layer_of('mnopt.optimizers.factory') == [
        n for n, _, _ in LAYERS].index(CHAINER_LAYER)
    assert layer_of('mnopt.stall.watchdog') == 0
    assert layer_of('mnopt.averaging.pipeline') == \
        layer_of('mnopt.communicators.base')
    assert layer_of('mnopt.no_such_module') is None
    fake = [('mnopt.stall.monitor', 'mnopt.optimizers', None, 1)]
    assert [e for e in fake if layer_of(e[1]) > layer_of(e[0])] == fake
    assert _prefix('stall_report') == _prefix('stall') == \
        _prefix('stall_settings')
    drawn = drawn_layers('```\n  1  gpu   gpu/: kernels, extra/\n'
                         '        |\n  0  leaves   common/, a.py\n```\n')
    assert drawn == {1: ({'gpu', 'extra'}, set()), 0: ({'common'}, {'a'})}
