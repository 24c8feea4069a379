"""mnopt's GPU code checked without a GPU: every CUDA kernel compiles with
the installed CuPy's NVRTC for a current GPU, and every CuPy/NCCL name
mnopt calls exists in the installed CuPy.

Needs CuPy and NVRTC, not a GPU (the core stack of `make test` has them;
there MNOPT_REQUIRE_NVRTC=1 turns a missing NVRTC into a failure, not a
skip).  Each kernel is compiled as CuPy's ElementwiseKernel writes it: the
headers CuPy prepends, a typedef per type parameter, CArray parameters and
CuPy's grid-stride loop around the body, with CuPy's own compiler options.
"""

import ast
import os

import numpy
import pytest

from conftest import REPO, WORLD

ARCHS = ('compute_90',)   # H100; add others here

pytestmark = pytest.mark.skipif(WORLD.size > 1,
                                reason='compiling once is enough')


def _nvrtc():
    """(cupy, nvrtc) or a skip/failure saying what is missing."""
    required = os.environ.get('MNOPT_REQUIRE_NVRTC') == '1'
    try:
        import cupy
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
    except Exception as e:  # no CuPy, or no libnvrtc
        if required:
            pytest.fail('MNOPT_REQUIRE_NVRTC=1 but CuPy/NVRTC is not '
                        'usable: %s' % e)
        pytest.skip('needs CuPy and NVRTC (the core stack has them): %s' % e)
    return cupy, nvrtc


C_TYPES = {'float16': 'float16', 'float32': 'float', 'float64': 'double',
           'uint16': 'unsigned short', 'int32': 'int', 'int64': 'long long',
           'uint64': 'unsigned long long'}


def _parse(params):
    """[(type, name)] of an ElementwiseKernel parameter string."""
    return [tuple(p.split()) for p in params.split(',')]


def elementwise_source(name, inputs, outputs, body, types):
    """The CUDA source CuPy compiles for ElementwiseKernel(inputs, outputs,
    body, name) called with every array contiguous and 1-D."""
    import cupy._core.core as core
    headers = getattr(core, '_cupy_header_list',
                      ['cupy/complex.cuh', 'cupy/carray.cuh',
                       'cupy/atomics.cuh', 'cupy/math_constants.h'])
    lines = ['#include <%s>' % h for h in headers]
    # CuPy 14 keeps float16 in a header of its own, included when a kernel
    # uses it (CuPy 13 defines it in carray.cuh).
    if ('float16' in types.values() or 'float16' in inputs + outputs) \
            and os.path.exists(os.path.join(
            core._get_header_dir_path(), 'cupy', 'float16.cuh')):
        lines.append('#include <cupy/float16.cuh>')
    lines += ['typedef %s %s;' % (C_TYPES[types[k]], k) for k in sorted(types)]
    from mnopt import _cuda
    params, loads = [], []
    for kind, plist in (('in', inputs), ('out', outputs)):
        for param in _parse(plist):
            raw = param[0] == 'raw'
            ptype, pname = param[-2:]
            ctype = ptype if ptype in types else C_TYPES.get(ptype, ptype)
            if raw:  # the whole array, indexed by the body
                params.append('%sCArray<%s, 1, true, true> %s' % (
                    'const ' if kind == 'in' else '', ctype, pname))
            elif pname not in _cuda.KERNEL_SCALARS:
                params.append('%sCArray<%s, 1, true, true> _raw_%s'
                              % ('const ' if kind == 'in' else '', ctype,
                                 pname))
                loads.append('%s%s &%s = _raw_%s[_ind.get()];'
                             % ('const ' if kind == 'in' else '', ctype,
                                pname, pname))
            else:
                params.append('const %s %s' % (ctype, pname))
    params.append('CIndexer<1, true> _ind')
    return '\n'.join(lines + [
        'extern "C" __global__ void %s(%s) {' % (name, ', '.join(params)),
        '  #pragma unroll 1',
        '  CUPY_FOR(i, _ind.size()) {',
        '    _ind.set(i);',
        '    ' + '\n    '.join(loads),
        '    ' + body + ';',
        '  }',
        '}', ''])


def _options(cupy):
    import cupy._core.core as core
    options = tuple(core.assemble_cupy_compiler_options(()))
    return options + ('-DCUPY_USE_32BIT_INDEXING',)


def _cases():
    from mnopt import _cuda
    for name, (inputs, outputs, body) in sorted(_cuda.KERNELS.items()):
        for types in _cuda.KERNEL_TYPES[name]:
            for arch in ARCHS:
                yield pytest.param(name, types, arch, id='%s-%s-%s' % (
                    name, '-'.join('%s=%s' % kv for kv in sorted(
                        types.items())), arch))


@pytest.mark.parametrize('name,types,arch', list(_cases()))
def test_kernel_compiles(name, types, arch):
    cupy, nvrtc = _nvrtc()
    from mnopt import _cuda
    source = elementwise_source(name, *_cuda.KERNELS[name], types)
    prog = nvrtc.createProgram(source, name + '.cu', [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(_options(cupy))
                                 + ['-arch=' + arch])
        except nvrtc.NVRTCError:
            pytest.fail('%s %s does not compile for %s:\n%s\n%s' % (
                name, types, arch, nvrtc.getProgramLog(prog), source))
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    assert (b'.entry ' + name.encode()) in ptx


@pytest.mark.parametrize('arch', ARCHS)
def test_spin_kernel_compiles(arch):
    """The tests' and benchmarks' busy kernel (_cuda.SPIN_SOURCE)."""
    cupy, nvrtc = _nvrtc()
    from mnopt import _cuda
    prog = nvrtc.createProgram(_cuda.SPIN_SOURCE, 'mnopt_spin.cu', [], [])
    try:
        try:
            nvrtc.compileProgram(prog, ['-arch=' + arch])
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(prog))
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    assert b'.entry mnopt_spin' in ptx


def test_every_kernel_is_checked():
    from mnopt import _cuda
    assert set(_cuda.KERNELS) == set(_cuda.KERNEL_TYPES)
    # Every kernel mnopt calls is in the table.
    source = open(os.path.join(REPO, 'mnopt', '_cuda.py')).read()
    assert "_kernel(_kernel_name(" in source
    used = {_cuda._kernel_name(d, w) for d in ('pack', 'unpack')
            for w in ('float16', 'bfloat16', 'float32', 'float64')}
    assert used == set(_cuda.KERNELS)
    # The one RawKernel is the spin kernel, checked above.
    assert 'ElementwiseKernel(' in source
    assert source.count('RawKernel(') == source.count(
        'RawKernel(SPIN_SOURCE') == 1


# --------------------------------------------------------------- the API

#: Roots of attribute chains in mnopt's sources, and what they stand for.
ROOTS = {'cupy': 'cupy', '_cupy': 'cupy', 'cp': 'cupy', 'cupyx': 'cupyx',
         'nccl': 'cupy.cuda.nccl'}
#: ``xp`` is numpy or cupy: what mnopt calls on it must exist in both.
ARRAY_MODULE = 'xp'
#: Methods called on CuPy objects that the scan cannot see through (a
#: stream's ``ptr`` is an instance attribute: it needs a GPU to see).
METHODS = {
    'cupy.cuda.Stream': ['wait_event', 'record', 'synchronize',
                         '__enter__', '__exit__'],
    'cupy.cuda.Event': ['synchronize'],
    'cupy.ndarray': ['get', 'set', 'reshape', 'view', 'data'],
    'cupy.cuda.nccl.NcclCommunicator': ['allReduce'],
}


def _chains():
    """Every dotted name rooted at ROOTS or ``xp`` in mnopt's sources."""
    found = set()
    for folder, _, files in os.walk(os.path.join(REPO, 'mnopt')):
        for f in files:
            if not f.endswith('.py'):
                continue
            tree = ast.parse(open(os.path.join(folder, f)).read())
            for node in ast.walk(tree):
                parts = []
                while isinstance(node, ast.Attribute):
                    parts.append(node.attr)
                    node = node.value
                if parts and isinstance(node, ast.Name) and (
                        node.id in ROOTS or node.id == ARRAY_MODULE):
                    found.add((node.id, '.'.join(reversed(parts))))
    # Keep the longest chains only (a.b.c also covers a.b).
    return sorted(c for c in found if not any(
        o[0] == c[0] and o[1].startswith(c[1] + '.') for o in found))


def _resolve(path):
    import importlib
    parts = path.split('.')
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module('.'.join(parts[:i + 1]))
    return obj


def test_every_cupy_and_nccl_name_mnopt_uses_exists():
    cupy, _ = _nvrtc()
    chains = _chains()
    assert ('xp', 'packbits') in chains and ('nccl', 'NCCL_SUM') in chains
    missing = []
    for root, chain in chains:
        if root != ARRAY_MODULE:
            modules = [ROOTS[root]]
        elif chain.startswith('cuda.'):  # only reached when xp is cupy
            modules = ['cupy']
        else:
            modules = ['numpy', 'cupy']
        for module in modules:
            try:
                _resolve(module + '.' + chain)
            except (AttributeError, ImportError):
                missing.append('%s.%s (as %s.%s)' % (module, chain, root,
                                                     chain))
    for owner, methods in METHODS.items():
        cls = _resolve(owner)
        missing += ['%s.%s' % (owner, m) for m in methods
                    if not hasattr(cls, m)]
    assert not missing, 'not in CuPy %s / NumPy %s: %s' % (
        cupy.__version__, numpy.__version__, ', '.join(missing))
