"""The floating-point formats (NVFP4, MXFP4, MXFP8, FP8 block, W4AFP8) as the engines meet them:
which one a compressed-tensors config group stores, what vLLM needs to run each as stored (a CUDA
compute capability, or AMX on a CPU: docs/engines.md cites vLLM 0.32.0's source for each), and why
a transformers-based engine's speed is not theirs (it de-compresses them as they load); and FP8
weights per channel on a CPU, which vLLM computes with torch's FP8 matmul, timed here once."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from quantbench.core import hardware
from quantbench.core.files import atomic_write
from quantbench.core.paths import cache_dir
from quantbench.core.upcast import best_time
from quantbench.engines import model_config

# The floating-point formats as vLLM 0.32.0 runs them (compressed-tensors' scheme classes and their
# kernels; docs/engines.md cites the lines): format -> (the least CUDA compute capability that runs
# it as stored, what that means, what vLLM-CPU does with it). NVFP4 / MXFP4 / MXFP8 have no CPU kernel
# in vLLM-CPU's lists; FP8_BLOCK's CPU kernels need AMX tiles; W4AFP8 has one kernel, CUTLASS on 9.0.
FLOAT_FORMATS = {
    "NVFP4A16": ((7, 5), "Marlin's FP4 weight-only kernel", "no NVFP4 kernel ('Marlin FP4 not available')"),
    "NVFP4": (
        (10, 0),
        "FP4 matmuls (Blackwell); below, Marlin runs it with 16-bit activations, not as W4A4",
        "no NVFP4 kernel ('Failed to find a kernel that can implement the NVFP4 linear layer')",
    ),
    "MXFP4A16": ((8, 0), "Marlin's MXFP4 weight-only kernel", "no MXFP4 kernel ('Failed to find a kernel ... MXFP4')"),
    "MXFP4": (
        (10, 0),
        "FP4 matmuls (Blackwell); below, Marlin drops the activations' quantization",
        "no MXFP4 kernel ('Failed to find a kernel ... MXFP4')",
    ),
    "MXFP8A16": ((7, 5), "Marlin's FP8 weight-only kernel", "no MXFP8 kernel ('Failed to find a kernel ... MXFP8')"),
    "MXFP8": (
        (10, 0),
        "MXFP8 matmuls (Blackwell); below, Marlin runs it weight-only",
        "no MXFP8 kernel ('Failed to find a kernel ... MXFP8')",
    ),
    "FP8_BLOCK": ((8, 9), "FP8 matmuls (Ada, Hopper); 7.5-8.6 run it weight-only through Marlin", ""),
    "W4AFP8": ((9, 0), "CUTLASS W4A8, on Hopper (9.0) only", "no W4AFP8 scheme off a Hopper GPU"),
}


def vllm_unserved(
    quant: dict, on: str, cpu: hardware.CPU, capability: tuple[int, int] | None, version: str
) -> str | None:
    """Why vLLM (`version`) does not serve a compressed-tensors checkpoint's floating-point format on
    this device ("cpu" or "cuda"; `capability` the GPU's, None: unknown), or None."""
    for name, group in (quant.get("config_groups") or {}).items():
        fmt = float_format(group)
        if fmt is None:
            if on == "cpu" and fp8_weights(group) and cpu == hardware.cpu() and (slow := fp8_matmul_slowdown()):
                return (
                    f"vLLM-CPU {version} computes FP8 weights with torch's _scaled_mm, a fallback on this CPU "
                    f"({cpu.klass}): {slow} (config group {name}); a speed measured through it would be the "
                    "fallback's; not measurable here"
                )
            continue
        least, how, on_cpu = FLOAT_FORMATS[fmt]
        need = f"{fmt} needs a CUDA GPU of compute capability >= {least[0]}.{least[1]} ({how})"
        if on == "cpu":
            if fmt != "FP8_BLOCK":
                return f"{need}; vLLM-CPU {version} has {on_cpu} (config group {name}); not measurable here"
            block = (group.get("weights") or {}).get("block_structure") or [0, 0]
            if "amx_tile" not in cpu.flags:
                return (
                    f"{need}; vLLM-CPU {version}'s FP8 block kernels need AMX tiles (Sapphire Rapids or newer), "
                    f"which this CPU ({cpu.klass}) lacks; not measurable here"
                )
            if block[1] != 128:
                return f"vLLM-CPU {version}'s FP8 block kernels take 128-wide blocks; this checkpoint's are {block[1]}"
            continue
        if capability is None:
            continue  # a GPU whose capability the driver did not say: vLLM decides
        if fmt == "W4AFP8" and capability != least:
            return f"{need}; this GPU is {capability[0]}.{capability[1]}"
        group_size = (group.get("weights") or {}).get("group_size")
        if fmt == "W4AFP8" and group_size != 128:
            return (
                f"vLLM {version}'s W4A8 kernels take INT4 weights in groups of 128; this checkpoint's are {group_size}"
            )
        # FP8 blocks run weight-only from 7.5 (still FP8 weights as stored); the others need `least`
        if capability < ((7, 5) if fmt == "FP8_BLOCK" else least):
            return f"{need}; this GPU is {capability[0]}.{capability[1]}: not measurable here as stored"
    return None


def fp8_weights(group: dict) -> bool:
    """Whether a compressed-tensors config group stores FP8 weights per channel or per tensor (what
    `fp8-dynamic` writes; not FP8 blocks, not MXFP8)."""
    weights = group.get("weights") or {}
    return (
        weights.get("type") == "float"
        and weights.get("num_bits") == 8
        and weights.get("strategy") != "block"
        and "uint8" not in str(weights.get("scale_dtype") or "")
    )


# torch's FP8 matmul this many times a bfloat16 matmul's time or more: a fallback, not a kernel
# (torch 2.13 on an AVX512-BF16 CPU without AMX: 42x at one token through a 4,096 x 14,336 layer, and
# vLLM-CPU decoded the 8B-shaped rung's FP8 checkpoint at about a token a minute, one core)
FP8_FALLBACK = 4.0


def fp8_matmul_slowdown() -> str | None:
    """Why torch's FP8 matmul (`_scaled_mm`, what vLLM-CPU computes FP8 weights with) is a fallback
    on this CPU, or None where it is not: its time against a bfloat16 matmul's, one token through a
    2,048 x 8,192 layer on one thread, measured once per CPU and torch version (cached). Measured with
    this environment's torch, which vLLM's pins to the same version."""
    import torch

    cpu = hardware.cpu()
    key = f"torch {torch.__version__} on {cpu.klass} ({hash_flags(cpu)})"
    path = cache_dir() / "probes" / "fp8-matmul.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    if key not in known:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            weight = torch.randn(8192, 2048) * 0.02
            x = torch.randn(1, 2048)
            x16, w16 = x.bfloat16(), weight.bfloat16().t()
            x8, w8 = x.to(torch.float8_e4m3fn), weight.to(torch.float8_e4m3fn).t()
            bf16 = best_time(lambda: torch.matmul(x16, w16), 3)
            known[key] = round(best_time(lambda: _scaled_mm(x8, w8), 3) / bf16, 1)
        except (RuntimeError, NotImplementedError, AttributeError) as exc:
            known[key] = f"torch has no FP8 matmul here ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        finally:
            torch.set_num_threads(threads)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(known, indent=1))
    found = known[key]
    if isinstance(found, str):
        return found
    if found < FP8_FALLBACK:
        return None
    return (
        f"torch's FP8 matmul takes {found:g}x a bfloat16 matmul's time here (one token through a 2,048 x 8,192 layer)"
    )


def hash_flags(cpu: hardware.CPU) -> str:
    return hashlib.sha256(" ".join(sorted(cpu.flags)).encode()).hexdigest()[:12]


def _scaled_mm(a, b):
    import torch

    ones = torch.ones(1, 1)
    return torch._scaled_mm(a, b, scale_a=ones, scale_b=ones, out_dtype=torch.bfloat16)


def float_format(group: dict) -> str | None:
    """The floating-point format (a FLOAT_FORMATS key) of a compressed-tensors config group, or None."""
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    kind, bits, scale = weights.get("type"), weights.get("num_bits", 8), str(weights.get("scale_dtype") or "")
    if kind == "int" and bits == 4 and acts and acts.get("type") == "float":
        return "W4AFP8"
    if kind != "float":
        return None
    if weights.get("strategy") == "block":
        return "FP8_BLOCK"
    name = {("float8_e4m3fn", 4): "NVFP4", ("uint8", 4): "MXFP4", ("uint8", 8): "MXFP8"}.get(
        (scale.split(".")[-1], bits)
    )
    return None if name is None else name + ("" if acts else "A16")


def stored_float_format(checkpoint: Path | dict) -> str | None:
    """The floating-point format a compressed-tensors checkpoint stores (its first config group in
    one), or None."""
    return next((f for g in _groups(checkpoint) if (f := float_format(g))), None)


def _groups(checkpoint: Path | dict) -> list[dict]:
    """A compressed-tensors checkpoint's config groups ([] for any other checkpoint)."""
    quant = model_config(checkpoint).get("quantization_config") or {}
    if str(quant.get("quant_method") or "").lower() != "compressed-tensors":
        return []
    return list((quant.get("config_groups") or {}).values())


def decompressed(checkpoint: Path | dict) -> str | None:
    """Why a transformers-based engine's speed is not a floating-point checkpoint's: it de-compresses
    NVFP4, MXFP4 and MXFP8 weights into 16-bit ones as they load, and on a CPU FP8 ones too (its
    "Decompressing model"), None: not such a checkpoint."""
    fmt = stored_float_format(checkpoint)
    if fmt is None and hardware.device() != "cuda" and any(fp8_weights(g) for g in _groups(checkpoint)):
        fmt = "FP8"
    if fmt is None or fmt in ("FP8_BLOCK", "W4AFP8"):
        return None
    return (
        f"transformers de-compresses {fmt} weights into 16-bit ones as they load, so a speed measured "
        f"through it is not {fmt}'s; not measurable here"
    )


def _group(kind: str, bits: int, scale: str | None = None, acts: bool = False, **more) -> dict:
    weights = {"type": kind, "num_bits": bits, "scale_dtype": scale, **more}
    return {"weights": weights, "input_activations": {"type": "float", "num_bits": bits if kind == "float" else 8}
            if acts else None}  # fmt: skip


# A config group of each format, as much of it as the engines read (doctor asks about each)
SKETCHES = {
    "NVFP4A16": _group("float", 4, "torch.float8_e4m3fn"),
    "NVFP4": _group("float", 4, "torch.float8_e4m3fn", acts=True),
    "MXFP4A16": _group("float", 4, "torch.uint8"),
    "MXFP4": _group("float", 4, "torch.uint8", acts=True),
    "MXFP8A16": _group("float", 8, "torch.uint8"),
    "MXFP8": _group("float", 8, "torch.uint8", acts=True),
    "FP8_BLOCK": _group("float", 8, strategy="block", block_structure=[128, 128], acts=True),
    "W4AFP8": _group("int", 4, acts=True, group_size=128),
}


def vllm_here(on: str, cpu: hardware.CPU, capability: tuple[int, int] | None, version: str) -> dict[str, str | None]:
    """format -> why vLLM does not serve it on this device (None: it does), for `doctor`."""
    return {
        fmt: vllm_unserved({"config_groups": {"group_0": group}}, on, cpu, capability, version)
        for fmt, group in SKETCHES.items()
    }
