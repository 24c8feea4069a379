"""Let Chainer 7.8.1 import under NumPy 2, whatever is imported first.

Chainer 7.8.1 (the last release) needs two things at import time that
today's NumPy no longer has:

- ``numpy.sctypes`` (chainer/functions/array/as_strided.py), removed in
  NumPy 2.0.  It is the only NumPy 2 removal Chainer touches (checked by
  grepping its sources for every name NumPy 2 expired); it comes back with
  NumPy 1's value.
- ``numpy.distutils.system_info`` (chainer/_environment_check.py imports
  it, and calls ``get_info('blas_opt')`` on macOS only, to warn about
  Accelerate).  NumPy has no ``numpy.distutils`` on Python 3.12 and later;
  a stand-in module whose ``get_info`` finds nothing takes its place, so
  Chainer skips that warning.

Nothing else of numpy is changed, and each only when it is missing.

The patch is applied just before ``chainer`` is imported, by a one-shot
import hook, never at interpreter start-up (numpy is not even imported
then).  The hook is installed

- by ``mnopt-chainer-numpy2.pth`` in site-packages, which pip installs with
  mnopt: then ``import chainer`` works before ``import mnopt`` too (the same
  mechanism setuptools uses for its ``distutils-precedence.pth``);
- by ``import mnopt`` itself, for a checkout used through PYTHONPATH.

This is a top-level module, not part of the ``mnopt`` package, so that the
.pth line does not import mnopt (and with it mpi4py) into every Python
process.  Scripts that must not depend on the hook can call
``add_missing_numpy_names()`` before importing chainer.
"""

import sys


def _numpy1_sctypes(numpy):
    """NumPy 1.26's ``numpy.sctypes``, built from types NumPy 2 still has."""
    def present(*names):
        return [getattr(numpy, n) for n in names if hasattr(numpy, n)]
    return {
        'int': present('int8', 'int16', 'int32', 'int64'),
        'uint': present('uint8', 'uint16', 'uint32', 'uint64'),
        'float': present('float16', 'float32', 'float64', 'longdouble'),
        'complex': present('complex64', 'complex128', 'clongdouble'),
        'others': [bool, object, bytes, str, numpy.void],
    }


def _system_info_stand_in():
    import types
    module = types.ModuleType(
        'numpy.distutils.system_info',
        'Stand-in for Chainer 7.8.1 (added by mnopt where numpy has no '
        'numpy.distutils): get_info finds no library.')
    module.get_info = lambda name, notfound_action=0: {}
    return module


def add_missing_numpy_names():
    """Give numpy the names Chainer 7.8.1 needs, where they are missing.
    Returns the names added (none under NumPy 1 on Python < 3.12)."""
    import importlib.util
    import numpy
    added = []
    try:
        numpy.sctypes
    except AttributeError:  # NumPy 2: its module __getattr__ refuses it
        numpy.sctypes = _numpy1_sctypes(numpy)
        added.append('sctypes')
    if 'numpy.distutils' not in sys.modules and \
            importlib.util.find_spec('numpy.distutils') is None:
        import types
        distutils = types.ModuleType('numpy.distutils')
        distutils.system_info = _system_info_stand_in()
        sys.modules['numpy.distutils'] = distutils
        sys.modules['numpy.distutils.system_info'] = distutils.system_info
        numpy.distutils = distutils  # as an import would bind it
        added.append('distutils.system_info')
    return added


class _BeforeChainer(object):
    """A meta path finder that finds nothing: it only runs
    ``add_missing_numpy_names`` the first time ``chainer`` is looked for,
    then removes itself."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == 'chainer':
            uninstall_import_hook()
            add_missing_numpy_names()
        return None


def install_import_hook():
    """Patch numpy just before chainer is first imported.  Idempotent;
    nothing to do once chainer has been imported."""
    if 'chainer' in sys.modules:
        return
    if not any(isinstance(f, _BeforeChainer) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeChainer())


def uninstall_import_hook():
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not isinstance(f, _BeforeChainer)]
