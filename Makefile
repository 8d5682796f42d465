# Two commands set up a fresh machine (each creates .venv on first use):
#   make run    the main job: python -m dtf on its default config (add ARGS="key=value ...")
#   make test   lint + the whole test suite (what CI runs)
#   make test-fast   lint + the tests not marked slow (tests/unit, tests/config; no clusters): the loop while developing
#   make test-compat   test-fast on the lowest declared versions (Python 3.10) and the newest (Python 3.13)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
ARGS ?=
PYTEST_ARGS ?=
# The exact versions CI installs: pyproject's ranges resolved once (`make constraints`) on the Python
# its first line names. A venv on another Python resolves the ranges afresh, saying so.
CONSTRAINTS ?= constraints/ci.txt
PIP := $(BIN)/python -m pip --disable-pip-version-check

.PHONY: run test test-fast test-compat compat-tests lint bench clean-venv constraints

$(STAMP): pyproject.toml setup.py $(CONSTRAINTS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@c="$(CONSTRAINTS)"; \
	want=$$(test -z "$$c" || sed -n '1s/^# python \([0-9.]*\).*/\1/p' "$$c"); \
	have=$$($(BIN)/python -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	if [ -n "$$c" ] && [ "$$want" != "$$have" ]; then \
		echo "make: $$c holds Python $$want's versions; this venv is Python $$have: installing the newest that pyproject.toml allows"; c=; \
	fi; \
	echo "$(PIP) install --quiet -e '.[dev]' $${c:+-c $$c}"; \
	$(PIP) install --quiet -e '.[dev]' $${c:+-c $$c}
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

# The declared range, proved at both ends: the lowest versions pyproject.toml allows (constraints/lowest.txt)
# on the oldest Python, and the newest the package index serves on the newest Python, each in a venv of
# its own, each running test-fast's tests. Without test-fast's lint: mypy would judge dtf against those
# versions' own type stubs (matplotlib 3.8's, transformers 5.0's), not its behaviour; `make lint` judges
# the code on CI's set. The interpreters come from pyenv (make COMPAT_LOWEST=... to change them).
COMPAT_LOWEST ?= env PYENV_VERSION=3.10.13 python3.10
COMPAT_NEWEST ?= env PYENV_VERSION=3.13.0 python3.13
test-compat:
	$(MAKE) compat-tests VENV=.venv-lowest PYTHON="$(COMPAT_LOWEST)" CONSTRAINTS=constraints/lowest.txt
	$(MAKE) compat-tests VENV=.venv-newest PYTHON="$(COMPAT_NEWEST)" CONSTRAINTS=

compat-tests: $(STAMP)
	$(BIN)/python -c 'import sys, numpy, pyarrow, pandas, torch; print("Python", sys.version.split()[0], "numpy", numpy.__version__, "pyarrow", pyarrow.__version__, "pandas", pandas.__version__, "torch", torch.__version__)'
	$(BIN)/python -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

# Re-resolves constraints/ci.txt: pyproject's ranges at their newest (torch as constraints/ci.in
# says), in a scratch venv, frozen. Commit the result; CI then installs exactly that.
constraints:
	rm -rf .venv-resolve
	$(PYTHON) -m venv .venv-resolve
	.venv-resolve/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]' -c constraints/ci.in
	( .venv-resolve/bin/python -c 'import sys; print("# python %d.%d" % sys.version_info[:2])'; \
	  echo "# pip freeze of pyproject's ranges resolved at their newest (make constraints); CI installs exactly these"; \
	  .venv-resolve/bin/python -m pip freeze --exclude-editable --disable-pip-version-check ) > constraints/ci.txt
	rm -rf .venv-resolve

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

clean-venv:
	rm -rf $(VENV)
