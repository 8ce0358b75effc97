"""Model-free quantization (`quantize.model_free: true`): a data-free scheme applied to the base's
safetensors files one decoder layer at a time, with no model built and no model loaded.

The arithmetic is llm-compressor's own (`ModelFreePtqConverter`, what its `model_free_ptq` runs on
each file): each weight is rounded by the same observers as the loaded-model path, NVFP4 / MXFP4
global scales shared by q/k/v and by gate/up as there, and compressed by compressed-tensors. What
differs is how much is read at once: `model_free_ptq` loads a whole input file per job (a typical 8B
checkpoint's files are ~5 GB; one saved with transformers 5's default holds all 15 GB), where this
reads one decoder layer's tensors (from whichever files hold them), keeps no view of a file's mapping
past its layer (its touched pages would stay resident), and writes shards of at most SHARD_BYTES
tensor by tensor. Resident at its peak: one layer in the saved dtype, its rounding's temporaries,
and the output shard being filled.

Which tensors are quantized is decided as the loaded path decides: the Linear layers of the model's
skeleton (built on the meta device from its config) that the recipe's targets and ignore list
select; every other tensor (embeddings, norms, the head) is copied in the saved dtype.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch
from compressed_tensors.quantization import QuantizationConfig
from safetensors import safe_open
from tqdm import tqdm

from quantbench.core import logs
from quantbench.core.errors import UserError
from quantbench.quantize import Inputs, Produced, ProduceFootprint, recipe_layers
from quantbench.recipe.schemes import MICROSCALE

log = logging.getLogger(__name__)

SHARD_BYTES = 1 << 29  # an output shard is written once it holds this much (512 MiB)
# resident while a group of tensors is rounded, in copies of the group as read: fitted to the 8B rung's
# measured peaks (bench/model_free.py; docs/results.md): FP8 2.5, NVFP4A16 6 (a microscale format rounds
# a fused set's modules together, each with its observer's float32 temporaries)
ROUNDING_COPIES = {"microscale": 6.0, "other": 2.5}
INDEX = "model.safetensors.index.json"
# a decoder layer's tensors, whatever the architecture calls its stack ("model.layers.3.", "model.language_model.layers.3.")
LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")
# copied beside the weights (the tokenizer is saved by the job, as the loaded path saves it)
COPIED = ("config.json", "generation_config.json")


@dataclass(frozen=True)
class Written:
    """What the files hold once written."""

    shards: int
    tensors: int
    quantized: int  # weight matrices rounded
    bytes: int
    largest_group_bytes: int  # the most read at once (a decoder layer, or the embeddings), in the saved dtype


def weight_map(source: Path) -> dict[str, str]:
    """tensor name -> file name (relative to `source`) of a safetensors checkpoint, sharded or not."""
    index = source / INDEX
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = source / "model.safetensors"
    if not single.is_file():
        raise UserError(
            [
                f"model.source ({source}): model_free reads safetensors weights; found neither {INDEX} nor model.safetensors"
            ]
        )
    with safe_open(single, framework="pt") as f:
        return {name: single.name for name in f.keys()}


def layer_groups(names: dict[str, str]) -> list[dict[str, list[str]]]:
    """The tensors read together: each decoder layer's (so that fused partners, q/k/v and gate/up,
    are rounded with their shared global scale, wherever the files put them), every other tensor on
    its own; as {file: [tensor names]}, in the order of the first file that holds each."""
    groups: dict[str, dict[str, list[str]]] = {}
    for name, file in names.items():
        found = LAYER.match(name)
        key = found.group(1) if found else name
        groups.setdefault(key, {}).setdefault(file, []).append(name)
    return list(groups.values())


def elements(source: Path, names: dict[str, str]) -> dict[str, int]:
    """Each tensor's number of elements, from the files' headers (nothing read but them)."""
    counts = {}
    by_file: dict[str, list[str]] = {}
    for name, file in names.items():
        by_file.setdefault(file, []).append(name)
    for file, members in by_file.items():
        with safe_open(source / file, framework="pt") as f:
            for name in members:
                numel = 1
                for n in f.get_slice(name).get_shape():
                    numel *= n
                counts[name] = numel
    return counts


def matching_config(config: QuantizationConfig, names: dict[str, str], quantized: set[str]) -> QuantizationConfig:
    """The config the converter matches tensors with: the recipe's groups and ignore list, and every
    2-D weight that is not one of the Linear layers the loaded path would quantize (`quantized`, module
    names) ignored by name (the converter matches names only: an embedding is a 2-D `.weight` too)."""
    others = sorted({n.rpartition(".")[0] for n in names if n.endswith(".weight")} - quantized)
    return config.model_copy(update={"ignore": [*(config.ignore or []), *others]}, deep=True)


def quantize_files(
    source: Path,
    dest: Path,
    config: QuantizationConfig,
    quantized: set[str],
    dtype: torch.dtype,
    shard_bytes: int = SHARD_BYTES,
    advance: Callable[[int], None] | None = None,
) -> Written:
    """Round `source`'s weights into `dest` (which exists), one decoder layer at a time.

    `config`: the quantization config written into the checkpoint (the recipe's groups and ignore);
    `quantized`: the module names the loaded path would quantize; `dtype`: what the checkpoint is
    saved in (each tensor is cast to it before rounding, as the loaded path saves its model in the
    recipe's dtype). `advance(n)` is called after each group with its bytes in the saved dtype."""
    from llmcompressor.entrypoints.model_free.converter import ModelFreePtqConverter
    from llmcompressor.entrypoints.model_free.save_utils import update_config
    from llmcompressor.entrypoints.model_free.validate import validate_config

    names = weight_map(source)
    matching = validate_config(matching_config(config, names, quantized), None, [])
    converter = ModelFreePtqConverter(matching)
    pending: dict[str, torch.Tensor] = {}
    written: list[tuple[Path, list[str]]] = []
    totals = {"bytes": 0, "tensors": 0, "quantized": 0, "largest": 0}

    def flush() -> None:
        if not pending:
            return
        path = dest / f"part-{len(written) + 1:05d}.safetensors"
        save_streamed(pending, path)
        written.append((path, list(pending)))
        pending.clear()

    counts = elements(source, names)
    held = 0  # bytes in `pending`
    for group in layer_groups(names):
        read = sum(counts[n] for members in group.values() for n in members) * dtype.itemsize  # in the saved dtype
        totals["largest"] = max(totals["largest"], read)
        if held and held + read > shard_bytes:  # it writes at most what it reads: the shard is written first
            flush()
            held = 0
        tensors = {}
        for file, members in group.items():
            with safe_open(source / file, framework="pt") as f:
                for name in members:
                    # a tensor read is a view of the file's mapping, which lives (with every page the
                    # group touched) while any view of it does: what is not rounded (norms, embeddings)
                    # is copied out, or the pages of each layer would stay resident until the end
                    rounded = name.endswith(".weight") and name.removesuffix(".weight") in quantized
                    tensors[name] = f.get_tensor(name).to(dtype, copy=not rounded)
        out = converter.process(tensors)
        del tensors
        totals["quantized"] += sum(name.endswith(".weight_scale") for name in out)  # one per rounded matrix
        for name, tensor in out.items():
            pending[name] = tensor.contiguous()
            held += tensor.nbytes
        totals["bytes"] += sum(t.nbytes for t in out.values())
        totals["tensors"] += len(out)
        del out
        if advance:
            advance(read)
    flush()
    index = _name_shards(dest, written)
    if index is not None:
        (dest / INDEX).write_text(
            json.dumps({"metadata": {"total_size": totals["bytes"]}, "weight_map": index}, indent=2)
        )
    for name in COPIED:
        if (source / name).is_file():
            shutil.copyfile(source / name, dest / name)
    update_config(dest, config)
    _say_dtype(dest / "config.json", dtype)
    return Written(len(written), totals["tensors"], totals["quantized"], totals["bytes"], totals["largest"])


# torch dtype -> safetensors' name for it
_SAFETENSORS_DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
    torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def save_streamed(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A safetensors file written tensor by tensor from the tensors' own memory (the header, then
    each tensor's bytes): safetensors' `save_file` first copies every tensor into one bytes object,
    a second shard's worth of memory at the moment of writing."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for tensor in tensors.values():
            out.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def _name_shards(dest: Path, written: list[tuple[Path, list[str]]]) -> dict[str, str] | None:
    """The shards renamed as transformers names them: one file is model.safetensors (no index),
    several are model-0000i-of-0000n.safetensors with an index (returned)."""
    if len(written) == 1:
        written[0][0].rename(dest / "model.safetensors")
        return None
    index = {}
    for i, (path, names) in enumerate(written, 1):
        final = f"model-{i:05d}-of-{len(written):05d}.safetensors"
        path.rename(dest / final)
        index.update(dict.fromkeys(names, final))
    return index


def _say_dtype(config_path: Path, dtype: torch.dtype) -> None:
    """config.json's dtype: what the unquantized tensors and scales are saved in."""
    data = json.loads(config_path.read_text())
    name = str(dtype).removeprefix("torch.")
    data["dtype"] = name
    data.pop("torch_dtype", None)
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def produce(inputs: Inputs, groups: dict, ignore: list[str]) -> Produced:
    """The produce step of a model-free recipe: `groups` and `ignore` are compressed-tensors'
    config groups and ignore list as the loaded path's modifiers would use them; the tokenizer is
    saved as the loaded path saves it."""

    from transformers import AutoConfig

    source = inputs.base.path
    selected = {name for name, _, _ in recipe_layers(AutoConfig.from_pretrained(source), ignore)}
    dtype = getattr(torch, inputs.loaded.recipe.model.dtype)
    total = sum(elements(source, weight_map(source)).values()) * dtype.itemsize
    bar = tqdm(
        total=total, desc="produce (model-free)", unit="B", unit_scale=True, unit_divisor=1024, file=logs.terminal()
    )
    with bar:
        config = QuantizationConfig(config_groups=groups, ignore=ignore)
        written = quantize_files(source, inputs.staging, config, selected, dtype, advance=bar.update)
    inputs.tokenizer.save_pretrained(inputs.staging)
    log.info(
        "model-free: %d weight matrices rounded, %d tensors in %d shard(s), %.2f GiB; at most %.2f GiB read at once",
        written.quantized, written.tensors, written.shards, written.bytes / 2**30, written.largest_group_bytes / 2**30,
    )  # fmt: skip
    return Produced(
        card="- quantized model-free: the base's safetensors files rounded one decoder layer at a time "
        f"(llm-compressor {metadata.version('llmcompressor')}'s model-free converter), no model loaded, no data"
    )


def footprint(shape, saved: int, checkpoint: int, taken: list) -> ProduceFootprint:
    """The produce step's memory, for a model of `shape` saved in `saved` bytes per element and
    rounded in the schemes `taken`: no model; the largest group read at once (a decoder layer, or
    the embeddings) with its rounding, and the output shard being filled."""
    microscale = any((s.weights or {}).get("scale_dtype") in MICROSCALE for s in taken)
    read = max(shape.layer_params, shape.vocab * shape.hidden) * saved
    copies = ROUNDING_COPIES["microscale" if microscale else "other"]
    held = [
        ("the largest group of tensors read at once, and its rounding", int(read * copies)),
        ("the output shard being filled", min(checkpoint, SHARD_BYTES)),
    ]
    return ProduceFootprint(held, checkpoint, takes_model=False)


def experts_problem(loaded, config) -> list[str]:
    """A mixture of experts is not rounded model-free: its files hold each expert's matrices where
    transformers 5 stacks them into 3-D tensors, and the two paths were not shown to agree on it."""
    text = getattr(config, "text_config", config)
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or 1
    if experts <= 1:
        return []
    return [
        f"quantize.model_free: {loaded.recipe.model.source} is a mixture of {experts} experts; model-free "
        "rounding is verified on dense models only (set model_free: false)"
    ]
