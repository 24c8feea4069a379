"""The documentation's links and paths resolve, and its pages read for users.

Pure file reading: every relative markdown link in README.md, CHANGELOG.md
and docs/**/*.md names a file or folder of the repository; every
``docs/...`` path named in the docs or in the code (mnopt/, examples/,
benchmarks/, tests/) exists; no page points outside the repository
('../shared/...', a DESIGN.md it does not hold) or cites this project's
internal issue numbers ('issue 23', '(#23)'; other projects' issues such as
horovod#1800 are fine).
"""

import glob
import os
import re

import pytest

# The same at any number of ranks: the serial pass only (see the Makefile).
pytestmark = pytest.mark.one_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rel(path):
    return os.path.relpath(path, ROOT).replace(os.sep, '/')


def _doc_pages():
    pages = [os.path.join(ROOT, 'README.md'), os.path.join(ROOT, 'CHANGELOG.md')]
    pages += sorted(glob.glob(os.path.join(ROOT, 'docs', '**', '*.md'),
                              recursive=True))
    return [p for p in pages if os.path.exists(p)]


def _code_files():
    files = []
    for top in ('mnopt', 'examples', 'benchmarks', 'tests'):
        for ext in ('py', 'sh', 'c', 'md', 'txt', 'cfg', 'toml'):
            files += glob.glob(os.path.join(ROOT, top, '**', '*.' + ext),
                               recursive=True)
    for name in ('setup.py', 'Makefile', 'pyproject.toml', 'setup.cfg'):
        if os.path.exists(os.path.join(ROOT, name)):
            files.append(os.path.join(ROOT, name))
    # Scratch scripts other tests spawn, and this file's own patterns.
    return sorted(f for f in files
                  if '.spawned_' not in f
                  and os.path.abspath(f) != os.path.abspath(__file__))


def _read(path):
    with open(path, encoding='utf-8') as f:
        return f.read()


_FENCE = re.compile(r'^(```|~~~).*?^\1', re.S | re.M)
_LINK = re.compile(r'!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)')
_REF_DEF = re.compile(r'^\s*\[[^\]]+\]:\s*(\S+)', re.M)


def _links(text):
    text = _FENCE.sub('', text)
    return _LINK.findall(text) + _REF_DEF.findall(text)


def _is_external(target):
    return (re.match(r'^[a-zA-Z][a-zA-Z0-9+.-]*:', target) is not None
            or target.startswith('#') or target.startswith('//'))


def test_relative_links_resolve():
    broken = []
    for page in _doc_pages():
        for target in _links(_read(page)):
            if _is_external(target):
                continue
            path = target.split('#', 1)[0].split('?', 1)[0]
            if not path:
                continue
            full = os.path.normpath(os.path.join(os.path.dirname(page), path))
            inside = full == ROOT or full.startswith(ROOT + os.sep)
            if not inside or not os.path.exists(full):
                broken.append('%s: %s' % (_rel(page), target))
    assert not broken, 'links that do not resolve:\n' + '\n'.join(broken)


# A docs/ path: 'docs/zero.md', 'docs/results/netsim/'.
_DOCS_PATH = re.compile(r'(?<![\w./-])docs/[\w./-]*[\w/-]')
# Written by the command that names it (the file is its output): its
# folder must exist.
_OUTPUT_FLAG = re.compile(r'(--json|--out|--output|-o|>)\s*$')


def _named_docs_paths(text):
    """(path, how it is checked): 'file', 'prefix' (completed by the shell
    or the code: docs/results/zero_memory_mlp_flat_n{2,3}.json, ..._n$n) or
    'output' (a command's output file)."""
    for m in _DOCS_PATH.finditer(text):
        path = m.group(0)
        following = text[m.end():m.end() + 1]
        before = text[max(0, m.start() - 20):m.start()]
        if _OUTPUT_FLAG.search(before):
            yield path, 'output'
        elif following in ('$', '{', '*', '%', '<') or path.endswith(('_', '-')):
            yield path, 'prefix'
        else:
            yield path.rstrip('.'), 'file'


def _exists(path, how):
    full = os.path.join(ROOT, path)
    if how == 'output':
        return os.path.isdir(os.path.dirname(full))
    if how == 'prefix':
        return bool(glob.glob(glob.escape(full) + '*'))
    return os.path.exists(full)


def test_named_docs_paths_exist():
    missing = []
    for f in _doc_pages() + _code_files():
        for path, how in _named_docs_paths(_read(f)):
            if not _exists(path, how):
                missing.append('%s: %s (%s)' % (_rel(f), path, how))
    assert not missing, 'docs/ paths that do not exist:\n' + '\n'.join(missing)


_CODE = re.compile(r'^(```|~~~).*?^\1|`[^`\n]*`', re.S | re.M)

_FORBIDDEN = [
    (re.compile(r'\.\./shared'), 'a path outside the repository'),
    (re.compile(r'DESIGN\.md'), 'a design document the repository lacks'),
    (re.compile(r'\bissues? \d+', re.I), "an internal issue number"),
    (re.compile(r'\bissues? #\d+', re.I), "an internal issue number"),
    # '#23' or '(#23)' on its own: this project's issue; 'horovod#1800' or
    # 'pytorch/pytorch#74148' (a name before the '#') is another project's.
    # (Outside code: a log line's 'mean_grads #17' counts operations.)
    (re.compile(r'(?<![\w/.-])#\d+\b'), "an internal issue number", 'prose'),
]


@pytest.mark.parametrize('page', [_rel(p) for p in _doc_pages()])
def test_pages_stay_inside_the_repository(page):
    text = _read(os.path.join(ROOT, page))
    found = []
    prose = _CODE.sub(lambda m: ' ' * len(m.group(0)), text)
    for pattern, why, *where in _FORBIDDEN:
        for m in pattern.finditer(prose if where else text):
            line = text.count('\n', 0, m.start()) + 1
            found.append('%s:%d: %r (%s)' % (page, line, m.group(0), why))
    assert not found, '\n'.join(found)


def test_the_halfcast_figure_agrees():
    """One figure for the C codec loops' speed-up over numpy, everywhere."""
    figures = {}
    for f in _doc_pages() + [os.path.join(ROOT, 'setup.py'),
                             os.path.join(ROOT, 'mnopt', 'cores.py')]:
        text = _read(f)
        for m in re.finditer(r'about\s+(\d+(?:\.\d+)?)x\s+slower', text):
            window = text[max(0, m.start() - 300):m.end()]
            if re.search(r'numpy|C extension|C loops', window):
                figures.setdefault(m.group(1), []).append(_rel(f))
    assert len(figures) <= 1, figures


_COMMIT = re.compile(
    r'(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])')


@pytest.mark.parametrize('page', sorted(
    _rel(p) for p in glob.glob(os.path.join(ROOT, 'docs', '*.md'))))
def test_user_pages_name_no_commits(page):
    """A user page says what to do and what to expect, with dates; which
    commit a figure was measured on belongs in CHANGELOG.md and
    docs/results/."""
    text = _read(os.path.join(ROOT, page))
    found = ['%s:%d: %s' % (page, text.count('\n', 0, m.start()) + 1, m.group(0))
             for m in _COMMIT.finditer(text)]
    assert not found, '\n'.join(found)
