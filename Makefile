# Everything a fresh machine needs: `make demo` and `make test` each set up .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch lies on this machine's disk; a plain `torch` requirement could pull CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: venv demo test test-unit test-integration lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: venv
	$(PY) examples/demo.py

# One line-length rule (120, pyproject.toml) and a clean type check, enforced by `make test`.
lint: venv
	$(VENV)/bin/ruff check core elastic trainer ckpt chaos tests examples bench
	$(VENV)/bin/mypy

# pytest exits 5 when it collected no tests: that is a failure, not a pass. Two workers (pytest-xdist): most of
# a test's time is spent waiting on the processes it started, and the tests pass beside a CPU-heavy job anyway.
# Each module runs whole on one worker (loadfile: its module-scoped fixtures run once), the slowest first
# (tests/conftest.py). TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: venv lint
	$(PY) -m pytest tests -q -n $(TEST_WORKERS) --dist loadfile --durations=15; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

test-unit: venv
	$(PY) -m pytest tests/unit -q

test-integration: venv
	$(PY) -m pytest tests/integration -q

bench: venv
	$(PY) bench/ckpt_bench.py --device cpu --state-gb 1

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
