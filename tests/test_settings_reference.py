"""docs/settings.md against the code: every keyword of create_communicator
and create_multi_node_optimizer, every communicator kind's own option,
every MNOPT_* variable the library (or its tests) reads and every option
of mnopt.server and mnopt.launch has exactly one row; no row names a
setting that no longer exists; each stated default is the code's; and
the "every rank the same" column says yes exactly for SHARED_SETTINGS."""

import ast
import glob
import inspect
import os
import re

import pytest

from conftest import chainer, needs_chainer

import mnopt
from mnopt import communicators
from mnopt.stall import settings as stall_settings
from mnopt.communicators import settings as settings_module
from mnopt.communicators.base import CommunicatorBase

# The same at any number of ranks: the serial pass only (see the Makefile).
pytestmark = pytest.mark.one_rank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(REPO, 'docs', 'settings.md')

KEYWORDS = 'create_communicator'
OPTIONS = 'Options of one communicator kind'
OPTIMIZER = 'create_multi_node_optimizer'
ENVIRONMENT = 'Environment variables'
SET_BY_MNOPT = 'Set by mnopt, for your script'
COMMAND_LINE = 'Command-line options'
TESTS_ONLY = "For mnopt's own tests only"
SECTIONS = (KEYWORDS, OPTIONS, OPTIMIZER, ENVIRONMENT, SET_BY_MNOPT,
            COMMAND_LINE, TESTS_ONLY)
#: Command-line tools whose options are settings, and the modules that
#: parse them.
TOOLS = {'mnopt.server': 'mnopt/server/process.py',
         'mnopt.launch': 'mnopt/launch/__main__.py'}
NAME = re.compile(r'MNOPT_[A-Z0-9_]+')
CODE = re.compile(r'`([^`]*)`')


def parse_tables(text):
    """{section heading: [row as {column: cell}]} of every table under a
    ``## `` heading; a row's 'name' is its first cell without backticks."""
    tables, section, header = {}, None, None
    for line in text.splitlines():
        if line.startswith('## '):
            section, header = line[3:].strip(), None
            continue
        if not line.startswith('|'):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip('|').split('|')]
        if header is None:
            header = cells
            continue
        if set(''.join(cells)) <= set('-: '):
            continue
        row = dict(zip(header, cells))
        row['name'] = cells[0].strip('`')
        tables.setdefault(section, []).append(row)
    return tables


@pytest.fixture(scope='module')
def tables():
    with open(PAGE) as f:
        found = parse_tables(f.read())
    assert set(SECTIONS) <= set(found), \
        'docs/settings.md lost a table: %s' % sorted(set(SECTIONS) -
                                                     set(found))
    return found


def rows(tables, section):
    named = [r['name'] for r in tables[section]]
    assert len(named) == len(set(named)), \
        'a setting has two rows in %r: %s' % (section, named)
    return {r['name']: r for r in tables[section]}


def parameters(function):
    return {name: p for name, p in inspect.signature(function).parameters
            .items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
            and name not in ('self', 'cls')}


def stated_default(cell):
    """The default a cell states: its first code span as a Python
    literal, or None where it says 'required'."""
    if cell.startswith('required'):
        return inspect.Parameter.empty
    spans = CODE.findall(cell)
    assert spans, 'no default in %r' % cell
    return ast.literal_eval(spans[0])


def same_set(in_code, in_table, what):
    missing = sorted(set(in_code) - set(in_table))
    stale = sorted(set(in_table) - set(in_code))
    assert not missing and not stale, (
        '%s: without a row in docs/settings.md: %s; rows for what the code '
        'no longer has: %s' % (what, missing, stale))


def kinds():
    return {name: communicators.communicator_class(name)
            for name in communicators._REGISTRY}


def base_options():
    return parameters(CommunicatorBase.check_arguments)


# -- every setting has a row, every row a setting ---------------------------

def test_every_create_communicator_keyword_has_a_row(tables):
    keywords = parameters(mnopt.create_communicator)
    same_set(keywords, rows(tables, KEYWORDS), 'create_communicator')
    # What create_communicator passes through to every kind is its own.
    assert set(base_options()) <= set(keywords)


def test_every_option_of_a_communicator_kind_has_a_row(tables):
    base = base_options()
    own = {}
    for kind, cls in kinds().items():
        for name in parameters(cls.check_arguments):
            if name not in base:
                own.setdefault(name, set()).add(kind)
    table = rows(tables, OPTIONS)
    same_set(own, table, 'communicator options')
    for name, kinds_taking_it in own.items():
        stated = set(CODE.findall(table[name]['communicator']))
        assert stated == kinds_taking_it, (name, stated, kinds_taking_it)


@needs_chainer   # create_multi_node_optimizer is of the Chainer layer
def test_every_create_multi_node_optimizer_keyword_has_a_row(tables):
    same_set(parameters(mnopt.create_multi_node_optimizer),
             rows(tables, OPTIMIZER), 'create_multi_node_optimizer')


def names_in(patterns):
    found = set()
    for pattern in patterns:
        for path in glob.glob(os.path.join(REPO, pattern), recursive=True):
            if os.path.basename(path).startswith('.') or \
                    not os.path.isfile(path):
                continue   # a test's spawned script, not a source
            with open(path, errors='replace') as f:
                found.update(NAME.findall(f.read()))
    return found


def library_names():
    return names_in(['mnopt/**/*.py', 'mnopt/**/*.c'])


def test_every_environment_variable_of_the_library_has_a_row(tables):
    read = rows(tables, ENVIRONMENT)
    written = rows(tables, SET_BY_MNOPT)
    assert not set(read) & set(written)
    same_set(library_names(), set(read) | set(written), 'MNOPT_* in mnopt/')


def test_every_variable_of_the_tests_has_a_row(tables):
    used = names_in(['tests/*.py', 'benchmarks/**/*', 'examples/**/*.py',
                     'Makefile']) - library_names()
    same_set(used, rows(tables, TESTS_ONLY), 'MNOPT_* of the tests only')


def command_line_options():
    """{(tool, --option): default} from the add_argument calls."""
    import importlib
    options = {}
    for tool, path in TOOLS.items():
        module = importlib.import_module(path[:-3].replace('/', '.'))
        with open(os.path.join(REPO, path)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and
                    getattr(node.func, 'attr', None) == 'add_argument'
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).startswith('--')):
                continue
            keywords = {k.arg: k.value for k in node.keywords}
            if 'default' in keywords:
                value = keywords['default']
                default = getattr(module, value.id) \
                    if isinstance(value, ast.Name) \
                    else ast.literal_eval(value)
            else:
                action = ast.literal_eval(keywords.get('action',
                                                       ast.Constant(None)))
                default = {'store_true': False,
                           'store_false': True}.get(action)
            options[(tool, node.args[0].value)] = default
    return options


def test_every_command_line_option_has_a_row_and_its_default(tables):
    in_code = command_line_options()
    table = {(CODE.findall(r['tool'])[0], r['name']): r
             for r in tables[COMMAND_LINE]}
    same_set(in_code, table, 'command-line options')
    for key, default in in_code.items():
        assert stated_default(table[key]['default']) == default, key


# -- defaults ------------------------------------------------------------------

def test_keyword_defaults_are_the_codes(tables):
    base = base_options()
    for name, p in parameters(mnopt.create_communicator).items():
        default = p.default
        # None there means "the communicator's default": bucket_bytes.
        if default is None and name in base:
            default = base[name].default
        stated = stated_default(rows(tables, KEYWORDS)[name]['default'])
        assert stated == default, (name, stated, default)
    table = rows(tables, OPTIONS)
    for kind, cls in kinds().items():
        for name, p in parameters(cls.check_arguments).items():
            if name in table:
                stated = stated_default(table[name]['default'])
                assert stated == p.default, (kind, name, stated, p.default)
    if chainer is None:
        return   # the optimizer's keywords: on the stacks with Chainer
    table = rows(tables, OPTIMIZER)
    for name, p in parameters(mnopt.create_multi_node_optimizer).items():
        stated = stated_default(table[name]['default'])
        assert stated == p.default, (name, stated, p.default)


def test_environment_defaults_are_the_codes(tables, monkeypatch):
    for name in library_names():
        monkeypatch.delenv(name, raising=False)
    unset = dict(settings_module.environment_settings())
    unset['MNOPT_STALL_WARNING'], unset['MNOPT_TIMEOUT'] = stall_settings.settings()
    table = rows(tables, ENVIRONMENT)
    assert set(unset) <= set(table)
    for name, value in unset.items():
        cell = table[name]['default']
        if value is None:
            assert cell.startswith('unset'), (name, cell)
            continue
        stated = CODE.findall(cell)[0]
        if isinstance(value, bool):
            assert stated == ('1' if value else '0'), (name, cell)
        elif isinstance(value, (int, float)):
            assert float(stated) == value, (name, cell, value)
        else:
            assert stated == value, (name, cell, value)


# -- which settings every rank must share --------------------------------------

def test_the_shared_column_is_shared_settings(tables):
    shared = settings_module.SHARED_SETTINGS
    seen = set()
    for section in (KEYWORDS, OPTIONS, ENVIRONMENT):
        for name, row in rows(tables, section).items():
            key = 'communicator' if name == 'communicator_name' else name
            says_yes = row['every rank the same'].startswith('yes')
            assert says_yes == (key in shared), (
                '%s: the table says %r, SHARED_SETTINGS %s it'
                % (name, row['every rank the same'],
                   'lists' if key in shared else 'does not list'))
            seen.add(key)
    assert set(shared) <= seen


def test_the_page_is_linked_and_its_links_resolve():
    for index in ('README.md', 'docs/index.md'):
        with open(os.path.join(REPO, index)) as f:
            assert 'settings.md' in f.read(), index
    with open(PAGE) as f:
        text = f.read()
    for target in re.findall(r'\]\(([^)#]+)', text):
        assert os.path.exists(os.path.join(REPO, 'docs', target)), target


def test_a_missing_row_is_found():
    """The checker itself: a page without one row fails it."""
    with open(PAGE) as f:
        text = f.read()
    lines = [line for line in text.splitlines()
             if not line.startswith('| `MNOPT_TIMEOUT`')
             and not line.startswith('| `window`')]
    tables = parse_tables('\n'.join(lines))
    with pytest.raises(AssertionError, match='MNOPT_TIMEOUT'):
        test_every_environment_variable_of_the_library_has_a_row(tables)
    with pytest.raises(AssertionError, match='window'):
        test_every_option_of_a_communicator_kind_has_a_row(tables)
