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
                             os.path.join(ROOT, 'mnopt', 'common', 'cores.py')]:
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


# -- user pages: what to do and what to expect; dates go to the history -----

_DATE = re.compile(r'\b20\d\d-[01]\d-[0-3]\d\b')
# benchmarks.md may date a table's figures, in one sentence that says so
# ('Measured on 2026-11-25, ...'), at most one such sentence per table;
# earlier figures are in docs/results/history.md.
_DATED_PAGES = ('docs/benchmarks.md',)
_MEASURED_ON = re.compile(r'^Measured on\b')
_TABLE_RULE = re.compile(r'^\|(\s*:?-{3,}:?\s*\|)+\s*$', re.M)


def _user_pages():
    pages = [os.path.join(ROOT, 'README.md')]
    pages += sorted(glob.glob(os.path.join(ROOT, 'docs', '*.md')))
    return [_rel(p) for p in pages]


def _line(text, at):
    return text.count('\n', 0, at) + 1


def _sentence_start(text, at):
    """Where the sentence holding ``text[at]`` begins: after the last full
    stop followed by a space, or blank line, before it."""
    ends = [m.end() for m in re.finditer(r'\.\s+|\n\s*\n', text[:at])]
    return ends[-1] if ends else 0


def _misdated(page, text):
    """The dates a page should not carry: on a user page any date; on
    benchmarks.md a date outside a 'Measured on ...' sentence, or more
    such sentences than tables."""
    if page not in _DATED_PAGES:
        return ['%s:%d: %s' % (page, _line(text, m.start()), m.group(0))
                for m in _DATE.finditer(text)]
    found, sentences = [], set()
    for m in _DATE.finditer(text):
        start = _sentence_start(text, m.start())
        if _MEASURED_ON.match(text[start:].lstrip()):
            sentences.add(start)
        else:
            found.append('%s:%d: %s (not in a "Measured on" sentence)'
                         % (page, _line(text, m.start()), m.group(0)))
    tables = len(_TABLE_RULE.findall(text))
    if len(sentences) > tables:
        found.append('%s: %d "Measured on" sentences for %d tables'
                     % (page, len(sentences), tables))
    return found


@pytest.mark.parametrize('page', _user_pages())
def test_user_pages_carry_no_dated_measurements(page):
    """A figure on a user page is the current one, its command in
    docs/benchmarks.md#current-figures, where one 'Measured on' sentence
    per table dates it; what it was before, and when, is in
    docs/results/history.md and CHANGELOG.md."""
    found = _misdated(page, _read(os.path.join(ROOT, page)))
    assert not found, ('dated measurements on a user page (move them to '
                       'docs/results/history.md):\n' + '\n'.join(found))


def test_benchmarks_md_dates_only_its_tables():
    """The checker itself: on benchmarks.md a table's 'Measured on'
    sentence passes; a rerun's date in prose fails, and so does a second
    dated sentence for one table."""
    table = '| case | s |\n|---|---|\n| flat | 1.0 |\n'
    page = 'docs/benchmarks.md'
    assert not _misdated(page, 'Measured on 2026-11-25, 3 runs.\n\n' + table)
    assert _misdated(page, 'Rerun 2026-11-25: 1.84x slower.\n\n' + table)
    assert _misdated(page, 'Measured on 2026-11-25.  Measured on '
                     '2026-11-22 too.\n\n' + table)
    assert _misdated('docs/zero.md', 'Measured on 2026-11-25.\n\n' + table)


# -- every ratio says which way it goes -------------------------------------

# A ratio: '1.84x', '1.64-1.87x', '2×' (not '1024x1024', '0x1f').
_RATIO = re.compile(r'(?<![\w.])\d+(?:\.\d+)?(?:\s*[-–]\s*\d+(?:\.\d+)?)?'
                    r'[x×](?![\w])')
# Which way it goes, said in words...
_DIRECTION = re.compile(
    r'\b(?:faster|slower|quicker|fewer|more|less|larger|smaller|longer|'
    r'shorter|higher|lower|bigger|greater|speed-?ups?|slow-?downs?|'
    r'as (?:long|much|many|fast|large|big)|the size of|times)\b', re.I)
# ... or by the ratio's own terms just before it: 'ring / server 1.42x',
# '`flat` / gloo: 0.98x' (not a spread's 'min / median / max') ...
_QUOTIENT = re.compile(r"(?<![\w`'-])(?!(?:min|median|max)\b)[A-Za-z_`']"
                       r"[\w`'-]*\s/\s[`(]?(?!(?:min|median|max)\b)[A-Za-z_]")
_QUOTIENT_REACH = 60
# ... or right after it: '1.06x the bound', '1.10x of its bound'.
_OF_WHAT = re.compile(r'\s*(?:of|the|its|their)\b', re.I)


def _says_which_way(text):
    """``text`` (a sentence, a cell, a header) says which way its ratios
    go: a direction word anywhere in it; else a quotient just before each
    ratio, or 'of' / 'the' right after it (a header, which holds no ratio:
    a quotient anywhere)."""
    if _DIRECTION.search(text):
        return True
    ratios = list(_RATIO.finditer(text))
    if not ratios:
        return bool(_QUOTIENT.search(text))
    return any(_OF_WHAT.match(text, m.end()) or _QUOTIENT.search(
        text, max(0, m.start() - _QUOTIENT_REACH), m.start())
        for m in ratios)


def _cells(line):
    return [c.strip() for c in line.strip().strip('|').split('|')]


def _bare_ratios(text):
    """(line, text) of each ratio that does not say which way it goes: in
    prose, no direction in its sentence; in a table, none in its cell,
    its column's header or its row's first cell."""
    text = _FENCE.sub(lambda m: '\n' * m.group(0).count('\n'), text)
    text = re.sub(r'`[^`\n]*`', lambda m: 'C' * len(m.group(0)), text)
    lines, bare, prose = text.split('\n'), [], []
    header = None
    for number, line in enumerate(lines, 1):
        if not line.lstrip().startswith('|'):
            header = None
            prose.append(line)
            continue
        prose.append('')
        cells = _cells(line)
        if header is None:
            header = cells
            continue
        for k, cell in enumerate(cells):
            head = header[k] if k < len(header) else ''
            if _RATIO.search(cell) and not any(
                    _says_which_way(t) for t in (cell, head, cells[0])):
                bare.append((number, cell))
    prose = '\n'.join(prose)
    start = 0
    for sentence in re.split(r'(?<=[.;:!?])\s+(?=[A-Z(*`-])|;\s+|'
                             r'\n\s*\n|\n\s*[-*]\s', prose):
        at = prose.find(sentence, start)
        start = max(start, at)
        if _RATIO.search(sentence) and not _says_which_way(sentence):
            bare.append((_line(prose, at), ' '.join(sentence.split())))
    return bare


@pytest.mark.parametrize('page', _user_pages())
def test_every_ratio_says_which_way_it_goes(page):
    """'1.84x' alone leaves the reader to guess; '1.84x slower than a raw
    Allreduce' does not.  (docs/results/ is the record, not held to it.)"""
    found = ['%s:%d: %s' % (page, number, sentence)
             for number, sentence in
             _bare_ratios(_read(os.path.join(ROOT, page)))]
    assert not found, ('ratios that do not say which way they go (add '
                       '"faster than", "as long as", "of", ...):\n'
                       + '\n'.join(found))


def test_a_bare_ratio_is_found():
    """The checker itself: '1.84x' alone fails, in prose and in a table
    whose header does not say which way; with its direction it passes."""
    assert _bare_ratios('`flat` float32 is 1.84x at N=2.\n')
    assert _bare_ratios('| case | ratio |\n|---|---|\n| flat | 1.84x |\n')
    assert _bare_ratios('The paper reports 1.8x at 16 nodes.\n')
    assert _bare_ratios('17.2 s (min / median / max) against 52.4 s, '
                        '3.0x in the pairs.\n')
    assert not _bare_ratios('ring / server 1.42x at 1 Gbit/s.\n')
    assert not _bare_ratios('`flat` float32 is 1.84x slower than a raw '
                            'Allreduce.\n')
    assert not _bare_ratios('It takes 1.06x the bound; 1024x1024 layers.\n')
    assert not _bare_ratios('| case | speed-up (x faster) |\n|---|---|\n'
                            '| flat | 1.84x |\n')


# -- a figure quoted on several pages says the same everywhere --------------

# Each: the NAME of its row in benchmarks.md's current figures (where its
# median is), and the form in which prose quotes it (group 1: the value).
# A page that quotes the figure differently (an older run's value) fails.
#: Figures quoted on several pages, each checked against its row of
#: benchmarks.md's current figures: (the start of the row's label, the
#: topic a sentence must name, topics whose sentences quote other figures
#: in the same form, the form of a quote: its group 1 is the figure).
_QUOTED_FIGURES = [
    ('overlap, 2 nodes, 1 Gbit/s', re.compile(r'overlap', re.I),
     re.compile(r'double.buffer|DDP|DistributedDataParallel|PyTorch', re.I),
     re.compile(r'\b(0\.\d\d)\b[^0-9|]{0,40}?\bat 1 Gbit/s', re.I)),
    ('overlap, 2 nodes, 500 Mbit/s', re.compile(r'overlap', re.I),
     re.compile(r'double.buffer|DDP|DistributedDataParallel|PyTorch', re.I),
     re.compile(r'\b(0\.\d\d)\b[^0-9|]{0,40}?\bat 500 Mbit/s', re.I)),
    ('wire dtypes, 4 nodes, 1 Gbit/s: float16', re.compile(r'float16|FP16'),
     re.compile(r'bfloat16 (?:is|was|on)|shared memory, N=', re.I),
     re.compile(r'\b(\d\.\d\d)x faster\b[^.|]{0,40}?\bat 1 Gbit/s', re.I)),
]


def _current_figures():
    """{the row's label: its median cell} of benchmarks.md's current
    figures table."""
    text = _read(os.path.join(ROOT, 'docs', 'benchmarks.md'))
    section = text.split('## Current figures', 1)[1].split('\n## ', 1)[0]
    figures = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip('|').split('|')]
        if len(cells) == 4 and cells[3].startswith('`'):
            figures[cells[0]] = cells[1]
    return figures


def _sentences(text):
    """The prose of a page, sentence by sentence (code blocks and tables
    out; inline code stays: `overlap=True` names the topic)."""
    prose = _FENCE.sub(' ', text)
    prose = '\n'.join(line for line in prose.splitlines()
                      if not line.lstrip().startswith('|'))
    return re.split(r'(?<=[.;:])\s+|\n\s*\n', prose)


def _quotes_that_differ(pages):
    current = _current_figures()
    wrong = []
    for label, topic, other_topic, form in _QUOTED_FIGURES:
        row = [cell for name, cell in current.items()
               if name.startswith(label)]
        assert len(row) == 1, (label, sorted(current))
        value = re.search(r'\d+(?:\.\d+)?', row[0]).group(0)
        for page, text in pages:
            sentences = _sentences(text)
            for before, sentence in zip([''] + sentences, sentences):
                # The topic may be named just before ("float16 ... pays
                # where the link is slow: 1.95x faster at 1 Gbit/s").
                if not topic.search(before + ' ' + sentence) or \
                        other_topic.search(sentence):
                    continue
                for m in form.finditer(sentence):
                    if m.group(1) != value:
                        wrong.append('%s: %r says %s, benchmarks.md %s (%s)'
                                     % (page, ' '.join(sentence.split()),
                                        m.group(1), value, label))
    return wrong


def test_a_figure_quoted_on_several_pages_is_the_same_everywhere():
    pages = [(p, _read(os.path.join(ROOT, p))) for p in _user_pages()]
    wrong = _quotes_that_differ(pages)
    assert not wrong, '\n'.join(wrong)


def test_a_stale_figure_is_found():
    """The checker itself: an older run's overlap figure beside the
    current one (0.55 at 1 Gbit/s, from before mnopt's C waits), and an
    older float16 wire figure (1.89x), fail."""
    stale = ('Overlap hides 0.62 of the averaging at 500 Mbit/s and 0.55 '
             'at 1 Gbit/s on 2 simulated nodes.  The float16 wire pays '
             'wherever the link is slower than memory: 1.89x faster than '
             'float32 at 1 Gbit/s.')
    wrong = _quotes_that_differ([('stale.md', stale)])
    assert len(wrong) == 2 and '0.55' in wrong[0] and '1.89' in wrong[1], \
        wrong


# -- the example's summary shows what the example writes --------------------

def test_the_sample_summaries_list_every_plot_the_example_draws():
    plots = _read(os.path.join(ROOT, 'examples', 'imagenet', 'plots.py'))
    figures = re.search(r'^FIGURES = \((.*?)\)\n\n', plots, re.S | re.M)
    drawn = re.findall(r"\('(\w+\.png)'", figures.group(1))
    assert len(drawn) >= 3, drawn
    for page in ('README.md', 'docs/imagenet_example.md'):
        lines = [line for line in _read(os.path.join(ROOT, page)).splitlines()
                 if line.startswith('plots ')]
        assert lines, page
        for line in lines:
            listed = re.findall(r'(\w+\.png)', line)
            assert listed == drawn, (page, listed, drawn)


# -- troubleshooting.md quotes mnopt's messages as the code says them -------

def _literal_pieces():
    """Every string constant of mnopt/ and examples/ (implicit
    concatenations joined), cut at its formatting placeholders: the fixed
    text of its messages."""
    import ast
    placeholder = re.compile(r'%[-#0 +]*\d*(?:\.\d+)?[sdrfgx%]|\{[^{}]*\}')
    pieces = set()
    paths = [path for top in ('mnopt', 'examples')
             for path in glob.glob(os.path.join(ROOT, top, '**', '*.py'),
                                   recursive=True)]
    for path in paths:
        for node in ast.walk(ast.parse(_read(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for piece in placeholder.split(node.value):
                    if len(piece.strip()) >= 8:
                        pieces.add(piece.strip())
    return pieces


def _unquoted_parts(line, pieces):
    """The runs of ``line`` no fixed text of the code covers, longer than a
    value the code fills in (a rank, a name, a number, a file) could be."""
    covered = [False] * len(line)
    for piece in pieces:
        start = line.find(piece)
        while start >= 0:
            covered[start:start + len(piece)] = [True] * len(piece)
            start = line.find(piece, start + 1)
    runs = re.findall(r'[^\x00]+', ''.join(
        '\x00' if c else ch for c, ch in zip(covered, line)))
    return [r for r in runs if len(re.findall(r'[A-Za-z]{3,}', r)) > 4]


#: A line an exception's message follows (a traceback's last line, with
#: the failure summary's indent), or the example's own: its message is
#: what follows.
_MESSAGE_AFTER = re.compile(
    r'^\s*(?:[\w.]*(?:Error|Warning|Exception)|train_imagenet\.py): ')


def _mnopt_messages(text):
    """The lines of the page's console blocks that mnopt (its commands,
    the example) printed, and the exceptions' messages."""
    for block in re.findall(r'^```console\n(.*?)^```', text, re.S | re.M):
        for line in block.splitlines():
            # -prepend-rank's prefix, or mnopt's own rank tag
            line = re.sub(r'^\[(rank )?\d+\] ', '', line)
            if line.startswith(('mnopt:', 'mnopt.', 'python -m mnopt.')) \
                    or _MESSAGE_AFTER.match(line) or \
                    'mnopt/' in line.split(':', 1)[-1][:20]:
                yield line


def _stale_quotes(text, pieces):
    stale = []
    for line in _mnopt_messages(text):
        message = line.split(': ', 1)[1] if line.startswith('mnopt.') or \
            _MESSAGE_AFTER.match(line) else line
        left = _unquoted_parts(message, pieces)
        if left:
            stale.append('%s\n    not in mnopt/: %r' % (line, left))
    return stale


def test_troubleshooting_quotes_messages_the_code_still_prints():
    text = _read(os.path.join(ROOT, 'docs', 'troubleshooting.md'))
    assert len(list(_mnopt_messages(text))) >= 6
    stale = _stale_quotes(text, _literal_pieces())
    assert not stale, ('docs/troubleshooting.md quotes messages mnopt does '
                       'not print (any more):\n' + '\n'.join(stale))


def test_a_reworded_message_is_found():
    """The checker itself: a message the code never printed fails."""
    page = ('```console\nmnopt: rank 0 has waited 60.2 s in flat#0.mean_grads'
            ' #1; the other ranks were lost in a collective that never '
            'finished its work.\n```\n')
    assert _stale_quotes(page, _literal_pieces())
    for reworded in (
            'python -m mnopt.server: error: no workers were started, so '
            'there is nothing for the servers to do at all',
            'train_imagenet.py: --resume auto: the snapshot in result is of '
            'another run, which this one cannot continue in any way',
            '  ValueError: ranks disagree on create_multi_node_optimizer: '
            'double_buffering (rank 0: True, rank 1: False): the ranks '
            'must all pass identical keyword values'):
        page = '```console\n%s\n```\n' % reworded
        assert _stale_quotes(page, _literal_pieces()), reworded


def test_troubleshooting_is_linked_from_the_readme_and_the_index():
    for page in ('README.md', 'docs/index.md'):
        assert 'troubleshooting.md' in _read(os.path.join(ROOT, page)), page


# -- the sample summaries are what run_summary.py prints --------------------

#: Where a wrapped summary line continues (run_summary.INDENT).
_INDENT = ' ' * 11
_WIDTH = 80
_SPEC = re.compile(r'%[-#0 +]*\d*(?:\.(\d+))?([sdrfgx%])')


def _format_regex(fmt):
    """A ``%`` format string as a regex: its fixed text exactly, a number
    as the spec writes it, a ``%s`` as a group of any text."""
    parts, at = [], 0
    for m in _SPEC.finditer(fmt):
        parts.append(re.escape(fmt[at:m.start()]))
        digits, kind = m.groups()
        if kind == 's':
            parts.append('(.*?)')
        elif kind == '%':
            parts.append('%')
        elif kind == 'f' and digits and digits != '0':
            parts.append(r'-?\d+\.\d{%s}' % digits)
        else:
            parts.append(r'-?\d+')
        at = m.end()
    parts.append(re.escape(fmt[at:]))
    return re.compile(''.join(parts))


def _summary_formats():
    """Every string constant of run_summary.py with a placeholder (or the
    fixed line it prints), as a regex."""
    import ast
    source = _read(os.path.join(ROOT, 'examples', 'imagenet',
                                'run_summary.py'))
    return [_format_regex(node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and len(node.value) >= 4 and '\n' not in node.value]


def _fits(text, formats):
    """Whether ``text`` is what a format prints: a value (no space), a
    format's fixed text with each ``%s`` filled by what fits, or a
    ', '-joined list of those (the modes)."""
    if not re.search(r'\s', text):
        return True
    for form in formats:
        m = form.fullmatch(text)
        if m and all(_fits(g, formats) for g in m.groups() if g):
            return True
    parts = text.split(', ')
    return len(parts) > 1 and all(_fits(p, formats) for p in parts)


def _parses(lines, formats):
    """Whether ``lines`` split into printed lines, each continued on the
    lines under it that start with the summary's indent (as
    run_summary.wrapped writes them), every one fitting a format."""
    if not lines:
        return True
    for end in range(1, len(lines) + 1):
        if end > 1 and not lines[end - 1].startswith(_INDENT):
            break
        joined = ' '.join([lines[0]] + [l[len(_INDENT):]
                                        for l in lines[1:end]])
        if _fits(joined, formats) and _parses(lines[end:], formats):
            return True
    return False


def _plain_blocks(text):
    """The lines of each of the page's fenced blocks without a language
    (what a program printed)."""
    blocks, lines = [], None
    for line in text.splitlines():
        if lines is None and line.startswith('```'):
            lines = [] if line == '```' else False
        elif lines is not None and line.startswith('```'):
            if lines is not False:
                blocks.append(lines)
            lines = None
        elif lines:
            lines.append(line)
        elif lines == []:
            lines = [line]
    return blocks


def _sample_summaries(text):
    return [b for b in _plain_blocks(text) if b[0].startswith('== mnopt: ')]


def _stale_summaries(text, formats):
    stale = []
    for lines in _sample_summaries(text):
        stale += ['over %d columns: %r' % (_WIDTH, l) for l in lines
                  if len(l) > _WIDTH]
        if not _parses(lines, formats):
            stale.append('not as run_summary.py prints it:\n' +
                         '\n'.join(lines))
    return stale


def test_the_sample_summaries_are_what_the_example_prints():
    formats = _summary_formats()
    for page in ('README.md', 'docs/imagenet_example.md'):
        text = _read(os.path.join(ROOT, page))
        assert _sample_summaries(text), page
        stale = _stale_summaries(text, formats)
        assert not stale, '%s:\n%s' % (page, '\n'.join(stale))


def test_a_stale_sample_summary_is_found():
    """The checker itself: the summary the README showed before the
    example counted a resumed run's iterations apart and wrapped its lines
    (each of its lines but the first two is stale)."""
    old = ('```\n'
           '== mnopt: 2 ranks, communicator flat, wire float32\n'
           'training   80 iterations in 16.1 s: 476 images/s (median step '
           '0.134 s, 64 images)\n'
           'averaging  0.7% of step time blocked in averaging (0.001 s per '
           'step)\n'
           'validation accuracy 0.980, loss 0.096 (epoch 8; chance 0.125)\n'
           '```\n')
    formats = _summary_formats()
    stale = _stale_summaries(old, formats)
    assert len(stale) == 2 and 'over 80 columns' in stale[0], stale
    for line, fits in ((1, True), (3, True), (2, False), (4, False)):
        assert _parses([old.splitlines()[line]], formats) is fits, line


def _table_sample(text):
    """The lines of the page's block that shows the example's table."""
    return next((b for b in _plain_blocks(text)
                 if b[0].startswith('mnopt ImageNet example:')), None)


def test_the_sample_table_is_what_the_example_prints():
    import ast
    source = _read(os.path.join(ROOT, 'examples', 'imagenet', 'table.py'))
    legend = next(node.value for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Assign)
                  and node.targets[0].id == 'LEGEND').value
    columns = re.findall(r"^    \('([\w./]+)', (\d+), '", source, re.M)
    header = ' '.join('%*s' % (int(w), name) for name, w in columns)
    lines = _table_sample(_read(os.path.join(ROOT, 'docs',
                                             'imagenet_example.md')))
    assert lines, 'docs/imagenet_example.md shows no table'
    text = '\n'.join(lines)
    assert legend + '\n' + header + '\n' in text, (legend, header)
    assert all(len(line) <= _WIDTH for line in lines), lines


def test_the_flag_list_names_every_flag_of_the_example():
    """imagenet_example.md's Flags table: a flag the example takes and the
    table leaves out (--accumulation-steps, --bucket-bytes, ...) is one a
    user reading the page cannot find."""
    source = _read(os.path.join(ROOT, 'examples', 'imagenet',
                                'train_imagenet.py'))
    flags = set(re.findall(r"add_argument\(\s*'(--[\w-]+)'", source))
    assert '--accumulation-steps' in flags, flags
    page = _read(os.path.join(ROOT, 'docs', 'imagenet_example.md'))
    table = page.split('\n## Flags\n', 1)[1].split('\n## ', 1)[0]
    listed = set()
    for row in table.splitlines():
        if row.startswith('| `--'):
            listed.update(re.findall(r'`(--[\w-]+)', row.split(' | ')[0]))
    assert flags <= listed, sorted(flags - listed)


# -- what chainermn.md says of ChainerMN's other communicators --------------

def _chainermn_names():
    """{ChainerMN's name: what mnopt's error says to use instead}, from the
    factory's table (CHAINERMN_NAMES)."""
    import ast
    source = _read(os.path.join(ROOT, 'mnopt', 'communicators',
                                '__init__.py'))
    table = next(node.value for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.Assign)
                 and getattr(node.targets[0], 'id', '') == 'CHAINERMN_NAMES')
    return ast.literal_eval(table)


def _advice_differs(row, names):
    """For each name: the communicators and commands the code names for it
    that the row's words after it (up to the next name) do not."""
    wrong = []
    for name, advice in names.items():
        at = row.find('`%s`:' % name)
        if at < 0:
            wrong.append('%s: not named' % name)
            continue
        ends = [row.find('`%s`:' % other, at + 1) for other in names]
        said = row[at:min([e for e in ends if e > at] or [len(row)])]
        for named in re.findall(r"'(\w+)'|(python -m [\w.]+)", advice):
            named = named[0] or named[1]
            if '`%s`' % named not in said:
                wrong.append('%s: %r not said' % (name, named))
        if not re.findall(r"'(\w+)'", advice) and 'none' not in said:
            wrong.append('%s: mnopt has none, not said' % name)
    return wrong


def test_chainermn_md_says_what_replaces_each_chainermn_communicator():
    names = _chainermn_names()
    assert {'two_dimensional', 'single_node', 'dummy'} <= set(names)
    row = next(line for line in _read(os.path.join(
        ROOT, 'docs', 'chainermn.md')).splitlines()
        if line.startswith('| `create_communicator('))
    wrong = _advice_differs(row, names)
    assert not wrong, wrong
    # The checker itself: the row before it named each.
    assert len(_advice_differs(
        '`two_dimensional`, `single_node`, `non_cuda_aware` and `dummy` are '
        'not offered: `hierarchical` and `flat` cover them', names)) == 4


# -- the check is shown as its --help shows it ------------------------------

def test_pages_launch_the_check_as_its_help_does():
    """`python -m mpi4py -m mnopt.check` under a launcher, as `python -m
    mnopt --help` and `mnopt.check --help` show it."""
    main = _read(os.path.join(ROOT, 'mnopt', '__main__.py'))
    assert 'python -m mpi4py -m mnopt.check' in main
    wrong = []
    for path in _user_pages():
        for n, line in enumerate(_read(os.path.join(ROOT, path))
                                 .splitlines(), 1):
            if re.search(r'\b(mpiexec|srun)\b.*python -m mnopt\.check',
                         line):
                wrong.append('%s:%d: %s' % (path, n, line.strip()))
    assert not wrong, '\n'.join(wrong)
