# Two commands do everything on a fresh machine:
#   make run    the main job (pipeline/run.py, embedded default) in a local .venv
#   make test   the test suite (what CI runs)
# The venv is (re)built only when requirements.lock changes.

PY      ?= python3.11
VENV    := .venv
PYTHON  := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?=
# two workers: the Ray tests' modules (one unit of work, one worker) beside the rest
# (tests/conftest.py); XDIST= runs everything in one process
XDIST   ?= -n 2

.PHONY: run test bench venv clean-venv

venv: $(STAMP)

$(STAMP): requirements.lock
	@test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -r requirements.lock
	@touch $(STAMP)

run: $(STAMP)
	$(PYTHON) pipeline/run.py $(ARGS)

test: $(STAMP)
	$(PYTHON) -m pytest tests $(XDIST) $(PYTEST_ARGS)

bench: $(STAMP)
	$(PYTHON) bench/decode.py

clean-venv:
	rm -rf $(VENV)
