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
PYTHON ?= python3
STACK ?= numpy2
STACKS ?= numpy2 numpy1 core
NP ?= 2
VENV := .venv/$(STACK)
PY := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec

# What each stack installs on top of mnopt's own requirements.
EXTRAS_numpy2 := mpich,test,examples
EXTRAS_numpy1 := mpich,test,examples
EXTRAS_core := mpich,test
# CuPy 14 with the CUDA runtime compiler and NCCL (not the whole toolkit).
MORE_core := cupy-cuda13x nvidia-cuda-nvrtc nvidia-nccl-cu13

.PHONY: setup run test bench convergence experiments clean

setup: $(VENV)/.installed

# The constraints reach pip's isolated build environments too: Chainer
# 7.8.1 builds only with setuptools<70.
.venv/%/.installed: setup.py constraints/%.txt Makefile
	rm -rf .venv/$*
	$(PYTHON) -m venv .venv/$*
	PIP_CONSTRAINT=$(CURDIR)/constraints/$*.txt .venv/$*/bin/python -m pip \
	    install -q --disable-pip-version-check -e '.[$(EXTRAS_$*)]' \
	    $(MORE_$*)
	touch $@

# The main job: the ImageNet example on its embedded dataset (built once,
# cached), about a minute on 2 CPU cores.
run: setup
	$(MPIEXEC) -n $(NP) $(PY) -m mpi4py examples/imagenet/train_imagenet.py \
	    --out result/imagenet

bench: setup
	$(MPIEXEC) -n $(NP) $(PY) -m mpi4py -m mnopt.benchmark

convergence: setup
	$(PY) examples/digits/convergence.py --out docs/results

# Needs root (network namespaces, tc); about 15 minutes.
experiments: setup
	$(PY) benchmarks/experiments.py

# Every stack in turn: the same test modules serially and under
# mpiexec -n 2 and -n 3.  The core stack runs serially: it adds the
# no-Chainer case and the kernel compile check, which must not skip there.
test: $(addprefix test-,$(STACKS))

test-%: .venv/%/.installed
	@.venv/$*/bin/python -c 'import sys, numpy; print("== stack $*: Python", sys.version.split()[0], "NumPy", numpy.__version__)'
	if [ $* = core ]; then \
	    MNOPT_REQUIRE_NVRTC=1 .venv/$*/bin/python -m pytest -q; \
	else \
	    .venv/$*/bin/python -m pytest -q && \
	    .venv/$*/bin/mpiexec -n 2 .venv/$*/bin/python -m mpi4py -m pytest -q -p no:cacheprovider && \
	    .venv/$*/bin/mpiexec -n 3 .venv/$*/bin/python -m mpi4py -m pytest -q -p no:cacheprovider; \
	fi

clean:
	rm -rf .venv *.egg-info
