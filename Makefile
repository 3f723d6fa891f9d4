# `make demo` and `make test` are the only set-up a fresh machine needs: each creates .venv if
# missing, installs the package (editable, with the dev extra) and runs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned on the same command line as the package: alone, pip would pull a CUDA build.
PIP_INSTALL := $(BIN)/python -m pip install --quiet --disable-pip-version-check torch==2.13.0
DEMO_DIR ?= .cache/demo

.PHONY: install demo test test-all clean

install: $(BIN)/.installed

$(BIN)/.installed: setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[dev]'
	touch $@

demo: install
	$(BIN)/crm-data demo $(DEMO_DIR)/raw
	$(BIN)/crm-data shard $(DEMO_DIR)/raw/train.jsonl $(DEMO_DIR)/shards
	$(BIN)/crm-data stats $(DEMO_DIR)/shards

test: install
	$(BIN)/python -m pytest -q

# Includes the end-to-end tests marked slow.
test-all: install
	$(BIN)/python -m pytest -q -m ''

clean:
	rm -rf $(VENV) .cache .pytest_cache
