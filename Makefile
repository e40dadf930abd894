# The two commands: `make run` and `make test`. Each installs what is missing first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PDSERVE := $(VENV)/bin/pdserve

.PHONY: setup run test test-all test-gpu lint typecheck protos check-protos unit e2e docker docker-smoke

setup:
	@bash scripts/setup.sh

run: setup
	@$(PDSERVE) up --model-path .cache/models/tiny

lint: setup
	$(VENV)/bin/ruff check .

# The deployed packages (pdserve/, services/, engine/, libkv/) type-check with zero errors: pyproject's [tool.mypy].
typecheck: setup
	$(VENV)/bin/mypy

protos: setup
	@bash scripts/gen_protos.sh

# Regenerate the protobuf code and fail if it differs from what is committed.
check-protos: setup
	@bash scripts/gen_protos.sh --check

# The unit tests on two workers (pytest-xdist; a file's tests stay on one worker, so its module
# fixtures are built once). The e2e tests run one at a time: the timing bounds of their processes
# (leases, hung requests, fault detection) assume the machine to themselves.
UNIT := -m "not e2e" -n 2 --dist loadfile
unit: setup
	$(PY) -m pytest -q $(UNIT) tests

e2e: setup
	$(PY) -m pytest -q -m e2e tests

# Each half leaves a JUnit report (every test's time) in .cache/test-reports/.
test: setup lint typecheck check-protos
	$(PY) -m pytest -q -ra --durations=10 --junitxml=.cache/test-reports/unit.xml $(UNIT) tests
	$(PY) -m pytest -q -ra --durations=15 --junitxml=.cache/test-reports/e2e.xml -m e2e tests

# Everything `make test` runs, and the long tests it leaves out (tests/conftest.py): the whole chaos
# table and its soak, the full schemathesis fuzz, the compose build from cold, the benchmark commands
# end to end, the whole e2e matrices.
test-all: setup lint typecheck check-protos
	$(PY) -m pytest -q -ra --durations=10 --long $(UNIT) tests
	$(PY) -m pytest -q -ra --durations=25 --long -m e2e tests

# On a machine with NVIDIA GPUs: its own venv (.venv-gpu, CUDA wheels), then the GPU suite (tests/gpu)
# and the CUDA bench, with a summary table. Not part of `test`, and independent of `setup`.
test-gpu:
	@bash scripts/test_gpu.sh

# Container images of the four services, and a compose up + one request + down (needs a Docker engine).
docker:
	@bash docker/build.sh

docker-smoke:
	@bash docker/smoke.sh
