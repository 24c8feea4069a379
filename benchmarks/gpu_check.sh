#!/usr/bin/env bash
# Every GPU check of mnopt in one run, on a machine with a GPU:
#   bash benchmarks/gpu_check.sh [tests] [bench] [zero] [ranks]
#                                        (default: all four, in this order)
# tests: every test with a GPU path, serially (pytest-xdist's workers where
#        it is installed, each a one-rank job sharing the GPU); a missing
#        GPU or NVRTC fails instead of skipping.
# bench: benchmarks/gpu_bench.py (codec bandwidth, NCCL, wrapper overhead).
# zero:  ZeRO's state and held bytes for ResNet-50 with Adam at 2 and 3
#        ranks, CuPy beside NumPy (benchmarks/zero.py --memory [--gpu]).
# ranks: tests/test_gpu{,_modes,_features}.py under mpiexec -n 2
#        and -n 3 (the ranks share the GPU).
# Each stage has a time limit (MNOPT_GPU_CHECK_LIMITS, seconds per stage in
# that order), so one that hangs still leaves the others' results.
# Logs and results go to $OUT (default result/gpu-check): env.txt,
# tests.txt, bench.txt, gpu_bench.json/.md, zero.txt, stages.txt (7 files).
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
for path in ('mnopt/wire/_halfcast', 'mnopt/codecs/_signbits',
             'mnopt/transport/_mpiwait', 'mnopt/stall/_startwatch'):
    subprocess.check_call(['gcc', '-O3', '-fPIC', '-shared', '-I' + include,
                           path + '.c', '-o', path + suffix])
EOF
{
    nvidia-smi -L
    python3 -c 'import sys, numpy, cupy, mpi4py; from cupy.cuda import nccl
print("python", sys.version.split()[0], "numpy", numpy.__version__, "cupy",
      cupy.__version__, "nccl", nccl.get_version(), "mpi4py", mpi4py.__version__)'
    echo "mpiexec: $(command -v mpiexec) libmpi: ${MPI4PY_LIBMPI:-}"
    echo "mpi4py: $(python3 -c 'import mpi4py; print(mpi4py.__file__)')"
    python3 -c 'from mnopt.transport import waiting; print("wait", waiting.kind())'
    mpiexec -n 2 python3 -m mpi4py -m mnopt.check
} 2>&1 | tee "$OUT/env.txt"
# Two processes must make one job, not two singletons (an mpi4py on another
# MPI than mpiexec's).
mpiexec -n 2 python3 -c 'from mpi4py import MPI
assert MPI.COMM_WORLD.size == 2, MPI.Get_library_version()' || exit 1

stages=${*:-tests bench zero ranks}
read -r -a limits <<< "${MNOPT_GPU_CHECK_LIMITS:-240 130 70 55 55}"
if [ "${#limits[@]}" -ne 5 ]; then
    echo "MNOPT_GPU_CHECK_LIMITS: five numbers of seconds (tests, bench," \
        "zero, -n 2, -n 3), not '${MNOPT_GPU_CHECK_LIMITS:-}'"
    exit 2
fi
# This run's logs only (the stages append to them).
: > "$OUT/tests.txt"
: > "$OUT/stages.txt"
limit() {   # limit STAGE: its seconds
    case $1 in tests) echo "${limits[0]}" ;; bench) echo "${limits[1]}" ;;
    zero) echo "${limits[2]}" ;; ranks-2) echo "${limits[3]}" ;;
    ranks-3) echo "${limits[4]}" ;; esac
}
GPU_TESTS="tests/test_gpu.py tests/test_gpu_modes.py tests/test_gpu_features.py"
status=0
for stage in $stages; do
start=$(date +%s)
case $stage in
tests)
    export MNOPT_REQUIRE_GPU=1 MNOPT_REQUIRE_NVRTC=1
    # Eight workers where pytest-xdist is installed.  Each test keeps the
    # suite's own limit (setup.cfg's, scaled by the measured slowdown,
    # tests/conftest.py), under which a hung test fails with its traceback.
    workers=
    python3 -c 'import xdist' 2>/dev/null && workers='-n 8'
    timeout -k 10 "$(limit tests)" python3 -m pytest -q -p no:cacheprovider \
        $workers --durations=15 -rfEs $GPU_TESTS tests/test_cuda_kernels.py \
        tests/test_pinned_buffers.py tests/test_powersgd_core.py 2>&1 \
        | tee -a "$OUT/tests.txt" || status=1
    ;;
ranks)
    export MNOPT_REQUIRE_GPU=1 MNOPT_REQUIRE_NVRTC=1
    for n in 2 3; do
        echo "== mpiexec -n $n" | tee -a "$OUT/tests.txt"
        timeout -k 10 "$(limit ranks-$n)" mpiexec -n $n python3 -m mpi4py \
            -m pytest -q -p no:cacheprovider -rs $GPU_TESTS 2>&1 \
            | tee -a "$OUT/tests.txt" || status=1
    done
    ;;
bench)
    timeout -k 10 "$(limit bench)" python3 benchmarks/gpu_bench.py \
        --out "$OUT" 2>&1 | tee "$OUT/bench.txt" || status=1
    ;;
zero)
    (
        rc=0
        deadline=$(( $(date +%s) + $(limit zero) ))   # one limit for all four
        for n in 2 3; do
            for device in cpu gpu; do
                left=$(( deadline - $(date +%s) ))
                echo "== mpiexec -n $n zero.py --memory ($device)"
                [ "$left" -gt 0 ] || { echo "out of time"; rc=1; continue; }
                flag=; [ $device = gpu ] && flag=--gpu
                timeout -k 10 "$left" mpiexec -n $n python3 -m mpi4py \
                    benchmarks/zero.py --memory --model resnet50 $flag \
                    --modes unsharded,sharded || rc=1
            done
        done
        exit $rc
    ) 2>&1 | tee "$OUT/zero.txt" || status=1
    ;;
*) echo "unknown stage $stage (tests, bench, zero, ranks)"; exit 2 ;;
esac
echo "== $stage took $(( $(date +%s) - start )) s" | tee -a "$OUT/stages.txt"
done
exit $status
