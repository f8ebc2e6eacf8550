# Two commands set everything up on a fresh clone:
#   make train   creates .venv if missing, then a short DDP run of ResNet-18 (scripts/quickstart.sh)
#   make test    creates .venv if missing, then the test suite on CPU
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: train test test-floor test-stress venv floor-venv clean

# pip compiles the installed modules to bytecode one file at a time; compileall does it on
# every core (a new .venv: 61 s with pip's, 48 s with this, on the 2-core build machine).
# A module that does not compile on this Python (PyTorch ships a test helper in 3.12 syntax)
# is skipped, as pip skips it.
# pip install, tried up to 3 times. The floor's PyTorch and its CUDA libraries (about 3 GB)
# come from PyPI on a fresh machine, and a download that stalls stalls again on pip's own
# resumes (seen in CI: 6 tries, each stuck at 192.4 of 196.5 MB); a new pip call opens new
# connections, and the wheels it already has come from its cache.
pip_install = for try in 1 2 3; do $(1) -m pip install --quiet $(2) && break; \
	  if [ $$try = 3 ]; then exit 1; fi; echo "pip install failed (try $$try of 3); again in 30 s"; sleep 30; done

# A venv is made again (--clear) when its Python cannot install: no pip (made without Debian's
# python3-venv, or cut short) or older than 3.10 (PyPI has no torch 2.11 for it); else
# `test -x` would keep it, and every pip call fail. The Python it is made from is checked first.
usable = $(1) -c 'import sys, pip; sys.exit(sys.version_info < (3, 10))' 2>/dev/null
make_venv = $(call usable,$(2)/bin/python) || { $(1) -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
	|| { echo "make: $(1) is not Python 3.10 or newer, which PyTorch needs: name one, PYTHON=python3.X" >&2; \
	exit 1; }; $(1) -m venv --clear $(2); }

precompile = $(1) -m compileall -q -j0 "$$($(1) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null || true

$(VENV)/.installed: requirements.txt requirements-test.txt
	$(call make_venv,$(PYTHON),$(VENV))
	$(call pip_install,$(VENV)/bin/python,--upgrade pip)
	$(call pip_install,$(VENV)/bin/python,--no-compile -r requirements.txt -r requirements-test.txt)
	$(call precompile,$(VENV)/bin/python)
	touch $@

venv: $(VENV)/.installed

# The same project on the oldest PyTorch the README lists (requirements-floor.txt pins it,
# beside requirements.txt's other packages), made from FLOOR_PYTHON:
# PYTHON unless told otherwise. CI gives it the system's own CPython where that is another
# build than python3 (.ci/run), so that its two runs also cover two Python builds.
FLOOR_PYTHON ?= $(PYTHON)
FLOOR_VENV := .venv-floor
FLOOR_PY := $(FLOOR_VENV)/bin/python
$(FLOOR_VENV)/.installed: requirements.txt requirements-test.txt requirements-floor.txt
	$(call make_venv,$(FLOOR_PYTHON),$(FLOOR_VENV))
	$(call pip_install,$(FLOOR_PY),--upgrade pip)
	$(call pip_install,$(FLOOR_PY),--no-compile -r requirements-floor.txt -r requirements.txt -r requirements-test.txt)
	$(call precompile,$(FLOOR_PY))
	touch $@

floor-venv: $(FLOOR_VENV)/.installed

train: venv
	bash scripts/quickstart.sh

# One thread per process: the tests start several processes on a small CPU. Test files run
# side by side, TEST_WORKERS at a time (pytest-xdist, one file per worker, longest first: see
# tests/conftest.py): most tests wait on signals, timeouts and rendezvous, and the waiting
# overlaps with work, so 4 suit a 2-core machine. TEST_WORKERS=0 runs them one at a time, in
# one process (for debugging).
TEST_WORKERS ?= 4
XDIST = -n $(TEST_WORKERS) $(if $(filter 0,$(TEST_WORKERS)),,--dist loadfile --no-loadscope-reorder)
# This project's own modules compiled first: where PYTHONDONTWRITEBYTECODE is set, each of the
# suite's hundreds of Python processes would compile utils/ and models/ again.
own_bytecode = $(1) -m compileall -q -j0 utils models scripts tests $(wildcard *.py)
test: venv
	$(call own_bytecode,$(PY))
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The tests of what differs between PyTorch releases, again on the oldest one we support,
# in .venv-floor: process groups, DDP's construction, collectives and their names, FSDP2,
# torchrun and its rendezvous and stores (launchers, stop signals, faults, several hosts),
# mp.spawn, device selection, the profiler's events, the loaders' persistent workers. The
# rest (templates, clipping, the metrics file) runs the same code on any release and is left
# to `make test`, as are the tests marked not_on_floor: each names the tests that make the
# same PyTorch calls here.
FLOOR_TESTS := tests/test_launchers.py tests/test_distributed_mp.py tests/test_fault_tolerance.py \
               tests/test_missed_collective.py tests/test_collectives.py tests/test_ddp.py \
               tests/test_observe.py tests/test_devices.py tests/test_fsdp.py tests/test_hosts.py \
               tests/test_fork_safety.py tests/test_hot_loop.py
test-floor: $(FLOOR_VENV)/.installed
	$(call own_bytecode,$(FLOOR_PY))
	OMP_NUM_THREADS=1 $(FLOOR_PY) -m pytest -q $(XDIST) -m "not stress and not not_on_floor" $(FLOOR_TESTS) $(PYTEST_ARGS)

# Many short multi-process runs, several at a time, every rank required to exit 0: the
# check for rare failures at exit. STRESS_RUNS=N per kind (default 20); PY=... for another venv
# (.venv is built with its own Python whatever PY says).
test-stress: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m stress tests/test_stress_exit.py $(PYTEST_ARGS)

# On a GPU machine, with the python3 that has PyTorch (no venv, no pip): environment, GPU tests,
# the memory table and a short benchmark within 8.5 minutes, into $(OUT) or results/gpu-check/
# (scripts/gpu_check.sh).
.PHONY: gpu-check
gpu-check:
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) $(FLOOR_VENV) .pytest_cache runs
