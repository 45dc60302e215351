# Two commands on a fresh machine: `make demo` and `make test`.
#
# Test lanes (`make test` runs all five; each lane's venv is built on first use):
#   main    .venv            Python 3.11, megatron-core 0.16.1: every test
#   oldest  .venv-mcore013   Python 3.11, megatron-core 0.13.1: tests marked `megatron`, not
#                            `version_blind` or `reader_facing` (docs/testing.md, "Where a test runs")
#   newest  .venv-mcore019   Python 3.12, megatron-core 0.19.2: tests marked `megatron` (not
#                            `version_blind`) or `triton` (megatron-core >= 0.17 needs Python
#                            >= 3.12; its wheel ships megatron.training, so the real Megatron-LM
#                            train() runs here; torch's CUDA wheel brings triton, whose kernels
#                            run on CPU under TRITON_INTERPRET=1, exported for that pytest process
#                            only)
#   verl    .venv-mcore019 + .lanes/verl: verl 0.9.1 and the modules its engine and
#                            distillation files import (tools/verl-lane.txt), --no-deps:
#                            tests marked `verl`
#   served  .venv + a real vLLM server from .lanes/vllm (vLLM's CPU build, tools/served-lane.txt,
#                            its own Python 3.11 venv): tests marked `served` (tests/teachers/lane)
#
# Not part of `make test`: `make test-nemo NEMO_RL=...` (.venv-mcore019 + .lanes/nemo-rl: NeMo-RL
# 7ea279ab's source and tools/nemo-rl-lane.txt, --no-deps: tests marked `nemo_rl`), `make mutate MODULE=...
# TESTS=...` (mutation testing of one module against its tests: mutmut in .lanes/mutmut,
# tools/mutmut-lane.txt), `make test-mbridge` (.venv + .lanes/mbridge: mbridge 0.15.1 and einops,
# tools/mbridge-lane.txt, --no-deps: tests marked `mbridge`, the optional converter="mbridge").
#
# On a CUDA machine (not part of `make test`; installs nothing, uses $(GPU_PYTHON) as it is):
#   make test-gpu    tests marked megatron, triton or gpu on CUDA (Triton compiled, no interpreter)
#   make bench-gpu   `megatron-rl-patches bench gpu` into bench-gpu-out/
PYTHON ?= python3
VENV ?= .venv
VENV_OLD ?= .venv-mcore013
VENV_NEW ?= .venv-mcore019
MCORE_MAIN ?= megatron-core==0.16.1
MCORE_OLD ?= megatron-core==0.13.1
MCORE_NEW ?= megatron-core==0.19.2
PYTHON_NEW ?= $(shell tools/find-python 3.12)
# the served lane's vLLM venv: torch 2.13.0+cpu, which vLLM's CPU build pins, is served for 3.11 here
PYTHON_VLLM ?= $(shell tools/find-python 3.11)
# torch 2.13: on Python 3.11 this index serves a CPU build; on 3.12 the CUDA build (it runs on CPU).
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=
# The lanes let Python cache bytecode in the clone (__pycache__, git-ignored), its default: where the
# machine sets PYTHONDONTWRITEBYTECODE, each xdist worker rewrote every test module's assertions and
# each fresh interpreter and rank compiled the package from source again (the oldest lane after a run
# that wrote the caches: 182 s -> 167 s, idle; the same tests).
unexport PYTHONDONTWRITEBYTECODE
# The three megatron lanes run on both cores: pytest-xdist, one test module per worker at a time
# (--dist loadfile: a module's multi-rank world is still spawned once). `make test WORKERS=0` runs serially.
# The heaviest modules first (tests/kit/heavy_first.py; --no-loadscope-reorder keeps that order: xdist's
# own, most tests first, left a one-test module spawning a 30-second world to the end, one worker idle).
WORKERS ?= 2
PARALLEL = $(if $(filter-out 0,$(WORKERS)),-n $(WORKERS) --dist loadfile --no-loadscope-reorder)
# Each worker's torch runs on its share of the cores (OMP_NUM_THREADS: cores / workers, at least 1;
# a value the caller set is kept; nproc counts the cores, not that value): two workers of two OpenMP
# threads each on two cores spun against each other (GNU OpenMP's busy wait), in each test process and
# the fresh interpreters it starts. Idle, the same tests: main 442 s -> 418 s, newest 428 s -> 322 s.
# Tests of a thread count set their own (tests/ops/invariance); a world's ranks run one thread each.
LANE_THREADS = $(shell n=$$(( $$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2> /dev/null || echo 1) / $(WORKERS) )); [ $$n -ge 1 ] || n=1; echo $$n)
THREADS = $(if $(filter-out 0,$(WORKERS)),OMP_NUM_THREADS=$${OMP_NUM_THREADS:-$(LANE_THREADS)})
# The lanes of real servers (served, verl) run many processes with OpenMP pools on two cores at once
# (vLLM servers, the tests, their ranks): an idle pool's threads sleep instead of spinning (a value
# the caller set is kept; the numbers do not change, only how a waiting thread waits). The served
# lane, idle: 212.5 s -> 187.9 s, 299 -> 267 CPU-s (the same tests).
PASSIVE = OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE}
# The interpreter of the GPU targets: whatever has torch with CUDA there (nothing is installed).
GPU_PYTHON ?= python3
GPU_ENV = env -u TRITON_INTERPRET PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}
# Extra megatron-core releases run once by `make test-versions` (not in CI): old ones on 3.11,
# new ones on 3.12, each installed into its own folder and put first on PYTHONPATH.
VERSIONS_OLD ?= 0.14.0 0.15.3
VERSIONS_NEW ?= 0.17.1 0.18.2

# hf: safetensors, the reader of Hugging Face checkpoints; hf-test: transformers, the reference
# forward of the Hugging Face teacher tests (skipped without it)
# served: httpx, the client of teachers served by an inference engine
EXTRAS_MAIN = megatron,test,bench,hf,hf-test,served
EXTRAS_LANE = megatron,test,hf,hf-test

STAMP = $(VENV)/.installed
STAMP_OLD = $(VENV_OLD)/.installed
STAMP_NEW = $(VENV_NEW)/.installed
DEPS = setup.cfg setup.py pyproject.toml

.PHONY: venv vllm-lane demo test test-main test-oldest test-newest test-verl test-served test-mbridge test-slime test-nemo test-versions test-source test-gpu bench bench-shared-prefix bench-gpu bench-slime mutate clean

venv: $(STAMP)

# A long quiet step (pip -q) says it still runs: `$(call ticking,WHAT,COMMAND)` runs COMMAND with a
# line `make: WHAT: still running (N s)` every $(TICK_S) seconds, and exits with COMMAND's status.
# (The estimates the build lines print are for an idle 2-core machine; a busy one takes longer.)
TICK_S ?= 30
ticking = ( t0=$$(date +%s); while sleep $(TICK_S) > /dev/null 2>&1; do echo "make: $(1): still running ($$(( $$(date +%s) - t0 )) s)"; done ) & tick=$$!; ( $(2) ); status=$$?; kill $$tick 2> /dev/null; exit $$status

# $(1): venv folder, $(2): interpreter, $(3): megatron-core pin, $(4): extras
define make_venv
	@echo "make: building $(1): torch, $(3) and the extras [$(4)] (minutes: .venv took about 4 on an idle 2-core machine, a CUDA build of torch takes longer; pip is quiet: a line every $(TICK_S) s)"
	test -x $(1)/bin/python || $(2) -m venv $(1)
	@echo "make: $(1): torch ($(TORCH_PIN)), unless it is there"
	@$(1)/bin/python -c "import torch" 2>/dev/null || { $(call ticking,$(1): installing $(TORCH_PIN),$(1)/bin/pip install -q $(TORCH_PIN)); }
	@echo "make: $(1): $(3), this package and its extras [$(4)]"
	@$(call ticking,$(1): installing $(3) and the extras,$(1)/bin/pip install -q "$(3)" -e ".[$(4)]" wheel build)
	touch $(1)/.installed
	@echo "make: $(1) built"
endef

$(STAMP): $(DEPS)
	$(call make_venv,$(VENV),$(PYTHON),$(MCORE_MAIN),$(EXTRAS_MAIN))

$(STAMP_OLD): $(DEPS)
	$(call make_venv,$(VENV_OLD),$(PYTHON),$(MCORE_OLD),$(EXTRAS_LANE))

$(STAMP_NEW): $(DEPS)
	$(call make_venv,$(VENV_NEW),$(PYTHON_NEW),$(MCORE_NEW),$(EXTRAS_LANE))

demo: $(STAMP)
	$(VENV)/bin/megatron-rl-patches demo

# Every lane runs even when an earlier one fails; the target fails if any did. The served lane
# runs before verl's, which asks its vLLM server (built by the served lane) for the served teacher.
test:
	@status=0; \
	$(MAKE) --no-print-directory test-main || status=1; \
	$(MAKE) --no-print-directory test-oldest || status=1; \
	$(MAKE) --no-print-directory test-newest || status=1; \
	$(MAKE) --no-print-directory test-served || status=1; \
	$(MAKE) --no-print-directory test-verl || status=1; \
	exit $$status

# mypy's cache lives outside the clone: a fresh clone on a machine that ran it before re-checks only
# what changed (each entry is validated by its file's hash); with no cache the run takes minutes.
MYPY_CACHE ?= $(HOME)/.cache/megatron-rl-patches/mypy
# The main lane puts the bench's peer (.lanes/bench-peer, a few seconds) where its test finds it; a failed
# install leaves that test skipped, naming the lane, and the lane runs on.
test-main: $(STAMP)
	@$(MAKE) --no-print-directory $(BENCH_PEER_STAMP) || echo "make: $(BENCH_PEER_LANE) could not be installed: the peer's test skips"
	@status=0; $(VENV)/bin/ruff check . || status=1; $(VENV)/bin/mypy --cache-dir "$(MYPY_CACHE)" || status=1; \
	$(THREADS) $(VENV)/bin/python -m pytest $(PARALLEL) $(PYTEST_ARGS) || status=1; exit $$status

# Only what touches megatron-core runs again; the pure math does not depend on its version, nor do
# the tests marked `version_blind` (benchmark harnesses, the demo: the main lane only) or
# `reader_facing` (the docs' pages and examples: the main and newest lanes).
test-oldest: $(STAMP_OLD)
	$(THREADS) $(VENV_OLD)/bin/python -m pytest -m "megatron and not version_blind and not reader_facing" $(PARALLEL) $(PYTEST_ARGS)

# Without Python 3.12 the lane is skipped loudly; under CI=true that is a failing test.
test-newest:
ifeq ($(PYTHON_NEW),)
	@echo "*** SKIPPED LANE newest (megatron-core 0.19.2): no working Python 3.12 found (tools/find-python 3.12) ***"
	@if [ -n "$$CI" ]; then $(MAKE) --no-print-directory $(STAMP) && \
	  MRP_MISSING_LANE=newest MRP_MISSING_LANE_REASON="no working Python 3.12 on this machine" \
	  $(VENV)/bin/python -m pytest -q -p no:cacheprovider tools/lane_unavailable.py; fi
else
	$(MAKE) --no-print-directory $(STAMP_NEW)
	$(THREADS) TRITON_INTERPRET=1 $(VENV_NEW)/bin/python -m pytest -m "(megatron or triton) and not version_blind" $(PARALLEL) $(PYTEST_ARGS)
endif

# verl 0.9.1 on the newest lane's venv, installed --no-deps into .lanes/verl so that venv's torch
# and megatron-core stay as they are (first build ~2 min, then a stamp). Loud skip when the lane
# cannot be built; under CI=true a failing test naming the lane. Where the served lane's vLLM venv
# is built (its stamp), its interpreter is passed on: the vLLM servers of the served-teacher modules
# (tests/integrations/verl/lane/test_verl_served.py, test_verl_served_vocab.py), which skip without
# it; they start together at the lane's first test and load while the modules before theirs run.
VERL_LANE = .lanes/verl
VERL_STAMP = $(VERL_LANE)/.installed
$(VERL_STAMP): tools/verl-lane.txt
	rm -rf $(VERL_LANE)
	@echo "make: building $(VERL_LANE): verl 0.9.1 and tools/verl-lane.txt, --no-deps (about 2 minutes on an idle 2-core machine; pip is quiet: a line every $(TICK_S) s)"
	@$(call ticking,$(VERL_LANE): installing,$(VENV_NEW)/bin/pip install -q --no-deps --target $(VERL_LANE) -r tools/verl-lane.txt)
	touch $(VERL_STAMP)

test-verl:
	@if [ -z "$(PYTHON_NEW)" ] || ! $(MAKE) --no-print-directory $(STAMP_NEW) $(VERL_STAMP); then \
	  echo "*** SKIPPED LANE verl (verl 0.9.1 on megatron-core 0.19.2): the lane could not be built (Python 3.12 and tools/verl-lane.txt from the package index) ***"; \
	  if [ -n "$$CI" ]; then $(MAKE) --no-print-directory $(STAMP) && \
	    MRP_MISSING_LANE=verl MRP_MISSING_LANE_REASON="verl 0.9.1 could not be installed into $(VERL_LANE)" \
	    $(VENV)/bin/python -m pytest -q -p no:cacheprovider tools/lane_unavailable.py; fi; \
	else \
	  served=; if [ -f $(VLLM_STAMP) ]; then served=$(abspath $(VLLM_LANE))/bin/python; fi; \
	  $(PASSIVE) MRP_VLLM_PYTHON=$$served PYTHONPATH=$(abspath $(VERL_LANE)) $(VENV_NEW)/bin/python -m pytest -m verl $(PYTEST_ARGS) tests/integrations/verl/lane tests/docs; \
	fi

# The served lane: vLLM's CPU build (tools/served-lane.txt) in its own venv .lanes/vllm (first build
# about 6-7 min on an idle 2-core machine, 3.4 GB; then a stamp; `make vllm-lane` builds it alone). The torchvision / torchaudio / torchcodec it pulls are removed: their
# extensions do not load against torch 2.13.0+cpu, and text models need none. One real server per
# pytest session (tests/teachers/lane/conftest.py); the tests run in the main venv (httpx, the extra
# `served`). Loud skip when the lane cannot be built or vLLM's CPU build cannot run on this CPU
# (tools/served-lane-check); under CI=true a failing test naming the lane.
VLLM_LANE = .lanes/vllm
VLLM_STAMP = $(VLLM_LANE)/.installed
$(VLLM_STAMP): tools/served-lane.txt
	rm -rf $(VLLM_LANE)
	@echo "make: building $(VLLM_LANE): vLLM 0.32's CPU build and its torch (about 6-7 minutes on an idle 2-core machine, 3.4 GB; pip is quiet: a line every $(TICK_S) s)"
	test -n "$(PYTHON_VLLM)" && $(PYTHON_VLLM) -m venv $(VLLM_LANE)
	@echo "make: $(VLLM_LANE): tools/served-lane.txt (vLLM, torch 2.13.0+cpu and their dependencies)"
	@$(call ticking,$(VLLM_LANE): installing vLLM,$(VLLM_LANE)/bin/pip install -q -r tools/served-lane.txt)
	@echo "make: $(VLLM_LANE): removing torchvision, torchaudio and torchcodec (text models need none)"
	$(VLLM_LANE)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)
	@echo "make: $(VLLM_LANE) built"

# vLLM's environment alone (serve-teacher runs there: .lanes/vllm/bin/python -m megatron_rl_patches serve-teacher ...)
vllm-lane: $(VLLM_STAMP)

# sglang-router 0.3.2 beside vLLM in the lane's venv (tools/router-lane.txt; its dependencies are vLLM's
# own, unpinned): the router tests ask what a real router in front of the engines passes
ROUTER_STAMP = $(VLLM_LANE)/.router-installed
$(ROUTER_STAMP): tools/router-lane.txt $(VLLM_STAMP)
	@echo "make: $(VLLM_LANE): sglang-router 0.3.2 (tools/router-lane.txt; pip is quiet: a line every $(TICK_S) s)"
	@$(call ticking,$(VLLM_LANE): installing sglang-router,$(VLLM_LANE)/bin/pip install -q -r tools/router-lane.txt)
	touch $(ROUTER_STAMP)

test-served: $(STAMP)
	@if ! $(MAKE) --no-print-directory $(VLLM_STAMP) $(ROUTER_STAMP); then \
	  reason="vLLM 0.32.0's CPU build or sglang-router 0.3.2 could not be installed into $(VLLM_LANE) (Python 3.11, tools/served-lane.txt, tools/router-lane.txt)"; \
	elif ! reason=$$(tools/served-lane-check $(VLLM_LANE)/bin/python); then :; \
	else reason=""; fi; \
	if [ -n "$$reason" ]; then \
	  echo "*** SKIPPED LANE served (a real vLLM server): $$reason ***"; \
	  if [ -n "$$CI" ]; then MRP_MISSING_LANE=served MRP_MISSING_LANE_REASON="$$reason" \
	    $(VENV)/bin/python -m pytest -q -p no:cacheprovider tools/lane_unavailable.py; fi; \
	else \
	  $(PASSIVE) MRP_VLLM_PYTHON=$(abspath $(VLLM_LANE))/bin/python $(VENV)/bin/python -m pytest -m served $(PYTEST_ARGS) tests/teachers/lane; \
	fi

# The optional mbridge converter (converter="mbridge"), not part of `make test`: mbridge 0.15.1 and
# einops installed --no-deps into .lanes/mbridge so the main venv stays as it is.
MBRIDGE_LANE = .lanes/mbridge
MBRIDGE_STAMP = $(MBRIDGE_LANE)/.installed
$(MBRIDGE_STAMP): tools/mbridge-lane.txt
	rm -rf $(MBRIDGE_LANE)
	$(VENV)/bin/pip install -q --no-deps --target $(MBRIDGE_LANE) -r tools/mbridge-lane.txt
	touch $(MBRIDGE_STAMP)

test-mbridge: $(STAMP) $(MBRIDGE_STAMP)
	PYTHONPATH=$(CURDIR):$(abspath $(MBRIDGE_LANE)) $(VENV)/bin/python -m pytest -m mbridge $(PYTEST_ARGS) \
	  tests/inference/loading/hf/test_hf_mbridge.py

# slime 624b824a's real train()/forward_only on CPU (not part of `make test`):
#   make test-slime SLIME=/path/to/slime MEGATRON_LM=/path/to/Megatron-LM   (checkouts or bare git dirs)
# Both commits are exported into .lanes/slime (tools/slime-lane checks they exist); without SLIME the
# lane is skipped loudly.
SLIME_LANE = .lanes/slime
test-slime: $(STAMP)
	@if [ -z "$(SLIME)" ]; then \
	  echo "*** SKIPPED LANE slime: make test-slime SLIME=/path/to/slime MEGATRON_LM=/path/to/Megatron-LM ***"; \
	else \
	  PIP=$(VENV)/bin/pip tools/slime-lane "$(SLIME)" "$(MEGATRON_LM)" $(SLIME_LANE) && \
	  PYTHONPATH=$(CURDIR):$(abspath $(SLIME_LANE))/slime:$(abspath $(SLIME_LANE))/megatron-lm:$(abspath $(SLIME_LANE))/deps \
	    $(VENV)/bin/python -W ignore::DeprecationWarning -m pytest -m slime $(PYTEST_ARGS) tests/integrations/slime/lane; \
	fi

# NeMo-RL 7ea279ab's Megatron train.py driver, post-processors, model_utils and losses on CPU (not
# part of `make test`), on Python 3.12 with megatron-core 0.19.2 (.venv-mcore019; NeMo-RL pins Python
# 3.13, torch 2.11 and megatron-core 0.20, which cannot install here):
#   make test-nemo NEMO_RL=/path/to/NeMo-RL   (checkout or bare git dir; MEGATRON_LM is not needed:
#   NeMo-RL's data.py reaches only megatron.training.utils, which the 0.19.2 wheel ships)
# Its service imports (ray, mlflow, wandb, ...) are the kit's inert stand-ins
# (megatron_rl_patches.testing.service_stubs, installed by the lane's conftest). The served-teacher
# tests start a real vLLM server from the served lane's venv (.lanes/vllm, built by `make
# test-served`; MRP_VLLM_PYTHON overrides it) and skip loudly without one.
NEMO_LANE = .lanes
test-nemo: $(STAMP_NEW)
	@if [ -z "$(NEMO_RL)" ]; then \
	  echo "*** SKIPPED LANE nemo-rl: make test-nemo NEMO_RL=/path/to/NeMo-RL ***"; \
	else \
	  PIP=$(VENV_NEW)/bin/pip tools/nemo-rl-lane "$(NEMO_RL)" $(NEMO_LANE) && \
	  echo "nemo-rl lane: Python $$($(VENV_NEW)/bin/python -c 'import platform; print(platform.python_version())'), megatron-core $$($(VENV_NEW)/bin/python -c 'import importlib.metadata as m; print(m.version("megatron-core"))') (NeMo-RL pins Python 3.13 and megatron-core 0.20)" && \
	  PYTHONPATH=$(CURDIR):$(abspath $(NEMO_LANE))/nemo-rl:$(abspath $(NEMO_LANE))/nemo-rl-deps \
	  MRP_VLLM_PYTHON=$${MRP_VLLM_PYTHON:-$(if $(wildcard $(VLLM_STAMP)),$(abspath $(VLLM_LANE))/bin/python)} \
	    $(VENV_NEW)/bin/python -W ignore::DeprecationWarning -m pytest -m nemo_rl $(PYTEST_ARGS) tests/integrations/nemo_rl/lane; \
	fi

# Memory and time of slime's own step, unpatched against slime_fused (docs/benchmarks.md, "slime step"):
#   make bench-slime SLIME=/path/to/slime MEGATRON_LM=/path/to/Megatron-LM [BENCH_SLIME_ARGS="--rounds 5"]
BENCH_SLIME_ARGS ?= --rounds 3
bench-slime: $(STAMP)
	@test -n "$(SLIME)" || { echo "bench-slime: SLIME=/path/to/slime MEGATRON_LM=/path/to/Megatron-LM are needed" >&2; exit 2; }
	PIP=$(VENV)/bin/pip tools/slime-lane "$(SLIME)" "$(MEGATRON_LM)" $(SLIME_LANE)
	tools/slime-bench $(VENV)/bin/python $(SLIME_LANE) --out bench-out $(BENCH_SLIME_ARGS)
	tools/slime-bench $(VENV)/bin/python $(SLIME_LANE) --out bench-out --layout pp2 --layers 2 $(BENCH_SLIME_ARGS)
	tools/slime-bench $(VENV)/bin/python $(SLIME_LANE) --out bench-out --layout cp2 $(BENCH_SLIME_ARGS)
	tools/slime-bench $(VENV)/bin/python $(SLIME_LANE) --out bench-out --layout mtp $(BENCH_SLIME_ARGS)

# Each version's result line, and the name of every failing test. megatron-core is installed
# without its dependencies (the lane venv has torch); Megatron-LM's training package (in the
# wheels from 0.17 on) also needs PyYAML.
LANE_PYTEST = python -m pytest -q -rf -m megatron $(PYTEST_ARGS) | grep -E "^FAILED|^ERROR|(passed|failed|error)"
test-versions: $(STAMP_OLD) $(STAMP_NEW)
	@for v in $(VERSIONS_OLD); do \
	  $(VENV_OLD)/bin/pip install -q --no-deps --target .lanes/mcore-$$v megatron-core==$$v && \
	  PYTHONPATH=.lanes/mcore-$$v $(VENV_OLD)/bin/$(LANE_PYTEST) | sed "s/^/megatron-core $$v: /"; \
	done
	@for v in $(VERSIONS_NEW); do \
	  $(VENV_NEW)/bin/pip install -q --no-deps --target .lanes/mcore-$$v megatron-core==$$v pyyaml && \
	  PYTHONPATH=.lanes/mcore-$$v $(VENV_NEW)/bin/$(LANE_PYTEST) | sed "s/^/megatron-core $$v: /"; \
	done

# The megatron tests against a Megatron-LM source checkout (e.g. main), not in CI:
#   make test-source CHECKOUT=/path/to/Megatron-LM
test-source: $(STAMP_NEW)
	@test -d "$(CHECKOUT)/megatron/core" || { echo "usage: make test-source CHECKOUT=/path/to/Megatron-LM"; exit 2; }
	@$(VENV_NEW)/bin/pip install -q --no-deps --target .lanes/source-deps pyyaml
	@PYTHONPATH=$(abspath $(CHECKOUT)):.lanes/source-deps $(VENV_NEW)/bin/$(LANE_PYTEST) | sed "s|^|$(CHECKOUT): |"

# Mutation testing of one module against its own tests (not part of `make test`; mutmut 3.8.1 and
# what it needs that .venv lacks, tools/mutmut-lane.txt, installed --no-deps into .lanes/mutmut):
#   make mutate MODULE=megatron_rl_patches/ops/topk.py TESTS="tests/ops/topk tests/ops/invariance/test_invariant_rows.py"
# MUTANTS='*topk_kl*' runs a subset (a glob over mutant names), CHILDREN=2 two at once (default 1).
MUTMUT_LANE = .lanes/mutmut
MUTMUT_STAMP = $(MUTMUT_LANE)/.installed
$(MUTMUT_STAMP): tools/mutmut-lane.txt
	rm -rf $(MUTMUT_LANE)
	$(VENV)/bin/pip install -q --no-deps --target $(MUTMUT_LANE) -r tools/mutmut-lane.txt
	touch $(MUTMUT_STAMP)

mutate: $(STAMP) $(MUTMUT_STAMP)
	tools/mutate $(abspath $(VENV))/bin/python $(MUTMUT_LANE) "$(MODULE)" $(TESTS)

# The GPU lane: refuses in one line where the interpreter has no torch or torch sees no CUDA device.
CUDA_CHECK = $(GPU_ENV) $(GPU_PYTHON) -c "import importlib.util, sys; \
	importlib.util.find_spec('torch') or sys.exit('make: this target needs torch with a CUDA device, and $(GPU_PYTHON) \
	has no torch (GPU_PYTHON=... names the interpreter that has it)'); import torch; \
	sys.exit(0 if torch.cuda.is_available() else 'make: this target needs a CUDA device (torch ' + torch.__version__ + \
	' sees none)')"
test-gpu:
	@$(CUDA_CHECK)
	$(GPU_ENV) $(GPU_PYTHON) -m pytest -m "megatron or triton or gpu" $(PYTEST_ARGS)

bench-gpu:
	@$(CUDA_CHECK)
	$(GPU_ENV) $(GPU_PYTHON) -m megatron_rl_patches bench gpu --out bench-gpu-out

# `bench shared-prefix`'s peer (PrefixGrouper beside the package's shared prefix, docs/benchmarks.md):
# prefix-grouper installed --no-deps into .lanes/bench-peer (tools/bench-peer-lane.txt), on the bench's
# path only; the venv stays as it is (without it the peer's row says "not installed").
BENCH_PEER_LANE = .lanes/bench-peer
BENCH_PEER_STAMP = $(BENCH_PEER_LANE)/.installed
$(BENCH_PEER_STAMP): tools/bench-peer-lane.txt
	rm -rf $(BENCH_PEER_LANE)
	$(VENV)/bin/pip install -q --no-deps --target $(BENCH_PEER_LANE) -r tools/bench-peer-lane.txt
	touch $(BENCH_PEER_STAMP)

bench: $(STAMP) $(BENCH_PEER_STAMP)
	PYTHONPATH=$(abspath $(BENCH_PEER_LANE)) $(VENV)/bin/megatron-rl-patches bench --out bench-out

# the shared-prefix tables alone (both shapes), the peer beside them
bench-shared-prefix: $(STAMP) $(BENCH_PEER_STAMP)
	PYTHONPATH=$(abspath $(BENCH_PEER_LANE)) $(VENV)/bin/megatron-rl-patches bench shared-prefix --out bench-out
	PYTHONPATH=$(abspath $(BENCH_PEER_LANE)) $(VENV)/bin/megatron-rl-patches bench shared-prefix --shape multi-turn \
	  --out bench-out

clean:
	rm -rf $(VENV) $(VENV_OLD) $(VENV_NEW) .lanes build dist *.egg-info
