# Two commands: `make up` runs the whole service, `make test` runs the whole suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install up test test-floor lint bench clean compose-env

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# A CUDA torch you installed yourself is kept; otherwise take the CPU build 2.13.0 first,
	@# so the project's torch range installs nothing more.
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

up: install
	$(VENV)/bin/ftune up

# docker-compose's secrets, once, before the first `docker compose up`: .env (mode 600) with random
# POSTGRES_PASSWORD, REDIS_PASSWORD and FTUNE_INFERENCE_API_KEY; values already there are kept.
compose-env:
	$(PYTHON) -m cli.compose_env

# One OpenMP thread a process: the suite runs several training processes at once (its workers, or a worker
# and the service it drives), and torch's default 2-thread pools on 2 cores spin at their barriers
# (2026-11-27, the demo model's 60 steps: two runs at once took 88-102 s, one alone 10-22 s; with one
# thread each the pair took 14-26 s). With one thread each, a third pytest-xdist worker fills the time
# the others wait on servers and subprocesses (2026-11-27, 2 cores: 2 workers 23:41, 3 workers 18:26;
# with 2 threads a process 3 workers had been slower than 2). TEST_WORKERS=0 runs it in one process.
# --durations=30: the slowest tests, so a CI log says where the time went.
TEST_WORKERS ?= 3
TEST_THREADS ?= 1
test: install
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -n $(TEST_WORKERS) --durations=30

# The dependency floor (.ci/run runs it after `make test`): the engine's and core's tests with every runtime dependency at the lowest version
# pyproject.toml allows, in a venv of its own (.venv-floor; .ci/floor says which tests).
test-floor:
	PYTHON=$(PYTHON) bash .ci/floor

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy core planner graders training inference models api worker cli
	$(VENV)/bin/lint-imports
	$(PY) -m tests.duplicate_lines core planner graders training inference models api worker cli

bench: install
	$(PY) bench/planner_accuracy.py
	$(PY) bench/planner_self.py
	$(PY) bench/inference.py
	$(PY) bench/data_throughput.py
	$(PY) bench/train_throughput.py
	$(PY) bench/packing.py

clean:
	rm -rf var test-artifacts .pytest_cache
