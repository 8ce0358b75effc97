"""`quantbench doctor`: which engines and servers this machine has, one line each.

Read from package metadata and the machine (nvidia-smi, /proc/cpuinfo); nothing is imported but
torch (for CUDA), no server is started and nothing is created (`--vllm` creates vLLM's
environment first, as `make vllm` does)."""

from __future__ import annotations

import importlib.util
import platform
import sys
from importlib import metadata


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _line(name: str, available: bool, version: str | None, detail: str) -> dict:
    return {"name": name, "available": available, "version": version, "detail": detail}


def facts() -> list[dict]:
    import torch

    from quantbench import vllm_engine
    from quantbench.evaluate.serving import transformers_serve_available

    out = [_line("python", True, platform.python_version(), sys.executable)]
    cuda = torch.cuda.is_available()
    out.append(_line("torch", True, torch.__version__, f"CUDA {torch.version.cuda} with {torch.cuda.device_count()} GPU(s)"
                     if cuda else "no CUDA in this build or no GPU: everything runs on the CPU"))
    gpu = vllm_engine.cuda_gpu()
    out.append(_line("NVIDIA GPU", gpu is not None, None, gpu or "none (nvidia-smi -L does not answer)"))
    flags = vllm_engine.cpu_flags()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16") if f in flags]
    out.append(_line("CPU", True, None, f"{_cpu()}; {len(isa) and ', '.join(isa) or 'no AVX2/AVX-512/AMX'}"))
    out.append(_line("transformers", _version("transformers") is not None, _version("transformers"),
                     "loads every format quantbench writes (hf backend, evaluate)"))
    serve = transformers_serve_available()
    out.append(_line("transformers serve", serve, _version("transformers") if serve else None,
                     "bench server (OpenAI API)" if serve else "missing transformers[serving] (fastapi, uvicorn, openai)"))
    engine, note = vllm_engine.find()
    if engine is not None:
        detail = f"{engine.describe()} in {engine.where}; serves here: {serves_here()}"
    else:
        detail = f"{note}; would be {vllm_engine.build().describe()}"
    out.append(_line("vLLM", engine is not None, engine.version if engine else None, detail))
    for name, dist, what in (("llm-compressor", "llmcompressor", "GPTQ, AWQ, FP8, SmoothQuant -> compressed-tensors"),
                             ("compressed-tensors", "compressed-tensors", "the format llm-compressor writes"),
                             ("bitsandbytes", "bitsandbytes", "INT8, NF4, FP4 at load time" + ("" if cuda else " (CPU kernels)")),
                             ("GPTQModel", "gptqmodel", "GPTQ and AWQ formats"),
                             ("MLflow", "mlflow", "tracking")):
        version = _version(dist)
        out.append(_line(name, version is not None, version, what if version else "not installed"))
    lm_eval = _version("lm_eval")
    api = importlib.util.find_spec("tenacity") is not None
    out.append(_line("lm-eval", lm_eval is not None, lm_eval, "tasks through HFLM" + (
        "; API models (evaluate --engine vllm)" if api else "; no API models: tenacity missing (lm-eval[api])")))
    return out


def serves_here() -> str:
    from quantbench import vllm_engine

    if vllm_engine.device() == "cuda":
        return "unquantized, compressed-tensors (W4A16, W8A16, W8A8, FP8), GPTQ, AWQ, bitsandbytes, FP8 KV cache"
    kv = "FP8 KV cache" if {"avx512f", "amx_tile"} & vllm_engine.cpu_flags() else "no FP8 KV cache (needs AVX-512)"
    return ("unquantized, compressed-tensors W4A16 (4-bit integer weights), W8A8 INT8, FP8 (a slow fallback on CPU), "
            f"GPTQ and AWQ 4-bit, {kv}; not bitsandbytes or 8-bit weight-only (GPU kernels)")


def _cpu() -> str:
    import os

    from quantbench.environment import _cpu_model

    return f"{_cpu_model()}, {os.cpu_count()} cores"


def text(lines: list[dict]) -> str:
    rows = []
    for f in lines:
        mark = "yes" if f["available"] else "no"
        rows.append(f"{f['name']:19s} {mark:4s} {f['version'] or '':14s} {f['detail']}")
    return "\n".join(rows)
