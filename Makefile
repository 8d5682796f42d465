# Two commands set up a fresh machine (each creates .venv on first use):
#   make run    the main job: python -m dtf on its default config (add ARGS="key=value ...")
#   make test   lint + the whole test suite (what CI runs)
#   make test-fast   lint + the tests that run in process (not marked slow): the loop while developing
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
ARGS ?=
PYTEST_ARGS ?=

.PHONY: run test test-fast lint bench clean-venv

$(STAMP): pyproject.toml setup.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/python -m dtf $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check setup.py dtf hydra_plugins tests benchmarks
	$(BIN)/ruff format --check setup.py dtf hydra_plugins tests benchmarks
	$(BIN)/mypy dtf hydra_plugins

# Two pytest-xdist workers: most of a multi-process test's time is process start-up and waiting,
# so two share the 2 cores well (tests/conftest.py keeps each file, and the cluster files, in one worker).
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder

test: lint
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: lint
	$(BIN)/python -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

clean-venv:
	rm -rf $(VENV)
