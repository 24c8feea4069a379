#!/usr/bin/env bash
# Every GPU check of mnopt in one run, on a machine with a GPU:
#   bash benchmarks/gpu_check.sh [tests] [bench]     (default: both)
# tests: tests/test_gpu.py and tests/test_cuda_kernels.py serially, then
#        tests/test_gpu.py under mpiexec -n 2 and -n 3 (ranks share the GPU);
#        a missing GPU or NVRTC fails instead of skipping.
# bench: benchmarks/gpu_bench.py (codec bandwidth, NCCL, wrapper overhead).
# Logs and results go to $OUT (default result/gpu-check).
#
# Packages the machine lacks travel as wheels in .whl/ (make gpu-wheels
# fills it): they are installed into /tmp/site and put first on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-result/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G '.whl/*.whl' >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site \
        $(ls .whl/*.whl | grep -v /mpich-) || exit 1
    export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
if compgen -G '.whl/mpich-*.whl' >/dev/null; then
    # The MPICH wheel holds a prefix (bin/, lib/) that pip --target drops:
    # unpack it as it is, and point mpi4py's wheel (which runs on MPICH or
    # Open MPI) at its library rather than a system MPI found first.
    rm -rf /tmp/mpich && python3 -m zipfile -e .whl/mpich-*.whl /tmp/mpich
    prefix=$(echo /tmp/mpich/mpich-*.data/data)
    chmod +x "$prefix"/bin/*
    export PATH=$prefix/bin:$PATH MPI4PY_MPIABI=mpich
    export MPI4PY_LIBMPI=$prefix/lib/libmpi.so.12
    export LD_LIBRARY_PATH=$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
if [ -d /tmp/site ]; then
    # What pip's install of mnopt adds: Chainer's NumPy 2 names, whatever
    # imports Chainer first.
    cp mnopt-chainer-numpy2.pth "$(python3 -c \
        'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
fi
# C loops of the host codec, for this Python (the wheel build does this).
python3 - <<'EOF' || exit 1
import glob, subprocess, sys, sysconfig
suffix = sysconfig.get_config_var('EXT_SUFFIX')
include = sysconfig.get_paths()['include']
for name in ('_halfcast', '_signbits'):
    subprocess.check_call(['gcc', '-O3', '-fPIC', '-shared', '-I' + include,
                           'mnopt/%s.c' % name, '-o', 'mnopt/%s%s' % (name, suffix)])
EOF
stages=${*:-tests bench}
status=0
{
    nvidia-smi -L
    python3 -c 'import sys, numpy, cupy, mpi4py; from cupy.cuda import nccl
print("python", sys.version.split()[0], "numpy", numpy.__version__, "cupy",
      cupy.__version__, "nccl", nccl.get_version(), "mpi4py", mpi4py.__version__)'
    echo "mpiexec: $(command -v mpiexec) libmpi: ${MPI4PY_LIBMPI:-}"
    echo "mpi4py: $(python3 -c 'import mpi4py; print(mpi4py.__file__)')"
    mpiexec -n 2 python3 -m mpi4py -m mnopt.check
} 2>&1 | tee "$OUT/env.txt"
# Two processes must make one job, not two singletons (an mpi4py on another
# MPI than mpiexec's).
mpiexec -n 2 python3 -c 'from mpi4py import MPI
assert MPI.COMM_WORLD.size == 2, MPI.Get_library_version()' || exit 1

for stage in $stages; do
case $stage in
tests)
    export MNOPT_REQUIRE_GPU=1 MNOPT_REQUIRE_NVRTC=1
    start=$(date +%s)
    python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
        tests/test_cuda_kernels.py -rs 2>&1 | tee "$OUT/tests-n1.txt" \
        || status=1
    for n in 2 3; do
        mpiexec -n $n python3 -m mpi4py -m pytest -q -p no:cacheprovider \
            tests/test_gpu.py -rs 2>&1 | tee "$OUT/tests-n$n.txt" || status=1
    done
    echo "== tests took $(( $(date +%s) - start )) s"
    ;;
bench)
    python3 benchmarks/gpu_bench.py --out "$OUT" 2>&1 \
        | tee "$OUT/bench.txt" || status=1
    ;;
*) echo "unknown stage $stage (tests, bench)"; exit 2 ;;
esac
done
exit $status
