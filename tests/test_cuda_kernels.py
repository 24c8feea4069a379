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
    from mnopt.gpu import kernels
    lines.append(kernels.PREAMBLE)     # where CuPy puts a preamble
    params, loads = [], []
    for kind, plist in (('in', inputs), ('out', outputs)):
        for param in _parse(plist):
            raw = param[0] == 'raw'
            ptype, pname = param[-2:]
            ctype = ptype if ptype in types else C_TYPES.get(ptype, ptype)
            if raw:  # the whole array, indexed by the body
                params.append('%sCArray<%s, 1, true, true> %s' % (
                    'const ' if kind == 'in' else '', ctype, pname))
            elif pname not in kernels.KERNEL_SCALARS:
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
    # CuPy's compiler adds -ftz=true to every kernel it compiles
    # (cupy/cuda/compiler.py).
    return options + ('-DCUPY_USE_32BIT_INDEXING', '-ftz=true')


def _cases():
    from mnopt.gpu import kernels
    for name, (inputs, outputs, body) in sorted(kernels.KERNELS.items()):
        for types in kernels.KERNEL_TYPES[name]:
            for arch in ARCHS:
                yield pytest.param(name, types, arch, id='%s-%s-%s' % (
                    name, '-'.join('%s=%s' % kv for kv in sorted(
                        types.items())), arch))


@pytest.mark.parametrize('name,types,arch', list(_cases()))
def test_kernel_compiles(name, types, arch):
    cupy, nvrtc = _nvrtc()
    from mnopt.gpu import kernels
    source = elementwise_source(name, *kernels.KERNELS[name], types)
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
    """The tests' and benchmarks' busy kernel (tests/gpu_spin.py)."""
    cupy, nvrtc = _nvrtc()
    from gpu_spin import SPIN_SOURCE
    prog = nvrtc.createProgram(SPIN_SOURCE, 'mnopt_spin.cu', [], [])
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
    from mnopt.gpu import kernels
    assert set(kernels.KERNELS) == set(kernels.KERNEL_TYPES)
    # Every kernel mnopt calls is in the table.
    source = open(os.path.join(REPO, 'mnopt', 'gpu', 'codec.py')).read()
    assert "kernel(kernel_name(" in source
    used = {kernels.kernel_name(d, w) for d in ('pack', 'unpack')
            for w in ('float16', 'bfloat16', 'float32', 'float64')}
    assert used == set(kernels.KERNELS)
    # mnopt compiles ElementwiseKernels only; the one RawKernel is the
    # tests' spin kernel, checked above.
    assert 'ElementwiseKernel(' in open(os.path.join(
        REPO, 'mnopt', 'gpu', 'kernels.py')).read()
    for folder, _, files in os.walk(os.path.join(REPO, 'mnopt')):
        for f in files:
            if f.endswith('.py'):
                assert 'RawKernel(' not in open(os.path.join(folder,
                                                             f)).read(), f


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


# --------------------------------------------------------------- the PTX

def _ptx(name, types, arch=ARCHS[0]):
    cupy, nvrtc = _nvrtc()
    from mnopt.gpu import kernels
    source = elementwise_source(name, *kernels.KERNELS[name], types)
    prog = nvrtc.createProgram(source, name + '.cu', [], [])
    try:
        nvrtc.compileProgram(prog, list(_options(cupy)) + ['-arch=' + arch])
        return nvrtc.getPTX(prog).decode()
    finally:
        nvrtc.destroyProgram(prog)


def _every_kernel():
    from mnopt.gpu import kernels
    return [pytest.param(name, types, id='%s-%s' % (name, '-'.join(
        '%s=%s' % kv for kv in sorted(types.items()))))
        for name in sorted(kernels.KERNELS)
        for types in kernels.KERNEL_TYPES[name]]


@pytest.mark.parametrize('name,types', _every_kernel())
def test_kernels_keep_subnormals_and_move_16_byte_vectors(name, types):
    """Compiled as CuPy compiles them (-ftz=true): no instruction flushes
    a subnormal to zero (the host keeps them: bit-identity), the aligned
    path reads and writes 16 bytes per instruction, and nothing spills to
    local memory."""
    ptx = _ptx(name, types)
    import re
    assert not re.findall(r'\b[a-z]+(?:\.[a-z0-9]+)*\.ftz\b', ptx)
    assert 'ld.global.v4.u32' in ptx and 'st.global.v4.u32' in ptx
    assert '.local' not in ptx


@pytest.mark.parametrize('name,types', [
    p for p in _every_kernel() if p.values[0].startswith('mnopt_pack')])
def test_pack_divides_in_the_host_codecs_precision(name, types):
    """float64 only where the gradient or the wire is float64 (bfloat16:
    always float32), as grad_buffer.HostCodec divides; the emulation below
    checks that this precision gives the host's bits."""
    ptx = _ptx(name, types)
    wide = name == 'mnopt_pack' and 'float64' in types.values() \
        or name == 'mnopt_pack_f16' and types['T'] == 'float64'
    assert ('div.rn.f64' in ptx) == wide
    assert ('div.rn.f32' in ptx) == (not wide)


# --------------------------------------------------------------- emulated
# The kernels' arithmetic on the host (numpy, whose float32 division and
# casts round once to nearest-even and keep subnormals, as the kernels'
# PTX does: checked above), against grad_buffer.HostCodec: its C loops for
# float32 gradients on 16-bit wires, numpy otherwise.  Needs no CuPy.

def kernel_pack(x, wire, divisor):
    """What the pack kernels compute (mnopt/gpu/kernels.py _SCALED and the
    bfloat16 body)."""
    from mnopt.codecs import grad_buffer
    with numpy.errstate(over='ignore', invalid='ignore'):
        if wire == 'bfloat16':
            return grad_buffer.float32_to_bfloat16_bits(
                x.astype(numpy.float32) / numpy.float32(divisor))
        wide = x.dtype == numpy.float64 or wire == 'float64'
        compute = numpy.float64 if wide else numpy.float32
        return (x.astype(compute) / compute(divisor)).astype(wire)


def kernel_unpack(w, wire, grad_dtype):
    from mnopt.codecs import grad_buffer
    if wire == 'bfloat16':
        w = grad_buffer.bfloat16_bits_to_float32(w)
    with numpy.errstate(over='ignore'):
        return w.astype(grad_dtype)


def _same_bits(a, b):
    a, b = numpy.asarray(a), numpy.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype.kind == 'f':
        nan = numpy.isnan(a)
        assert (nan == numpy.isnan(b)).all()
        a, b = a[~nan], b[~nan]
    return a.tobytes() == b.tobytes()


def _values(grad_dtype, divisors):
    """Every float16 value; for wider dtypes random values at every scale,
    float32 subnormals, and values d * m (+-1 ulp) for float16 rounding
    midpoints m: where dividing in float64 and rounding straight to
    float16 can differ from dividing in float32 (as the host does)."""
    rng = numpy.random.RandomState(5)
    if grad_dtype == 'float16':
        return numpy.arange(1 << 16, dtype=numpy.uint32).astype(
            numpy.uint16).view(numpy.float16)
    parts = [rng.standard_normal(20000) * 10.0 ** rng.randint(-45, 39, 20000),
             rng.uniform(-1, 1, 2000) * 2.0 ** -126,   # float32 subnormals
             numpy.array([0.0, -0.0, numpy.inf, -numpy.inf, numpy.nan,
                          1e-45, -1e-45, 65504.0, 65520.0, 3.4e38])]
    halves = numpy.arange(0x0400, 0x7BFF, 7, dtype=numpy.uint16).view(
        numpy.float16).astype(numpy.float64)
    mids = halves + numpy.spacing(halves.astype(numpy.float16)).astype(
        numpy.float64) / 2
    for d in divisors:
        near = (mids * d).astype(numpy.float32)
        parts += [near, numpy.nextafter(near, numpy.float32(numpy.inf)),
                  numpy.nextafter(near, numpy.float32(-numpy.inf))]
    with numpy.errstate(over='ignore'):
        return numpy.concatenate(parts).astype(grad_dtype)


DIVISORS = (1, 2, 3, 7, 1000, 2049, 65537)


@pytest.mark.parametrize('wire', ['float16', 'bfloat16', 'float32',
                                  'float64'])
@pytest.mark.parametrize('grad_dtype', ['float16', 'float32', 'float64'])
def test_emulated_kernel_arithmetic_is_the_host_codecs(grad_dtype, wire):
    from mnopt.codecs import grad_buffer
    x = _values(grad_dtype, DIVISORS)
    codec = grad_buffer.HostCodec(wire)
    for d in DIVISORS:
        host = numpy.empty(x.size, grad_buffer.storage_dtype(wire))
        with numpy.errstate(all='ignore'):   # the NaNs and infinities
            codec.encode(x, host, d)
        assert _same_bits(kernel_pack(x, wire, d).view(host.dtype), host), d
        back = numpy.empty(x.size, grad_dtype)
        with numpy.errstate(all='ignore'):
            codec.decode(host, back)
        assert _same_bits(kernel_unpack(host, wire, grad_dtype), back), d


def test_dividing_float32_in_float64_would_not_be_the_hosts():
    """Why the kernels divide float32 gradients in float32: the float64
    quotient rounded straight to float16 differs from the host's for some
    world sizes (65537 here); the float32 one is the host's for all."""
    from mnopt.codecs import grad_buffer
    x = _values('float32', (65537,))
    host = numpy.empty(x.size, numpy.float16)
    grad_buffer.HostCodec('float16').encode(x, host, 65537)
    with numpy.errstate(over='ignore', invalid='ignore'):
        via_float64 = (x.astype(numpy.float64) / 65537).astype(numpy.float16)
    assert not _same_bits(via_float64, host)
    assert _same_bits(kernel_pack(x, 'float16', 65537), host)


def _launch_map(sizes, aligned):
    """Emulates the index mapping of mnopt/gpu/kernels.py's bodies: for each
    array, how often each element is visited over the whole launch."""
    from mnopt.gpu import kernels
    chunk, lanes, vec = 1 << kernels.CHUNK_BITS, 1 << kernels.LANE_BITS, \
        kernels.VEC
    chunks = [(n + chunk - 1) // chunk for n in sizes]
    vstarts = numpy.concatenate([[0], numpy.cumsum(chunks)[:-1]]) * chunk
    entry = numpy.repeat(numpy.arange(len(sizes)), chunks)
    seen = [numpy.zeros(n, numpy.int64) for n in sizes]
    for i in range(int(sum(chunks)) * lanes):
        c = i >> kernels.LANE_BITS
        k = entry[c]
        n = sizes[k]
        base = (c << kernels.CHUNK_BITS) - vstarts[k]
        lane = i & (lanes - 1)
        if aligned[k]:
            j0 = base + lane * vec
            js = range(j0, min(j0 + vec, n))
        else:
            js = [base + lane + r * lanes for r in range(vec)]
        for j in js:
            if j < n:
                seen[k][j] += 1
    return seen


def test_every_element_is_moved_once():
    sizes = [3, 0, 1, 1024, 1025, 2047, 8, 5000]
    for aligned in ([True] * len(sizes), [False] * len(sizes),
                    [k % 2 == 0 for k in range(len(sizes))]):
        for k, seen in enumerate(_launch_map(sizes, aligned)):
            assert (seen == 1).all(), (k, aligned[k])
