# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
# The oldest supported megatron-core: the megatron-dependent tests run against it too.
VENV_OLD ?= .venv-mcore013
MCORE_OLD ?= megatron-core==0.13.1
# A CPU build of torch; an unpinned torch would pull several GB of CUDA packages.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=

STAMP = $(VENV)/.installed
STAMP_OLD = $(VENV_OLD)/.installed
DEPS = setup.cfg setup.py pyproject.toml

.PHONY: venv demo test test-main test-oldest bench clean

venv: $(STAMP)

$(STAMP): $(DEPS)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(VENV)/bin/pip install -q $(TORCH_PIN)
	$(VENV)/bin/pip install -q -e ".[test,bench]" build wheel
	touch $@

$(STAMP_OLD): $(DEPS)
	test -x $(VENV_OLD)/bin/python || $(PYTHON) -m venv $(VENV_OLD)
	$(VENV_OLD)/bin/python -c "import torch" 2>/dev/null || $(VENV_OLD)/bin/pip install -q $(TORCH_PIN)
	$(VENV_OLD)/bin/pip install -q "$(MCORE_OLD)" -e ".[test]" wheel
	touch $@

demo: $(STAMP)
	$(VENV)/bin/megatron-rl-patches demo

test: test-main test-oldest

test-main: $(STAMP)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# Only what touches megatron-core runs twice; the pure math does not depend on its version.
test-oldest: $(STAMP_OLD)
	$(VENV_OLD)/bin/python -m pytest -m megatron $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/megatron-rl-patches bench --out bench-out

clean:
	rm -rf $(VENV) $(VENV_OLD) build dist *.egg-info
