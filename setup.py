import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: no PEP 660 editable installs
    editable_wheel = None

HERE = os.path.dirname(os.path.abspath(__file__))
#: Installed at the top of site-packages: makes Chainer 7.8.1 importable
#: under NumPy 2 whatever a script imports first (_mnopt_chainer_numpy2.py).
PTH = 'mnopt-chainer-numpy2.pth'


class build_py_with_pth(build_py):
    """build_py, plus the .pth file at the root of the built tree, so it
    lands in site-packages (wheels and editable installs alike)."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, PTH),
                       os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [
            os.path.join(self.build_lib, PTH)]


cmdclass = {'build_py': build_py_with_pth}
if editable_wheel is not None:
    class editable_wheel_with_pth(editable_wheel):
        """pip install -e: the same .pth at the root of the editable wheel
        (its build_py output is not copied there).  The hook is an
        internal of setuptools 64+; where it is missing, ``import mnopt``
        still installs the import hook, only later."""

        def _run_build_commands(self, dist_name, unpacked_wheel, *args):
            result = super()._run_build_commands(dist_name, unpacked_wheel,
                                                 *args)
            self.copy_file(os.path.join(HERE, PTH),
                           os.path.join(unpacked_wheel, PTH))
            return result

    cmdclass['editable_wheel'] = editable_wheel_with_pth

#: mnopt's C extensions, each beside the module that loads it; all
#: optional: without a C compiler mnopt computes the same in numpy or Python.
#: - mnopt/wire/_halfcast.c: fast float16/bfloat16 casts (numpy fallback:
#:   bit-identical, about 10x slower: 100 MB to float16,
#:   docs/results/halfcast.md).
#: - mnopt/codecs/_signbits.c: the sign codec's one-pass loops likewise
#:   (numpy fallback, bit-exact).
#: - mnopt/transport/_mpiwait.c: MPI waits that hold neither the GIL nor a
#:   core (fallback: polling from Python).
#: - mnopt/stall/_startwatch.c: the watch of MPI's start and of an early
#:   failing exit (fallback: Python's fault handler ends a wait in MPI's
#:   start at the timeout, with no warning before it).
C_EXTENSIONS = ('mnopt/wire/_halfcast', 'mnopt/codecs/_signbits',
                'mnopt/transport/_mpiwait', 'mnopt/stall/_startwatch')

# Everything declarative (name, version, dependencies, extras, packages)
# is in pyproject.toml; here only what needs code.
setup(
    cmdclass=cmdclass,
    ext_modules=[Extension(path.replace('/', '.'), [path + '.c'],
                           extra_compile_args=['-O3'], optional=True)
                 for path in C_EXTENSIONS],
)
