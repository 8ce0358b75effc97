"""A checkpoint directory and what quantbench knows about it, shared by every stage: the info file
each quantize run writes into it (`quantbench.json`), which checkpoint a run id or a directory
names, whether this machine can load its format, its size, and the sizes of a loaded model.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from quantbench.errors import UserError

INFO = "quantbench.json"  # written by the quantize pipeline into every checkpoint
WEIGHT_SUFFIXES = (".safetensors", ".bin")
RUN_ID = re.compile(r"[0-9a-f]{32}")
# quantization_config.quant_method -> the package transformers needs to load that format
FORMAT_PACKAGES = {"compressed-tensors": "compressed_tensors", "bitsandbytes": "bitsandbytes", "gptq": "gptqmodel",
                   "awq": "gptqmodel"}


def read_info(path: Path) -> dict:
    """What the quantize pipeline recorded about the checkpoint at `path` ({} for a foreign one)."""
    info = path / INFO
    return json.loads(info.read_text()) if info.is_file() else {}


def write_info(dest: Path, info: dict) -> None:
    (dest / INFO).write_text(json.dumps(info, indent=2))


@dataclass
class Target:
    """The checkpoint a later stage (evaluate, bench) works on, and the run it logs into."""

    checkpoint: Path
    run_id: str | None  # None: a checkpoint this tracking store has no run for
    base_source: str
    info: dict = field(default_factory=dict)


def resolve_target(target: str, tracker, base: str | None) -> Target:
    """`target` is a checkpoint directory or an MLflow run id; `base` overrides the base model.
    The checkpoint's config and weight files are checked (models.load_config, check_weights)."""
    target_ = _resolve(target, tracker, base)
    from quantbench.models import check_weights, load_config

    load_config(target_.checkpoint, target)
    check_weights(target_.checkpoint, target)
    return target_


def _resolve(target: str, tracker, base: str | None) -> Target:
    from quantbench.tracking import TAG, tracking_uri

    path = Path(target)
    if path.exists():
        if not (path.is_dir() and (path / "config.json").is_file()):
            raise UserError(f"'{target}' is not a model directory (no config.json)")
        info = read_info(path)
        run_id = info.get("run_id")
        if run_id and tracker.existing(run_id) is None:
            run_id = None  # made against another tracking store: later stages log into a new run
        source = base or info.get("base_model", {}).get("source")
        if not source:
            raise UserError(f"'{target}' was not written by quantbench: name its base model with --base SOURCE")
        return Target(path, run_id, source, info)
    if not RUN_ID.fullmatch(target):
        raise UserError(f"'{target}' is neither a checkpoint directory nor an MLflow run id")
    run = tracker.existing(target)
    if run is None:
        raise UserError(f"MLflow run '{target}' does not exist at the tracking store ({tracking_uri()})")
    tags = run.data.tags
    checkpoint = tags.get(TAG + "checkpoint")
    if not checkpoint or not (Path(checkpoint) / "config.json").is_file():
        raise UserError(f"MLflow run '{target}' has no checkpoint on this machine (tag {TAG}checkpoint: {checkpoint or 'none'})")
    return Target(Path(checkpoint), target, base or tags[TAG + "base_model"], read_info(Path(checkpoint)))


def quant_method(checkpoint: Path) -> str | None:
    """`quantization_config.quant_method` of a checkpoint (None: not quantized)."""
    config = json.loads((checkpoint / "config.json").read_text())
    return (config.get("quantization_config") or {}).get("quant_method")


def check_loadable(checkpoint: Path) -> None:
    """A checkpoint whose format needs a package that is missing: say which."""
    method = quant_method(checkpoint)
    package = FORMAT_PACKAGES.get(method)
    if package and importlib.util.find_spec(package) is None:
        raise UserError(f"'{checkpoint}' is a {method} checkpoint; loading it needs the package '{package}', which is not installed")


def weights_sha(path: Path) -> str | None:
    """sha256 over every tensor in a checkpoint's safetensors files: each tensor's name, dtype, shape
    and bytes, in name order. Sharding and file metadata do not change it; one changed weight does.
    None when the checkpoint holds no safetensors file."""
    import hashlib

    import torch
    from safetensors import safe_open

    per_tensor: dict[str, str] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name).contiguous()
                digest = hashlib.sha256(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
                digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
                per_tensor[name] = digest.hexdigest()
    if not per_tensor:
        return None
    return hashlib.sha256("".join(f"{k}={v}\n" for k, v in sorted(per_tensor.items())).encode()).hexdigest()


def weights_size_mb(path: Path) -> float:
    """Bytes of the weight files in a checkpoint directory, in MiB."""
    return sum(p.stat().st_size for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)) / 2**20


def param_bytes(model) -> int:
    """Bytes of a loaded model's unique tensors in their dtype (tied weights counted once)."""
    seen = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def vocab_mismatch(a_tokenizer, b_tokenizer, a_config, b_config) -> str:
    """"" when two models share a vocabulary (config size and every token id), else what differs
    (a distillation student and its teacher, a speculative draft and its target)."""
    if a_config.vocab_size != b_config.vocab_size:
        return f"vocab_size {b_config.vocab_size} vs {a_config.vocab_size}"
    a, b = a_tokenizer.get_vocab(), b_tokenizer.get_vocab()
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()))
        return f"{len(differ)} token ids differ, e.g. {differ[:3]}"
    return ""
