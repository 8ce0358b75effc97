"""What this machine computes natively: the CPU's class (the ISA features that matter here), whether
bfloat16 is native, and so the dtype work is computed in.

Machines of one size differ in CPU: some have AMX (native bfloat16 matrix units), some AVX-512
with AVX512-BF16, many only AVX2, where a bfloat16 matmul is emulated (measured ~7x slower than
float32 on an AVX2-only EPYC). The dtype a checkpoint is *saved* in is the recipe's (what a GPU
serves); the dtype a job *computes* in is chosen here (`model.compute_dtype: auto`). Nothing here
imports torch at module load: `doctor` and `--help` stay light.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

DTYPES = ("bfloat16", "float16", "float32")

# The features that decide speed and which engine kernels run, in the order doctor prints them
FEATURES = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
)


@dataclass(frozen=True)
class CPU:
    """A CPU by its /proc/cpuinfo flags (or any set of flags: tests ask about other classes)."""

    flags: frozenset[str]
    capped: str = ""  # the ONEDNN_MAX_CPU_ISA that held the flags below the CPU's own, if any

    @property
    def klass(self) -> str:
        """AMX | AVX512-BF16 | AVX-512 | AVX2 | baseline: the name said beside every figure."""
        if "amx_bf16" in self.flags:
            return "AMX"
        if "avx512_bf16" in self.flags:
            return "AVX512-BF16"
        if "avx512f" in self.flags:
            return "AVX-512"
        if "avx2" in self.flags:
            return "AVX2"
        return "baseline"

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    def native(self, dtype: str) -> bool:
        """Whether matmuls in `dtype` run on native instructions (else they are emulated, slowly)."""
        if dtype == "float32":
            return True
        if dtype == "bfloat16":
            return bool({"amx_bf16", "avx512_bf16"} & self.flags)
        if dtype == "float16":
            return bool({"amx_fp16", "avx512_fp16"} & self.flags)
        raise ValueError(f"unknown dtype {dtype!r}")

    def features(self) -> list[str]:
        return [f for f in FEATURES if f in self.flags]

    def describe(self) -> str:
        """e.g. 'AVX2 (avx2, fma, f16c): bfloat16 emulated' -- one line for doctor and the docs."""
        bf16 = "native bfloat16" if self.native("bfloat16") else "bfloat16 emulated (slow): work computes in float32"
        cap = f", capped by ONEDNN_MAX_CPU_ISA={self.capped}" if self.capped else ""
        return f"{self.klass} ({', '.join(self.features()) or 'none of ' + ', '.join(FEATURES[:4])}{cap}): {bf16}"


# oneDNN (torch's CPU matmuls) can be held below what the CPU has: ONEDNN_MAX_CPU_ISA=AVX2 on an
# AVX512-BF16 machine emulates bfloat16 as an AVX2-only CPU does (measured 4.3x slower than float32
# there). The features each cap leaves out, so that "native" means what torch will run.
_ABOVE_AVX2 = {"avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16"}
ISA_CAPS = {
    "SSE41": _ABOVE_AVX2 | {"avx", "avx2", "fma", "f16c"},
    "AVX": _ABOVE_AVX2 | {"avx2", "fma"},
    "AVX2": _ABOVE_AVX2,
    "AVX2_VNNI": _ABOVE_AVX2,
    "AVX2_VNNI_2": _ABOVE_AVX2,
    "AVX512_CORE": _ABOVE_AVX2 - {"avx512f"},
    "AVX512_CORE_VNNI": _ABOVE_AVX2 - {"avx512f", "avx512_vnni"},
    "AVX512_CORE_BF16": {"avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16"},
    "AVX512_CORE_FP16": {"amx_tile", "amx_bf16", "amx_fp16"},
    "AVX10_1_512": {"amx_tile", "amx_bf16", "amx_fp16"},
    "AVX512_CORE_AMX": {"amx_fp16"},
    "AVX10_1_512_AMX": {"amx_fp16"},
}


@cache
def cpu() -> CPU:
    """This machine's CPU, as far as ONEDNN_MAX_CPU_ISA lets torch use it."""
    flags: frozenset[str] = frozenset()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = frozenset(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return CPU(flags - ISA_CAPS.get(cap, set()), cap if cap in ISA_CAPS else "")


@cache
def cuda_gpu() -> str | None:
    """The first NVIDIA GPU the driver reports (`nvidia-smi -L`), or None; imports nothing."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [x for x in out.stdout.splitlines() if x.startswith("GPU ")]
    return lines[0] if out.returncode == 0 and lines else None


def _gpu_query(field: str) -> str:
    """The first NVIDIA GPU's `field` as the driver reports it (`nvidia-smi --query-gpu`), or "" where
    there is none; imports nothing."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return (out.stdout.split() or [""])[0] if out.returncode == 0 else ""


@cache
def cuda_capability() -> tuple[int, int] | None:
    """The first NVIDIA GPU's compute capability, (9, 0) for a Hopper, or None where there is none."""
    major, _, minor = _gpu_query("compute_cap").partition(".")
    return (int(major), int(minor or 0)) if major.isdigit() else None


@cache
def cuda_memory() -> int | None:
    """The first NVIDIA GPU's memory in bytes, or None where there is none."""
    mib = _gpu_query("memory.total")
    return int(mib) * 2**20 if mib.isdigit() else None


def device() -> str:
    """ "cuda" where an NVIDIA driver answers (what a serving engine would run on), else "cpu"."""
    return "cuda" if cuda_gpu() else "cpu"


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def native(dtype: str, *, on_cuda: bool | None = None, on: CPU | None = None) -> bool:
    """Whether this device (the GPU where torch has one, else the CPU) computes `dtype` natively."""
    on_cuda = cuda() if on_cuda is None else on_cuda
    if on_cuda:
        import torch

        return dtype != "bfloat16" or torch.cuda.is_bf16_supported()
    return (on or cpu()).native(dtype)


def compute_dtype(requested: str, saved: str, *, on_cuda: bool | None = None, on: CPU | None = None) -> str:
    """The dtype a job computes in. `auto`: the saved dtype where the device runs it natively (a job
    never computes in less precision than it saves), float32 otherwise. An explicit dtype is kept."""
    if requested != "auto":
        return requested
    return saved if native(saved, on_cuda=on_cuda, on=on) else "float32"


# Formats whose kernels compute in a dtype of their own choosing (GPTQModel's AWQ kernels refuse
# float32, bitsandbytes has its compute_dtype): loaded in the dtype they were saved in
OWN_DTYPE_FORMATS = ("gptq", "awq", "bitsandbytes")


def saved_dtype(config: dict) -> str | None:
    """The dtype a checkpoint's config.json says its weights are in (`dtype`, or transformers 4's
    `torch_dtype`), or None when it names none of DTYPES."""
    text = config.get("text_config") or config
    saved = str(text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or "").removeprefix("torch.")
    return saved if saved in DTYPES else None


def compute_dtype_of(checkpoint: Path, requested: str = "auto") -> str:
    """The dtype to compute a saved checkpoint directory in on this device: `requested`, or for
    `auto` its config's dtype where native and float32 otherwise (compressed-tensors weights are
    de-quantized into it); formats with kernels of their own keep their saved dtype."""
    config = json.loads((checkpoint / "config.json").read_text())
    method = str((config.get("quantization_config") or {}).get("quant_method") or "").lower()
    saved = saved_dtype(config) or "float32"
    if method in OWN_DTYPE_FORMATS:
        return saved
    return compute_dtype(requested, saved)


def device_class() -> str:
    """What a speed figure holds for, in a few words: the GPU, or the CPU's class and core count
    ("CPU AVX512-BF16, 2 cores"): the class decides which kernels run natively."""
    gpu = cuda_gpu()
    if gpu:
        return "GPU " + gpu.split(" (UUID")[0].split(": ", 1)[-1]
    return f"CPU {cpu().klass}, {len(os.sched_getaffinity(0))} cores"


def device_line() -> str:
    """The device a job computes on, for its log: the GPU, or the CPU's class and what it computes natively."""
    if cuda():
        import torch

        return f"CUDA GPU {torch.cuda.get_device_name(0)}"
    return f"CPU {cpu().describe()}"
