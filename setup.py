import os

from setuptools import Extension, find_packages, setup
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

# Pinned pairs for a GPU: a CuPy, the NCCL it loads, and the NumPy it runs
# on.  CuPy 14 requires NumPy 2; CuPy 13 is the last for NumPy 1.  CuPy 13
# is also the last with cuDNN bindings (Chainer 7 convolves through cuDNN
# only where `import cupy.cudnn` works), built for cuDNN 8: the cuDNN 8
# wheel (libcudnn.so.8; 9.x ships libcudnn.so.9), which CuPy 13 loads from
# the library path (docs/install.md).
GPU_CUDA12 = ['cupy-cuda12x>=13,<14', 'nvidia-nccl-cu12',
              'nvidia-cudnn-cu12>=8.9,<9']
GPU_CUDA13 = ['cupy-cuda13x>=14', 'nvidia-nccl-cu13', 'numpy>=2']

setup(
    name='mnopt',
    version='0.1.0',
    description='Multi-node optimizer wrapper for Chainer and CuPy '
                '(a ChainerMN-compatible data-parallel library)',
    long_description=open(os.path.join(HERE, 'README.md')).read(),
    long_description_content_type='text/markdown',
    packages=find_packages(include=['mnopt', 'mnopt.*']),
    py_modules=['_mnopt_chainer_numpy2'],
    cmdclass=cmdclass,
    python_requires='>=3.9',
    # Fast float16/bfloat16 casts; optional: without a C compiler mnopt
    # falls back to numpy (bit-identical, about 10x slower: 100 MB to
    # float16, docs/results/halfcast.md).
    # The sign codec's one-pass loops likewise (numpy fallback, bit-exact).
    ext_modules=[Extension('mnopt.' + name, ['mnopt/%s.c' % name],
                           extra_compile_args=['-O3'], optional=True)
                 for name in ('_halfcast', '_signbits')],
    # The core (communicators, mean_grads, the reduction server, sign
    # compression, the benchmark) needs only these.  An MPI library comes
    # from the 'mpich' extra or from the system (docs/install.md).
    install_requires=[
        'numpy>=1.20',
        'mpi4py>=3.1',
        # Each rank's share of a node's cores for NumPy's BLAS threads
        # (mnopt/cores.py); without it mnopt changes nothing.
        'threadpoolctl>=3',
    ],
    extras_require={
        # MPI itself as a wheel, so no system MPI is needed.
        'mpich': ['mpich'],
        # The ChainerMN-shaped layer (optimizer wrapper, evaluator,
        # datasets).  Chainer 7.8.1 builds only with setuptools<70: install
        # with PIP_CONSTRAINT pointing at a file that says so
        # (constraints/*.txt).
        'chainer': ['chainer>=7.8'],
        # allpairspy: the pairwise combination matrix
        # (tests/test_combinations.py).
        'test': ['pytest>=7', 'pytest-timeout>=2', 'allpairspy>=2.5'],
        # The ImageNet example (images, plots) and the digits example.
        'examples': ['chainer>=7.8', 'Pillow', 'matplotlib', 'scikit-learn'],
        # GPUs: CUDA 12 with CuPy 13 (NumPy 1.x or 2.x) ...
        'gpu': GPU_CUDA12,
        'gpu-cuda12': GPU_CUDA12,
        # ... or CUDA 13 with CuPy 14 (NumPy 2).
        'gpu-cuda13': GPU_CUDA13,
    },
)
