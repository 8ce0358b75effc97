"""What a number was measured on: git sha, library versions, hardware."""

from __future__ import annotations

import os
import platform
import subprocess
from functools import cache
from importlib import metadata

import psutil

LIBRARIES = (
    "torch",
    "transformers",
    "llmcompressor",
    "compressed-tensors",
    "lm_eval",
    "numpy",
    "bitsandbytes",
    "gptqmodel",
    "mlflow",
    "pydantic",
    "quantbench",
)


@cache
def describe() -> dict[str, str]:
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": str(os.cpu_count()),
        "torch_threads": str(_torch_threads()),  # CPU reductions split by thread count: it can change results
        "memory_gb": f"{_memory_bytes() / 2**30:.1f}",
        "gpu": _gpu(),
        "git_sha": _git("rev-parse", "HEAD") or "unknown",
        "git_dirty": "true" if _git("status", "--porcelain", "--untracked-files=no") else "false",
    }
    for name in LIBRARIES:
        try:
            info[f"version.{name}"] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _memory_bytes() -> int:
    return psutil.virtual_memory().total


def _gpu() -> str:
    import torch

    if not torch.cuda.is_available():
        return "none"
    props = torch.cuda.get_device_properties(0)
    return f"{props.name} ({props.total_memory / 2**30:.0f} GiB) x{torch.cuda.device_count()}"


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()
