"""The GPU extras install what Chainer needs to convolve through cuDNN.

Chainer 7.8.1 sets ``chainer.backends.cuda.cudnn_enabled`` only when
``import cupy.cuda.cudnn`` and ``import cupy.cudnn`` succeed; CuPy 14 has
neither (its cuDNN bindings are gone), CuPy 13's are built for cuDNN 8
(libcudnn.so.8).  So the CUDA 12 extra (CuPy 13) must bring a cuDNN 8 wheel,
and docs/install.md must say how CuPy 13 finds it.
"""

import os
import re

import pytest

from conftest import REPO, WORLD

pytestmark = pytest.mark.skipif(WORLD.size > 1, reason='reads files')


def _extras():
    """pyproject.toml's optional dependencies (the extras)."""
    try:
        import tomllib
    except ImportError:   # Python 3.10: the parser pip carries
        from pip._vendor import tomli as tomllib
    with open(os.path.join(REPO, 'pyproject.toml'), 'rb') as f:
        return tomllib.load(f)['project']['optional-dependencies']


def _spec(requirements, name):
    for r in requirements:
        m = re.match(r'([A-Za-z0-9_.-]+)\s*(.*)', r)
        if m.group(1) == name:
            return m.group(2)
    return None


@pytest.mark.parametrize('extra', ['gpu', 'gpu-cuda12'])
def test_the_cuda12_extra_brings_cudnn_8_for_cupy_13(extra):
    extras = _extras()
    assert _spec(extras[extra], 'cupy-cuda12x') == '>=13,<14'
    # cuDNN 8 (libcudnn.so.8, what CuPy 13 links), never 9.
    spec = _spec(extras[extra], 'nvidia-cudnn-cu12')
    assert spec is not None, extras[extra]
    from packaging.specifiers import SpecifierSet
    allowed = SpecifierSet(spec)
    assert '8.9.7.29' in allowed and '9.1.0.70' not in allowed


def test_the_cuda13_extra_does_not_pretend_to_bring_cudnn():
    """CuPy 14 has no cuDNN bindings: a cuDNN wheel would not help."""
    assert not any(r.startswith('nvidia-cudnn')
                   for r in _extras()['gpu-cuda13'])


def test_the_docs_say_which_stack_gives_chainer_cudnn():
    install = open(os.path.join(REPO, 'docs', 'install.md')).read()
    gpu = open(os.path.join(REPO, 'docs', 'gpu.md')).read()
    for text in (install, gpu):
        assert 'cudnn_enabled' in text and 'CuPy 13' in text
    assert 'nvidia/cudnn/lib' in install and 'LD_LIBRARY_PATH' in install


def test_cupy_14_has_no_cudnn_bindings():
    """The finding the extras rest on, where CuPy 14 is installed (the core
    stack)."""
    cupy = pytest.importorskip('cupy')
    if int(cupy.__version__.split('.')[0]) < 14:
        pytest.skip('CuPy %s is not 14' % cupy.__version__)
    import importlib.util
    assert importlib.util.find_spec('cupy.cudnn') is None
    assert importlib.util.find_spec('cupy.cuda.cudnn') is None
