"""Per-layer quantization schemes: the names a recipe's `layers:` section and `quantbench tune
--schemes` use, what each stores (so its size in bits per weight is known before anything is
quantized), where it may apply (a group size must divide the layer's input width), and which
engines serve it.

A scheme is one compressed-tensors `QuantizationScheme` (weights, and for W8A8 / FP8 dynamic
input activations); a mixed checkpoint is several of them in one `config_groups`. BF16 means
"left unquantized" (the layer goes to the recipe's `ignore`). The floating-point formats (NVFP4,
MXFP4, MXFP8, FP8_BLOCK) are compressed-tensors' presets of the same names: their group or block
size is the format's, and `preset` builds them as compressed-tensors does.

vLLM fuses q/k/v into one matrix and gate/up into another, and refuses a checkpoint whose fused
parts differ in scheme, so a tune chooses one scheme per *unit* (a fused set, or a single layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quantbench.core.errors import UserError, did_you_mean


@dataclass(frozen=True)
class Scheme:
    name: str
    description: str
    weights: dict | None = None  # compressed-tensors QuantizationArgs; None: unquantized (BF16)
    activations: dict | None = None  # dynamic input activations (W8A8, FP8); None: 16-bit
    # the compressed-tensors preset it is (NVFP4A16, FP8_BLOCK, ...); keyword-only, after the subclasses' fields
    preset: str | None = field(default=None, kw_only=True)

    @property
    def group_size(self) -> int | None:
        return (self.weights or {}).get("group_size")

    @property
    def block_shape(self) -> tuple[int, int] | None:
        """(rows, columns) of a block-quantized scheme's weight blocks (FP8_BLOCK), else None."""
        structure = (self.weights or {}).get("block_structure")
        return (structure[0], structure[1]) if structure else None

    @property
    def quantized(self) -> bool:
        return self.weights is not None

    @property
    def calibrates(self) -> bool:
        """Its activations keep a scale fixed at quantization time (NVFP4's global input scale),
        so even a round-to-nearest job needs calibration data."""
        return self.activations is not None and self.activations.get("dynamic") is not True

    @property
    def stored_as(self) -> str | None:
        """The compressed-tensors format its checkpoint is written in (config.json's `format`)."""
        w = self.weights
        if w is None:
            return None
        if w["type"] == "int":  # INT4 beside FP8 activations (W4AFP8) packed too: what vLLM reads
            packed = self.activations is None or (w["num_bits"] == 4 and self.activations["type"] == "float")
            return "pack-quantized" if packed else "int-quantized"
        if w.get("scale_dtype") == "torch.float8_e4m3fn" and w["num_bits"] == 4:
            return "nvfp4-pack-quantized"
        if w.get("scale_dtype") == "torch.uint8":  # E8M0 exponents: OCP microscaling
            return f"mxfp{w['num_bits']}{'-pack' if w['num_bits'] == 4 else ''}-quantized"
        return "float-quantized"

    def fits(self, in_features: int, out_features: int | None = None) -> bool:
        """The scheme applies to a layer of this input width (its group size divides it) and, for a
        block scheme, output width (its blocks tile the weight)."""
        if self.block_shape:
            rows, columns = self.block_shape
            return in_features % columns == 0 and (out_features is None or out_features % rows == 0)
        return self.group_size is None or in_features % self.group_size == 0

    def bits(self, in_features: int, out_features: int, dtype_bits: int = 16, bias: bool = False) -> float:
        """Stored bits per weight of one layer: quantized values, scales, zero points, global scales,
        shape and bias, as compressed-tensors 0.19 writes them (scales in the model's dtype unless
        the format fixes theirs: FP8 for NVFP4, 8-bit exponents for MXFP4 / MXFP8)."""
        params = in_features * out_features
        extra = dtype_bits * out_features if bias else 0
        if self.weights is None:
            return dtype_bits + extra / params
        w = self.weights
        if self.block_shape:
            rows, columns = self.block_shape
            scales = -(-out_features // rows) * -(-in_features // columns)
        else:
            scales = out_features * (in_features // w["group_size"] if w.get("group_size") else 1)
        zero_points = 0 if w.get("symmetric", True) else scales * w["num_bits"]
        scale_bits = 8 if w.get("scale_dtype") in ("torch.float8_e4m3fn", "torch.uint8") else dtype_bits
        if self.stored_as == "pack-quantized":  # int32 words, int64 shape
            stored = params * w["num_bits"] + 2 * 64
        elif w["num_bits"] == 4:  # nvfp4 / mxfp4: two values a byte
            stored = params * 4
        else:  # int-quantized / float-quantized / mxfp8: one byte a weight
            stored = params * 8
        for args in (w, self.activations or {}):  # a float32 global scale per tensor
            stored += 32 if args.get("strategy") == "tensor_group" else 0
        return (stored + scales * scale_bits + zero_points + extra) / params

    def checkpoint_config(self, base_config: dict) -> dict:
        """The config.json of `base_config`'s model with every layer in this scheme, as
        compressed-tensors writes it (enough for an engine to say whether it would serve it)."""
        if self.weights is None:
            return base_config
        group = {"targets": ["Linear"], "weights": self.weights, "input_activations": self.activations}
        quantization = {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}}
        return {**base_config, "quantization_config": quantization}

    def quantization_scheme(self, targets: list[str]):
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

        if self.preset:  # as compressed-tensors builds it, with this scheme's block size
            scheme = preset_name_to_scheme(self.preset, targets)
            if self.block_shape and scheme.weights is not None:
                scheme.weights.block_structure = list(self.block_shape)
                if scheme.input_activations is not None:  # FP8_BLOCK's activations: groups of a block's width
                    scheme.input_activations.group_size = self.block_shape[1]
            return scheme
        if self.weights is None:
            raise ValueError(f"{self.name} leaves the weights unquantized: it has no quantization scheme")
        return QuantizationScheme(
            targets=targets,
            weights=QuantizationArgs(**self.weights),
            input_activations=QuantizationArgs(**self.activations) if self.activations else None,
            # compressed-tensors 0.19 would store W4AFP8's INT4 values a byte each (int-quantized: it packs
            # only beside integer or no activations); vLLM's W4A8 scheme reads them packed
            format="pack-quantized" if self.stored_as == "pack-quantized" and self.activations else None,
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


def _float(bits: int, group: int, scale_dtype: str, **more) -> dict:
    """A floating-point weight (or activation) format's QuantizationArgs, as its preset has them."""
    strategy = "tensor_group" if scale_dtype == "torch.float8_e4m3fn" else "group"
    args = {"num_bits": bits, "type": "float", "symmetric": True, "strategy": strategy, "group_size": group}
    return {**args, "scale_dtype": scale_dtype, **more}


_NV = "torch.float8_e4m3fn"  # NVFP4: an FP8 (E4M3) scale per 16 values, a float32 scale per tensor
_MX = "torch.uint8"  # OCP microscaling: an 8-bit power-of-two exponent (E8M0) per 32 values
MICROSCALE = (_NV, _MX)  # the scale dtypes of the microscale formats (NVFP4, MXFP4, MXFP8)


def fp8_block(block: int = 128) -> Scheme:
    """FP8 weights in square blocks of `block` (128: DeepSeek's, what most large open models ship),
    one scale per block; FP8 activations scaled per group of `block` as they come (dynamic)."""
    name = "FP8_BLOCK" if block == 128 else f"FP8_BLOCK-B{block}"
    weights = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "block",
        "group_size": None,
        "block_structure": [block, block],
    }
    activations = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "group",
        "group_size": block,
        "dynamic": True,
    }
    how = f"FP8 (E4M3) weights in {block}x{block} blocks, FP8 activations per {block} (dynamic)"
    return Scheme(name, how, weights, activations, preset="FP8_BLOCK")


# The floating-point formats of compressed-tensors 0.19's presets: name -> its scheme
FLOAT_FORMATS: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme(
            "NVFP4A16",
            "FP4 (E2M1) weights, an FP8 scale per 16 and a global one; 16-bit activations",
            _float(4, 16, _NV),
            None,
            preset="NVFP4A16",
        ),
        Scheme(
            "NVFP4",
            "NVFP4 weights and activations (W4A4; the activations' global scale calibrated)",
            _float(4, 16, _NV),
            _float(4, 16, _NV, dynamic="local"),
            preset="NVFP4",
        ),
        Scheme(
            "MXFP4A16",
            "FP4 (E2M1) weights, an 8-bit exponent scale per 32 (OCP MX); 16-bit activations",
            _float(4, 32, _MX),
            None,
            preset="MXFP4A16",
        ),
        Scheme(
            "MXFP4",
            "MXFP4 weights and activations (W4A4, dynamic)",
            _float(4, 32, _MX),
            _float(4, 32, _MX, dynamic=True),
            preset="MXFP4",
        ),
        Scheme(
            "MXFP8A16",
            "FP8 (E4M3) weights, an 8-bit exponent scale per 32 (OCP MX); 16-bit activations",
            _float(8, 32, _MX),
            None,
            preset="MXFP8A16",
        ),
        Scheme(
            "MXFP8",
            "MXFP8 weights and activations (dynamic)",
            _float(8, 32, _MX),
            _float(8, 32, _MX, dynamic=True),
            preset="MXFP8",
        ),
        fp8_block(),
    )
}

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
        Scheme(
            "W4AFP8",
            "INT4 weights, symmetric, a scale per 128 inputs; FP8 activations per token (dynamic)",
            _int(4, 128),
            _TOKEN_FP8,
        ),
        Scheme("BF16", "left unquantized, stored in the model's 16-bit dtype", None),
    )
} | FLOAT_FORMATS
# What `quantbench tune` chooses from unless told: the schemes vLLM-CPU serves together.
# The floating-point formats a tune may choose per layer: weight-only, 4-bit, which both GPTQ and
# round-to-nearest write (what a tune's candidates are made with); their sensitivity rounds them as
# llm-compressor does (tune/measure.py). The others (NVFP4's and MXFP4's 4-bit activations, whose
# scales are calibrated; MXFP8A16, which GPTQ does not take) are quantized whole.
TUNE_FLOAT_FORMATS = ("NVFP4A16", "MXFP4A16")
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

    def fits(self, in_features: int, out_features: int | None = None) -> bool:
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
        GgufType("MXFP4", "4-bit E2M1 floats in blocks of 32, one E8M0 scale", {"gguf": "MXFP4"}, None, 32, 17),
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
# but MXFP4, whose power-of-two scales round the default model's linear layers with 1.8x Q4_0's
# squared error for 0.25 bit less (asked for by name, `--schemes MXFP4`, it is one)
DEFAULT_GGUF_TUNE_TYPES = tuple(t for t in GGUF_TUNE_TYPES if t not in ("Q2_K", "Q3_K", "MXFP4"))
# a tune's unquantized type is F16 (BF16 is slow or missing in llama.cpp's CPU kernels on some classes)
_GGUF_NOT_TUNED = ("BF16",)


def tune_scheme(name: str, field: str = "--schemes", gguf: bool = False) -> Scheme:
    """A scheme a tune chooses from: a compressed-tensors scheme, or with `gguf` a llama.cpp tensor
    type; UserError naming `field` with the choices (and why a K-quant is not one)."""
    if not gguf:
        scheme = get(name, field)
        float_activations = (
            scheme.weights and scheme.weights["type"] == "int" and (scheme.activations or {}).get("type") == "float"
        )
        if (scheme.preset and scheme.name not in TUNE_FLOAT_FORMATS) or float_activations:
            raise UserError(
                f"{field}: {scheme.name} is not a tune choice: a tune rounds the integer schemes, FP8 and the "
                f"4-bit float formats of 16-bit activations ({', '.join(TUNE_FLOAT_FORMATS)}) per layer (its "
                f"sensitivity pass has no {scheme.name} rounding); quantize it whole instead "
                "(method rtn or gptq, scheme " + scheme.name + ")"
            )
        return scheme
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
    it is one of them, else a scheme of its own named after its settings (W4A16-G16-ASYM). A
    floating-point format is its own (its group size is the format's)."""
    if scheme in FLOAT_FORMATS:
        return FLOAT_FORMATS[scheme]
    if scheme == "W8A8":
        weights, activations = _int(8, None), _TOKEN_INT8
    elif scheme == "W4AFP8":
        weights, activations = _int(4, group_size), _TOKEN_FP8
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
    keys = ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic", "block_structure")

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
