"""`quantbench doctor`: which engines and servers this machine has, one line each (the serving
engines' lines come from their registry, quantbench.engines).

Read from package metadata and the machine (nvidia-smi, /proc/cpuinfo); nothing is imported but
torch (for CUDA), no server is started and nothing is created (`--vllm` creates vLLM's
environment first, as `make vllm` does; `--llamacpp` builds llama.cpp's tools, as `make llamacpp`)."""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from importlib import metadata

from quantbench import engines
from quantbench.cli.common import common, print_json
from quantbench.core import hardware
from quantbench.core.environment import _cpu_model
from quantbench.engines import formats, vllm_env


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _line(name: str, available: bool, version: str | None, detail: str) -> dict:
    return {"name": name, "available": available, "version": version, "detail": detail}


def facts() -> list[dict]:
    import torch

    out = [_line("python", True, platform.python_version(), sys.executable)]
    cuda = torch.cuda.is_available()
    out.append(
        _line(
            "torch",
            True,
            torch.__version__,
            f"CUDA {torch.version.cuda} with {torch.cuda.device_count()} GPU(s)"
            if cuda
            else "no CUDA in this build or no GPU: everything runs on the CPU",
        )
    )
    gpu = hardware.cuda_gpu()
    out.append(_line("NVIDIA GPU", gpu is not None, None, gpu or "none (nvidia-smi -L does not answer)"))
    out.append(_line("CPU", True, None, f"{_cpu()}; {hardware.cpu().describe()}"))
    out.append(_line("compute dtype", True, None, compute_line(cuda)))
    out.append(
        _line(
            "transformers",
            _version("transformers") is not None,
            _version("transformers"),
            "loads every format quantbench writes (engine hf, evaluate)",
        )
    )
    for engine in engines.every():  # the serving engines, from their registry
        if engine.kind == "server":
            available, version, detail = engine.status()
            out.append(_line(engine.label, available, version, detail))
    out.append(_formats_line())
    for name, dist, what in (
        ("llm-compressor", "llmcompressor", "GPTQ, AWQ, FP8, SmoothQuant -> compressed-tensors"),
        ("compressed-tensors", "compressed-tensors", "the format llm-compressor writes"),
        ("bitsandbytes", "bitsandbytes", "INT8, NF4, FP4 at load time" + ("" if cuda else " (CPU kernels)")),
        ("GPTQModel", "gptqmodel", "GPTQ and AWQ formats"),
        ("MLflow", "mlflow", "tracking"),
    ):
        version = _version(dist)
        out.append(_line(name, version is not None, version, what if version else "not installed"))
    lm_eval = _version("lm_eval")
    api = importlib.util.find_spec("tenacity") is not None
    out.append(
        _line(
            "lm-eval",
            lm_eval is not None,
            lm_eval,
            "tasks through HFLM"
            + ("; API models (evaluate --engine vllm)" if api else "; no API models: tenacity missing (lm-eval[api])"),
        )
    )
    return out


def _formats_line() -> dict:
    """The floating-point formats: which vLLM serves here as stored; every one is scored here."""
    on = hardware.device()
    here = formats.vllm_here(on, hardware.cpu(), hardware.cuda_capability(), vllm_env.VERSION)
    served = [f for f, why in here.items() if why is None]
    where = "this GPU" if on == "cuda" else f"this CPU ({hardware.cpu().klass})"
    detail = (
        f"vLLM {vllm_env.VERSION} serves {', '.join(served) if served else 'none of them'} on {where}; "
        "transformers scores NVFP4, MXFP4, MXFP8 and FP8_BLOCK checkpoints anywhere (docs/engines.md)"
    )
    return _line("float formats", bool(served), None, detail)


def compute_line(cuda: bool) -> str:
    """What `model.compute_dtype: auto` picks here, and why."""
    saved_bf16 = hardware.compute_dtype("auto", "bfloat16", on_cuda=cuda)
    if cuda:
        return f"auto: a bfloat16 recipe computes in {saved_bf16} on the GPU"
    cpu = hardware.cpu()
    why = (
        "native on this CPU"
        if cpu.native("bfloat16")
        else f"bfloat16 is emulated on {cpu.klass} (no AMX or AVX512-BF16)"
    )
    return f"auto: a bfloat16 recipe computes in {saved_bf16} ({why}); checkpoints are saved in the recipe's dtype"


def _cpu() -> str:
    return f"{_cpu_model()}, {os.cpu_count()} cores"


def text(lines: list[dict]) -> str:
    rows = []
    for f in lines:
        mark = "yes" if f["available"] else "no"
        rows.append(f"{f['name']:19s} {mark:4s} {f['version'] or '':14s} {f['detail']}")
    return "\n".join(rows)


def add_parser(sub) -> None:
    d = sub.add_parser(
        "doctor",
        parents=[common("json")],
        help="which engines and servers this machine has",
        description="One line per engine and server: transformers (and transformers serve), vLLM (its "
        "version and environment), llm-compressor, bitsandbytes, GPTQModel, lm-eval, torch and CUDA, the "
        "CPU's vector extensions, and which checkpoint formats vLLM serves here. Starts nothing.",
    )
    d.add_argument(
        "--vllm", action="store_true", help="create vLLM's environment first if it does not exist (`make vllm`)"
    )
    d.add_argument(
        "--llamacpp",
        action="store_true",
        help="build llama.cpp's tools for this CPU first if they are not built (`make llamacpp`; ~12 min on 2 cores)",
    )


def run(args) -> int:
    for name in ("vllm", "llamacpp"):
        if getattr(args, name):
            engines.get(name).ensure(f"make {name}")
    found = facts()
    print(text(found))
    return print_json(args, {"engines": found})
