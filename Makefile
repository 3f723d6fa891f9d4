# `make demo` and `make test` are the only set-up a fresh machine needs: each creates .venv if
# missing, installs the package (editable, with the dev extra) and runs. `make lint` runs ruff
# (pyproject.toml).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned on the same command line as the package: alone, pip would pull a CUDA build.
PIP_INSTALL := $(BIN)/python -m pip install --quiet --disable-pip-version-check torch==2.13.0

.PHONY: install demo usl rl test lint clean

install: $(BIN)/.installed

# The RL adapters' tests drive the real clients (docs/RL.md "Versions"): openrlhf and verl installed
# without their GPU stack (deepspeed, vllm; ray comes with the dev extra, for engine=ray, and
# tests/stubs.py stands in for it where it is missing), plus the small
# modules the code they import needs. --no-deps: their pins (transformers, torch) are not ours.
RL_CLIENTS := openrlhf==0.11.2 verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 codetiming==1.4.0 \
	pylatexenc==2.10

$(BIN)/.installed: setup.py Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[dev]'
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps $(RL_CLIENTS)
	touch $@

# The embedded CPU demo: generate data -> shard -> train the tiny pointwise CRM with ties -> export
# -> evaluate on the held-out test files (outputs/demo/metrics.json). A rerun resumes the same run;
# `make demo ARGS="name=other"` starts a new one. Then crm-eval (outputs/eval/<name>) and
# crm-leaderboard under two contradictory criteria sets (outputs/leaderboard/<name>; a pairwise
# CRM, ARGS="loss=cls", judged in both orders: a pointwise one has no order to swap).
demo: install
	$(BIN)/crm-train $(ARGS)
	@root=$${CRM_ROOT:-.}; name=$$(echo " $(ARGS)" | sed -n 's/.* name=\([^ ]*\).*/\1/p'); \
	name=$${name:-demo}; raw=$$root/.cache/demo/raw; model=$$root/outputs/$$name/export; \
	tests=$$(ls $$raw/test/*.jsonl | paste -sd, -); set -x; \
	$(BIN)/crm-eval checkpoint=$$model name=$$name "data.test=[$$tests]" && \
	$(BIN)/crm-leaderboard checkpoint=$$model name=$$name both_orders=true \
	  bench=$$raw/bench.jsonl baseline=baseline \
	  labels.criteria=detailed 'criteria=["I prefer detailed answers that cover everything."]' \
	  labels.contrast=concise 'contrast=["I prefer short, to-the-point answers."]'

# The leaderboard web app (crm-usl) on the demo's CRM and benchmark; `make usl ARGS="port=7861"`.
usl: install
	$(BIN)/crm-usl $(ARGS)

# After make demo: GRPO with the demo's CRM as the reward under "short" and "detailed" criteria,
# its controls and guards, and the measured evidence (outputs/rl/demo/rl.json; docs/RL.md).
rl: install
	$(BIN)/crm-rl $(ARGS)

# Two pytest-xdist workers, one per core, whole files each (a file's module fixtures are built
# once); a test marked both_cores (ranks, a SLURM job's tasks) runs while the other worker waits
# (tests/conftest.py). Files go out in tests/conftest.py's order (both_cores files first, then
# longest first by tests/durations.json): --no-loadscope-reorder keeps xdist from re-sorting
# them by test count. `make test PYTEST_PARALLEL=` runs it in one process.
PYTEST_PARALLEL ?= -n 2 --dist loadfile --no-loadscope-reorder

# The app's browser tests drive Debian's chromium (Playwright never downloads a browser here):
# installed with apt-get when missing, which needs root (as CI has on a fresh machine).
CHROMIUM ?= /usr/bin/chromium

$(CHROMIUM):
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium

# The whole suite, the end-to-end tests marked slow included, on two pytest-xdist workers
# (docs/TESTING.md: how it runs and what it costs).
# `$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not slow"` leaves the
# slow ones out while you work.
test: install $(CHROMIUM)
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL)

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .cache .pytest_cache
