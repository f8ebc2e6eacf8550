# Two commands set everything up on a fresh clone:
#   make train   creates .venv if missing, then a short DDP run of ResNet-18 (scripts/quickstart.sh)
#   make test    creates .venv if missing, then the test suite on CPU
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: train test venv clean

$(VENV)/.installed: requirements.txt requirements-test.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-test.txt
	touch $@

venv: $(VENV)/.installed

train: venv
	bash scripts/quickstart.sh

# One thread per process: the tests start several processes on a small CPU.
test: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_ARGS)

# On a GPU machine, with the python3 that has PyTorch (no venv, no pip): environment, GPU tests
# and a short benchmark within 8.5 minutes, into $(OUT) or results/gpu-check/ (scripts/gpu_check.sh).
.PHONY: gpu-check
gpu-check:
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache runs
