# Two commands for a fresh machine: `make run` (the whole chain on the embedded default)
# and `make test` (the test suite, lint included). Both set up .venv first if needed.

VENV ?= .venv
PY := $(VENV)/bin/python
CORES ?= 2

$(VENV)/.installed: requirements.txt requirements-dev.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

.PHONY: setup run test lint
setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/snakemake -c$(CORES) --workflow-profile profiles/local

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/snakefmt --check Snakefile rules/
	$(VENV)/bin/snakemake --lint

test: lint
	$(PY) -m pytest -q
