"""What a tune over llama.cpp tensor types needs beyond the compressed-tensors one: each layer's
tensor name in the GGUF file, the bytes a candidate holds besides its tuned tensors, and an
allocation written as `llama-quantize --tensor-type` patterns.

The tuned tensors are the repeating blocks' 2-D weights (what `model/bits_per_weight` counts for a
GGUF checkpoint). The embeddings, and an untied output head, are pinned to `EMBEDDINGS` in every
candidate, as llama.cpp's own presets store them for the default model, so a candidate's size
depends only on its allocation.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from quantbench.core.errors import UserError

EMBEDDINGS = "Q8_0"
PINNED = [r"^token_embd\.weight$", r"^output\.weight$"]  # llama-quantize patterns (regex search)


def tensor_names(config, layers: list[str]) -> dict[str, str]:
    """HF layer name -> the GGUF tensor's base name (`model.layers.3.self_attn.q_proj` ->
    `blk.3.attn_q`), through gguf-py's table for the model's architecture; UserError naming a
    layer llama.cpp's converter has no name for."""
    import gguf

    n_blocks = int(getattr(config, "num_hidden_layers", 0) or 0)
    model_type = str(getattr(config, "model_type", ""))
    archs = sorted(gguf.MODEL_ARCH_NAMES, key=lambda a: gguf.MODEL_ARCH_NAMES[a] != model_type)
    best: dict[str, str] = {}
    for arch in archs:
        table = gguf.get_tensor_name_map(arch, n_blocks)
        names = {layer: table.get_name(layer) for layer in layers}
        found = {k: v for k, v in names.items() if v}
        if len(found) == len(layers):
            return found
        if len(found) > len(best):
            best = found
    missing = [layer for layer in layers if layer not in best]
    raise UserError(
        f"--engine llamacpp: llama.cpp's converter names no tensor for {len(missing)} layer(s) of this "
        f"{model_type or 'model'} (e.g. {missing[0]}); a GGUF tune cannot place a type on them"
    )


def fixed_bytes(base_gguf: Path, tuned: set[str]) -> float:
    """Bytes of a candidate besides its tuned tensors, from the base's F16 GGUF: the header and
    metadata (the tokenizer), the embeddings and output head at `EMBEDDINGS`, everything else
    (norms, biases) as stored."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from quantbench.sources.checkpoint import gguf_tensors

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[EMBEDDINGS]]
    tensors = gguf_tensors(base_gguf)
    total = float(os.path.getsize(base_gguf) - sum(t[3] for t in tensors))
    for name, _, elements, stored in tensors:
        base = name.removesuffix(".weight")
        if base in tuned:
            continue
        pinned = any(re.search(p, name) for p in PINNED)
        total += elements / block * size if pinned else stored
    return total


def patterns(names: list[str]) -> list[str]:
    """Compact llama-quantize patterns for GGUF tensor base names: one per set of tensor kinds
    taken in the same blocks (`^blk\\.(0|3|7)\\.(attn_q|attn_k)\\.weight$`), exact names else."""
    from quantbench.tune.search import block_groups

    groups, outside = block_groups(names)
    out = [f"^{re.escape(name)}\\.weight$" for name in outside]
    for prefix, blocks, suffixes in groups:
        which = "|".join(map(str, blocks))
        kinds = re.escape(suffixes[0]) if len(suffixes) == 1 else "(" + "|".join(map(re.escape, sorted(suffixes))) + ")"
        out.append(f"^{re.escape(prefix)}\\.({which})\\.{kinds}\\.weight$")
    return out
