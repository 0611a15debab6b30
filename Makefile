# Two commands do everything on a fresh machine:
#   make run    the main job (python -m pipeline.run, embedded default) in a local .venv
#   make test   lint (ruff, the import contracts) and the test suite (what CI runs)
# The venv is (re)built only when requirements.lock changes; the project itself is installed into it
# in editable mode (pip install -e .), so `python -m ...` works from any directory.

PY      ?= python3.11
VENV    := .venv
PYTHON  := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?=
# XDIST="-n 2" (or more): pytest-xdist workers, the Ray tests' modules as one unit of work on one
# worker beside the rest (tests/conftest.py). Off by default: on a 2-core box the Ray tests use
# both cores themselves, so two workers took longer (21 min 55 s against 15 min 27 s in one process)
XDIST   ?=

.PHONY: run test bench venv clean-venv

venv: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	@touch $(STAMP)

run: $(STAMP)
	$(PYTHON) -m pipeline.run $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(PYTHON) -m pytest tests $(XDIST) $(PYTEST_ARGS)

bench: $(STAMP)
	$(PYTHON) -m bench.decode

clean-venv:
	rm -rf $(VENV)
