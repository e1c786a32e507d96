# DCS developer commands. `make test` works on a fresh machine: it builds .venv, installs the
# project (CPU torch pinned), installs redis-server, redis-sentinel and haproxy with apt when missing, then lints and tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH_PIN ?= torch==2.13.0
# Where pip looks for torch. Empty: the default index (PyPI's torch 2.13.0 for x86_64 Linux is the multi-GB CUDA
# build; this project's CI machines hold the CPU build locally, so they get that). For the CPU build elsewhere:
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PYTEST_ARGS ?=
# Test files run in this many processes (pytest-xdist, whole files per process: tests in one file share fixtures
# and order; tests/conftest.py keeps the SGLang and the vLLM engine files each in one process); 0 runs everything
# in one process, longest files first (tests/helpers/schedule.py). On a 2-core machine 4 processes ran the suite in
# 422 s (1,552 tests), 5 in 414 s with a fifth more contention (docs/testing.md), 6 slower and with timing failures.
PYTEST_WORKERS ?= 4

.PHONY: install redis-bin sglang-engines vllm-engines verl-lib lint typecheck test-bytecode test test-unit test-fast demo bench bench-storage clean format
.PHONY: compose-wheels compose-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH_PIN)"
	$(BIN)/pip install --quiet -e ".[test,ops,demo]"
	touch $@

install: $(VENV)/.installed

# redis-sentinel: the Sentinel failover tests (tests/helpers/sentinel.py) start three sentinels;
# haproxy: the coordinator-replica test (tests/helpers/haproxy.py) puts two coordinators behind it
redis-bin:
	@{ command -v redis-server && command -v redis-sentinel && { command -v haproxy || test -x /usr/sbin/haproxy; }; } >/dev/null 2>&1 || { \
		echo "redis-server, redis-sentinel or haproxy missing: installing them with apt"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-sentinel haproxy >/dev/null; }

# Real SGLang versions (no GPU deps) under .sglang/ for tests/sglang_engine (see tests/sglang_engine/README.md).
sglang-engines: install
	$(BIN)/python -m tests.sglang_engine.install

# Real vLLM (no GPU deps) under .vllm/ for tests/vllm_engine (see tests/vllm_engine/README.md).
vllm-engines: install
	$(BIN)/python -m tests.vllm_engine.install

# verl 0.9.1 and the few packages verl.checkpoint_engine imports (ray's core wheel among them; no CUDA, torch kept)
# under .verl/, --no-deps: verl's own requirements (ray[default], transformers<5.11) would replace the .venv's
# (tests/verl_lib/__init__.py). For tests/integration/test_verl_backend.py and examples/verl_backend.py.
verl-lib: install
	$(BIN)/python -m tests.verl_lib.install

format: install
	$(BIN)/ruff format dcs_tasks coordinator workers tests bench examples plugins
	$(BIN)/ruff check --fix dcs_tasks coordinator workers tests bench examples plugins

lint: install
	$(BIN)/ruff check dcs_tasks coordinator workers tests bench examples plugins

typecheck: install
	$(BIN)/mypy

# The suite's and the product's modules compiled once and kept as bytecode beside them, pytest's assertion rewriting
# included, also where PYTHONDONTWRITEBYTECODE is set: the 4 pytest processes then load the rewritten test modules
# instead of each rewriting ~190 of them (collection 8.7 s -> 4.8 s per process), and every fresh interpreter the
# suite starts loads DCS's bytecode. Redone when a .py file changes; .ci/run makes it beside lint and mypy.
BYTECODE_SOURCES := $(shell find dcs_tasks coordinator workers tests examples -name '*.py' 2>/dev/null)
$(VENV)/.bytecode: $(VENV)/.installed $(BYTECODE_SOURCES) pyproject.toml
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m compileall -q dcs_tasks coordinator workers tests examples >/dev/null
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest --collect-only -q -n 0 -p no:cacheprovider >/dev/null
	touch $@

test-bytecode: $(VENV)/.bytecode

test: install redis-bin sglang-engines vllm-engines verl-lib lint typecheck test-bytecode
	@df -h . "$${TMPDIR:-/tmp}" /dev/shm | sed "s/^/disk before the suite: /"
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# tests/unit: no Redis, worker or server processes (CLI and import checks run `python -c`); under a minute
test-unit: install
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# compose/ brought up for real under podman (docs/operations.md, Compose under podman); root, a few minutes; CI runs
# it as its own step after `make test` (.ci/run). compose/podman/setup.sh installs podman, runc and debootstrap with
# apt and makes the Debian base image; compose-wheels hands the image build the wheels .venv's pip finds (torch's
# CPU build on the CI machines; async-timeout: redis needs it below Python 3.11.3, and Debian 12's is 3.11.2);
# tests/compose builds the image, brings the stack up with podman-compose, saves, restores and pushes weights from
# this machine, scrapes Prometheus and brings it down. Phase times: .dcs-run/compose-timings.json.
PODMAN_COMPOSE_PIN ?= podman-compose==1.6.0

compose-wheels: install
	rm -f compose/wheels/*.whl
	$(BIN)/pip wheel --quiet -w compose/wheels $(if $(TORCH_INDEX),--extra-index-url "$(TORCH_INDEX)") \
		"$(TORCH_PIN)" ".[ops]" "setuptools>=68" wheel "async-timeout>=4.0.3"
	rm -f compose/wheels/dcs-*.whl

compose-test: install compose-wheels
	compose/podman/setup.sh
	$(BIN)/pip install --quiet "$(PODMAN_COMPOSE_PIN)"
	mkdir -p .dcs-run
	DCS_COMPOSE_TEST=1 DCS_COMPOSE_TIMINGS=.dcs-run/compose-timings.json \
		CONTAINERS_CONF="$(CURDIR)/compose/podman/containers.conf" \
		$(BIN)/python -m pytest -s tests/compose $(PYTEST_ARGS)

demo: install redis-bin
	$(BIN)/dcs demo

bench: install redis-bin
	$(BIN)/python bench/coordinator_load.py
	$(BIN)/python bench/fleet_heartbeats.py
	$(BIN)/python bench/save.py
	$(BIN)/python bench/goodput.py
	$(BIN)/python bench/reshard.py
	$(BIN)/python bench/incremental.py
	$(BIN)/python bench/replica.py
	$(BIN)/python bench/compression.py
	$(BIN)/python bench/weight_sync.py
	$(BIN)/python bench/http_roundtrip.py
	$(BIN)/python bench/task_latency.py
	$(MAKE) bench-storage

# Checkpoints through S3 against a local OpenStack Swift s3api server (started for the run), beside s3transfer,
# obstore and DCP's S3 writers (the bench extras; s3fs, which pins an older botocore than boto3's, goes into
# .bench-s3fs/ and runs in a child process of the bench with that folder first on its path).
bench-storage: install redis-bin
	$(BIN)/pip install --quiet -e ".[test,bench]"
	test -d .bench-s3fs/s3fs || $(BIN)/pip install --quiet --target .bench-s3fs "s3fs>=2025.1"
	$(BIN)/python -m tests.helpers.s3server -- $(BIN)/python bench/storage.py --bucket bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
