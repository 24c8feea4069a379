# `make run`: set up (first time) and run the main job.
# `make test`: set up (first time) and run the whole test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
NP ?= 2

.PHONY: setup run test bench convergence experiments clean

setup: $(VENV)/.installed

# The constraints reach pip's isolated build environments too: Chainer
# 7.8.1 builds only with setuptools<70 and runs only with numpy<2.
$(VENV)/.installed: setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(PY) -m pip install -q \
	    --disable-pip-version-check -e '.[test,examples]'
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

# The same test modules serially and under mpiexec -n 2 and -n 3.
test: setup
	$(PY) -m pytest -q
	$(MPIEXEC) -n 2 $(PY) -m mpi4py -m pytest -q -p no:cacheprovider
	$(MPIEXEC) -n 3 $(PY) -m mpi4py -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) *.egg-info
