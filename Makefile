# The two commands: `make run` and `make test`. Each installs what is missing first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PDSERVE := $(VENV)/bin/pdserve

.PHONY: setup run test test-all test-spec test-gpu lint typecheck protos check-protos unit e2e docker docker-smoke

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

# Tests run on two workers (pytest-xdist; a file's tests stay on one worker, so its module fixtures
# are built once): the unit tests, then the e2e tests, which mostly wait on their processes (on two
# cores one at a time keeps the machine 60% busy). The e2e modules marked `alone` run after, one at a
# time: their verdicts hang on bounds of a few seconds (1.5 s leases, 10 s hung requests, a 2 s
# keepalive, a 5 s encoder timeout) that assume the machine to themselves.
UNIT := -m "not e2e" -n 2 --dist loadfile
E2E := -m "e2e and not alone" -n 2 --dist loadfile
E2E_ALONE := -m "e2e and alone"
unit: setup
	$(PY) -m pytest -q $(UNIT) tests

e2e: setup
	$(PY) -m pytest -q $(E2E) tests
	$(PY) -m pytest -q $(E2E_ALONE) tests

# Each part leaves a JUnit report (every test's time) in .cache/test-reports/.
test: setup lint typecheck check-protos
	$(PY) -m pytest -q -ra --durations=10 --junitxml=.cache/test-reports/unit.xml $(UNIT) tests
	$(PY) -m pytest -q -ra --durations=15 --junitxml=.cache/test-reports/e2e.xml $(E2E) tests
	$(PY) -m pytest -q -ra --durations=10 --junitxml=.cache/test-reports/e2e-alone.xml $(E2E_ALONE) tests

# Everything `make test` runs, and the long tests it leaves out (tests/conftest.py): the whole chaos
# table and its soak, the full schemathesis fuzz, the compose build from cold, the benchmark commands
# end to end, the whole e2e matrices. Its e2e tests run one at a time: the benchmark commands among
# them measure, and nothing bounds its time.
test-all: setup lint typecheck check-protos
	$(PY) -m pytest -q -ra --durations=10 --long $(UNIT) tests
	$(PY) -m pytest -q -ra --durations=25 --long -m e2e tests
	$(MAKE) test-spec

# The e2e tests of exactness again with n-gram speculative decoding on every worker they start:
# greedy output must not change. Tests that forge control-plane calls by hand are left out (a forged
# call carries no draft config, so the handshake refuses it first, rightly, for another reason).
# On two workers, as make test's e2e: 44 cases in about 6.5 minutes on a quiet 2-core machine.
SPEC_E2E := test_pd_services test_migration test_prefix_cache_pd test_tp test_pp \
	test_moe_mla_pd test_expert_parallel_pd test_vl_pd test_multi_node test_kv_checksum test_saved_checkpoints
test-spec: setup
	$(PY) -m pytest -q -ra -m e2e -k "not forged" -n 2 --dist loadfile --worker-flags="--speculative-algorithm NGRAM" \
		$(SPEC_E2E:%=tests/e2e/%.py)

# On a machine with NVIDIA GPUs: its own venv (.venv-gpu, CUDA wheels), then the GPU suite (tests/gpu)
# and the CUDA bench, with a summary table. Not part of `test`, and independent of `setup`.
test-gpu:
	@bash scripts/test_gpu.sh

# Container images of the four services, and a compose up + one request + down (needs a Docker engine).
docker:
	@bash docker/build.sh

docker-smoke:
	@bash docker/smoke.sh
