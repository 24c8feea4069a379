from setuptools import Extension, find_packages, setup

setup(
    name='mnopt',
    version='0.1.0',
    description='Multi-node optimizer wrapper for Chainer and CuPy '
                '(a ChainerMN-compatible data-parallel library)',
    long_description=open('README.md').read(),
    long_description_content_type='text/markdown',
    packages=find_packages(include=['mnopt', 'mnopt.*']),
    python_requires='>=3.8',
    # Fast float16/bfloat16 casts; optional: without a C compiler mnopt
    # falls back to numpy (bit-identical, about 10x slower).
    # The sign codec's one-pass loops likewise (numpy fallback, bit-exact).
    ext_modules=[Extension('mnopt.' + name, ['mnopt/%s.c' % name],
                           extra_compile_args=['-O3'], optional=True)
                 for name in ('_halfcast', '_signbits')],
    install_requires=[
        # Chainer 7.8.1 uses np.sctypes, removed in NumPy 2.
        'numpy<2',
        'mpi4py>=3.1',
        # MPI itself, so no system MPI is needed; see docs/install.md for
        # running against a system MPI instead.
        'mpich; platform_system == "Linux"',
        'chainer>=7.8',
    ],
    extras_require={
        'test': ['pytest>=7', 'pytest-timeout>=2'],
        # The ImageNet example (images, plots) and the digits example.
        'examples': ['Pillow', 'matplotlib', 'scikit-learn'],
        'gpu': ['cupy-cuda12x>=12'],
    },
)
