"""What a tune over llama.cpp tensor types needs beyond the compressed-tensors one: each layer's
tensor name in the GGUF file, the bytes a candidate holds besides its tuned tensors, and an
allocation written as `llama-quantize --tensor-type` patterns.

The tuned tensors are the repeating blocks' 2-D weights (what `model/bits_per_weight` counts for a
GGUF checkpoint). The embeddings, and an untied output head, are pinned to `EMBEDDINGS` in every
candidate, as llama.cpp's own presets store them for the default model, so a candidate's size
depends only on its allocation.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

from quantbench.core.errors import UserError
from quantbench.engines import llamacpp
from quantbench.sources.checkpoint import gguf_tensors
from quantbench.tune.patterns import block_groups

log = logging.getLogger(__name__)

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
    groups, outside = block_groups(names)
    out = [f"^{re.escape(name)}\\.weight$" for name in outside]
    for prefix, blocks, suffixes in groups:
        which = "|".join(map(str, blocks))
        kinds = re.escape(suffixes[0]) if len(suffixes) == 1 else "(" + "|".join(map(re.escape, sorted(suffixes))) + ")"
        out.append(f"^{re.escape(prefix)}\\.({which})\\.{kinds}\\.weight$")
    return out


def fitting(base_gguf: Path, names: list[str], kind: str) -> list[str]:
    """The tensors of `names` (GGUF base names) whose rows a `kind` block divides."""
    rows = llamacpp.matrix_rows(base_gguf)
    return [n for n in names if rows[f"{n}.weight"] % llamacpp.block(kind) == 0]


def uniform_file(
    tools, base_gguf: Path, kind: str, names: list[str], out: Path, log_path: Path, imatrix: Path | None = None
) -> Path:
    """The base with every tensor of `names` that `kind` fits in `kind`, the embeddings pinned (as
    candidates have them), every other tensor in `EMBEDDINGS`; weighed by `imatrix` if given."""
    cmd = [tools.tool("llama-quantize")]
    for pattern in patterns(fitting(base_gguf, names, kind)):
        cmd += ["--tensor-type", f"{pattern}={kind.lower()}"]
    for pattern in PINNED:
        cmd += ["--tensor-type", f"{pattern}={EMBEDDINGS.lower()}"]
    if imatrix is not None:
        cmd += ["--imatrix", str(imatrix)]
    # a quantized file type, so the per-tensor types apply (llama-quantize ignores them for F16)
    cmd += [str(base_gguf), str(out), EMBEDDINGS, str(llamacpp.threads())]
    llamacpp.run_tool(cmd, log_path, f"llama-quantize: every tensor {kind} fits in {kind}")
    return out


class EngineRounding:
    """The weights of a type as llama.cpp stores them, for the types gguf-py cannot quantize (K- and
    I-quants) and, with an importance matrix (which only llama-quantize weighs by), for every type:
    the base's F16 GGUF is quantized once per type by `llama-quantize` (every tuned tensor the type
    fits), and each tensor is read back and de-quantized by gguf-py (which de-quantizes every type).
    The converter may have reordered a tensor's rows (Llama's q and k are permuted for llama.cpp's
    rotary layout): each row is matched back to the transformers layer's row it came from."""

    def __init__(
        self,
        tools,
        base_gguf: Path,
        names: dict[str, str],
        folder: Path,
        log_path: Path,
        imatrix: tuple[str, Callable[[], Path]] | None = None,
    ):
        """`imatrix`: what the importance matrix is computed from (for the key) and what computes
        it (called once, when a type is first rounded: a stored sensitivity needs none)."""
        self.tools, self.base_gguf, self.names = tools, base_gguf, names
        self.folder, self.log_path, self.imatrix = folder, log_path, imatrix
        self.readers: dict[str, object] = {}
        self.orders: dict[str, object] = {}
        self.matrix: Path | None = None
        # what a stored sensitivity depends on besides the model: the quantizer's build, the matrix
        self.key = tools.describe() + (f" imatrix {imatrix[0]}" if imatrix is not None else "")

    def rounds(self, scheme) -> bool:
        """Whether `scheme` is rounded here rather than in-process."""
        return bool(getattr(scheme, "by_engine", False) or (self.imatrix is not None and scheme.quantized))

    def __call__(self, layer: str, weight, kind: str):
        """`weight` (the transformers layer `layer`'s) rounded as llama.cpp stores it in `kind`."""
        import numpy as np
        import torch
        from gguf import quants

        name = self.names[layer]
        tensor = self._tensor(kind, name)
        back = quants.dequantize(tensor.data, tensor.tensor_type).reshape(weight.shape)
        order = self._order(layer, name, weight)
        if order is not None:
            back = back[order]
        return torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32)).to(weight.dtype)

    def _tensor(self, kind: str, name: str):
        from gguf import GGUFReader

        if kind not in self.readers:
            out = self.folder / f"rounding-{kind}.gguf"
            if not out.is_file():
                log.info(
                    "sensitivity: %s through llama-quantize (%s)",
                    kind,
                    "with the importance matrix" if self.imatrix is not None else "gguf-py has no quantizer for it",
                )
                partial = out.with_suffix(f".{os.getpid()}.partial")
                if self.imatrix is not None and self.matrix is None:
                    self.matrix = self.imatrix[1]()
                uniform_file(
                    self.tools,
                    self.base_gguf,
                    kind,
                    sorted(set(self.names.values())),
                    partial,
                    self.log_path,
                    self.matrix,
                )
                partial.replace(out)
            self.readers[kind] = {t.name: t for t in GGUFReader(out).tensors}
        tensor = self.readers[kind][f"{name}.weight"]
        if tensor.tensor_type.name != kind:
            raise UserError(
                f"llama-quantize stored {name} in {tensor.tensor_type.name}, not {kind}; its rows do not fit"
            )
        return tensor

    def _order(self, layer: str, name: str, weight):
        """For each of the layer's rows, the GGUF tensor's row holding it (None: the same order)."""
        import numpy as np
        from gguf import quants

        if layer not in self.orders:
            if "F16" not in self.readers:
                from gguf import GGUFReader

                self.readers["F16"] = {t.name: t for t in GGUFReader(self.base_gguf).tensors}
            t = self.readers["F16"][f"{name}.weight"]
            stored = quants.dequantize(t.data, t.tensor_type).reshape(weight.shape).astype(np.float32)
            mine = weight.detach().float().cpu().numpy()
            if np.allclose(stored, mine, rtol=1e-2, atol=1e-3):
                self.orders[layer] = None
            else:
                # nearest stored row to each of the layer's rows; a permutation, or the tensor is not the layer's
                dist = (mine**2).sum(1)[:, None] + (stored**2).sum(1)[None, :] - 2 * mine @ stored.T
                order = dist.argmin(1)
                close = np.allclose(stored[order], mine, rtol=1e-2, atol=1e-3)
                if len(set(order.tolist())) != len(order) or not close:
                    raise UserError(
                        f"{self.base_gguf.name}: tensor {name} does not hold the rows of {layer} in any order; "
                        "the GGUF was not converted from this model"
                    )
                self.orders[layer] = order
        return self.orders[layer]
