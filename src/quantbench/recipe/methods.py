"""A recipe's `quantize:` section: one settings class per method (gptq, awq, rtn, autoround,
spinquant, fp8, smoothquant, bnb, gguf, distill), each with its defaults and its own checks, tied
together by `QuantizeSpec`, a union keyed on `method:`; `METHODS` names each method's class. The
rest of the recipe's schema, and loading it, are in recipe/__init__.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union, get_args

from pydantic import Field, PositiveInt, field_validator, model_validator

from quantbench.core import hardware
from quantbench.core.errors import UserError, did_you_mean
from quantbench.recipe import schemes
from quantbench.recipe.common import DEFAULT_TEXT, Strict


class _QuantizeBase(Strict):
    # CPUs a job of this method asks of a Ray node unless the recipe or sweep says (resources:)
    JOB_CPUS: ClassVar[float] = 1
    # Module names (or "re:" patterns) left unquantized, as llm-compressor's `ignore`.
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])


class _LLMCompressorBase(_QuantizeBase):
    # fp8: also quantize the KV cache to FP8 with per-tensor scales calibrated on the calibration
    # data (stored in the checkpoint; vLLM serves it with --kv-cache-dtype fp8). None: 16-bit cache.
    kv_cache: Literal["fp8"] | None = None


class _ModelFree(Strict):
    """`model_free: true`: the data-free schemes rounded straight from the base's safetensors
    files, one decoder layer at a time, with no model loaded (quantize/model_free.py): what a model
    too large for this machine's memory needs. The same weights as the loaded path (its arithmetic
    is llm-compressor's own); no calibration, so nothing that calibrates (NVFP4's activation global
    scale, `kv_cache`)."""

    model_free: bool = False

    def rounded_schemes(self) -> list[schemes.Scheme]:
        """The schemes this recipe rounds with where one may calibrate (fp8's are dynamic)."""
        return []

    @model_validator(mode="after")
    def _nothing_to_calibrate(self):
        if not self.model_free:
            return self
        if getattr(self, "kv_cache", None):
            raise ValueError(
                "model_free: the FP8 KV cache's scales are calibrated on data; a model-free job reads no data "
                "(kv_cache: null, or model_free: false)"
            )
        calibrating = [s.name for s in self.rounded_schemes() if s.calibrates]
        if calibrating:
            raise ValueError(
                f"model_free: {', '.join(calibrating)} calibrates its activations' scales on data; a model-free job "
                "rounds weights only (NVFP4A16 is NVFP4's weights with 16-bit activations; or model_free: false)"
            )
        return self


class _LayerSchemes(_LLMCompressorBase):
    """Mixed precision: `layers` gives some layers another scheme than the recipe's. Keys are
    scheme names (quantbench.schemes: W4A16-G64, W4A16-G32, W8A16, W8A8, FP8, BF16 = unquantized),
    values the layers (module names, or `re:` patterns) that take it; every other layer takes the
    recipe's `scheme`. A layer must be matched by the targets of one scheme only (checked against
    the model's layers when the recipe is validated or run).

        layers:
          W8A8: ["re:model\\.layers\\.(0|1)\\.mlp\\.down_proj$"]
          BF16: [model.layers.2.self_attn.o_proj]
    """

    layers: dict[str, list[str]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_schemes(self):
        canonical: dict[str, list[str]] = {}
        seen: dict[str, str] = {}
        for name, targets in self.layers.items():
            try:
                scheme = schemes.get(name, f"layers.{name}").name
            except UserError as exc:
                raise ValueError(exc.problems[0]) from None
            if not targets or not all(isinstance(t, str) and t for t in targets):
                raise ValueError(f"layers.{name}: a non-empty list of layer names or re: patterns")
            for target in targets:
                if target in seen and seen[target] != scheme:
                    raise ValueError(f"layers: '{target}' is listed under both {seen[target]} and {scheme}")
                seen[target] = scheme
            canonical.setdefault(scheme, []).extend(targets)
        self.layers = canonical
        return self

    @model_validator(mode="after")
    def _format_fixes_its_groups(self):
        return _format_fixes_its_groups(self)


def _format_fixes_its_groups(spec):
    """A floating-point format (NVFP4, MXFP4, MXFP8) has its group size and no zero points by
    definition, and only llm-compressor writes it: a recipe that says otherwise is refused."""
    scheme = getattr(spec, "scheme", "")
    if scheme not in schemes.FLOAT_FORMATS:
        return spec
    fixed = schemes.FLOAT_FORMATS[scheme].group_size
    if "group_size" in spec.model_fields_set and getattr(spec, "group_size", None) != fixed:
        raise ValueError(f"group_size: {scheme} scales every {fixed} weights by its format; leave group_size out")
    if "symmetric" in spec.model_fields_set and not getattr(spec, "symmetric", True):
        raise ValueError(f"symmetric: false: {scheme} is a floating-point format with no zero points")
    if getattr(spec, "format", "compressed-tensors") != "compressed-tensors":
        raise ValueError(f"format: {scheme} is written as compressed-tensors (llm-compressor) only")
    return spec


class _TwoEngines(_LLMCompressorBase):
    """`format:` picks the engine where two can write the scheme: compressed-tensors
    (llm-compressor) or the GPTQ / AWQ format of AutoGPTQ / AutoAWQ, written by GPTQModel, their
    maintained successor."""

    # options only one engine has: field -> (the format that has it, its default)
    ENGINE_ONLY: ClassVar[dict[str, tuple[str, Any]]] = {}
    if TYPE_CHECKING:  # every subclass declares its own `format:` field (the formats it takes)
        format: str

    @model_validator(mode="after")
    def _format_fits(self):
        if self.format != "compressed-tensors" and self.kv_cache is not None:
            raise ValueError(
                f"kv_cache: fp8 needs format compressed-tensors (the {self.format} format has no KV-cache scales)"
            )
        for name, (fmt, default) in self.ENGINE_ONLY.items():
            if self.format != fmt and getattr(self, name) != default:
                engine = "llm-compressor" if fmt == "compressed-tensors" else "GPTQModel"
                raise ValueError(
                    f"{name} applies to format {fmt} ({engine}) only; this recipe's format is {self.format}"
                )
        return self


class GPTQSpec(_LayerSchemes, _TwoEngines):
    """GPTQ: INT4 (W4A16) or INT8 (W8A16) weights, or the 4-bit floating-point formats (NVFP4A16,
    MXFP4A16; NVFP4 with its activations); compressed-tensors output (llm-compressor) or, for the
    integer schemes, the GPTQ format (GPTQModel)."""

    method: Literal["gptq"]
    format: Literal["compressed-tensors", "gptq"] = "compressed-tensors"
    scheme: Literal["W4A16", "W8A16", "W4AFP8", "NVFP4A16", "NVFP4", "MXFP4A16"] = "W4A16"
    group_size: PositiveInt | None = 64  # None: one scale per output channel
    symmetric: bool = True
    dampening_frac: float = Field(0.01, gt=0, lt=1)
    block_size: PositiveInt = 128  # llm-compressor only
    desc_act: bool = False  # GPTQ format only: quantize columns in activation order (act-order)
    ENGINE_ONLY: ClassVar[dict[str, tuple[str, Any]]] = {
        "block_size": ("compressed-tensors", 128),
        "desc_act": ("gptq", False),
        "layers": ("compressed-tensors", {}),
    }


class AWQSpec(_TwoEngines):
    """AWQ activation-aware scaling, then weight-only quantization: INT4 (W4A16), compressed-tensors
    output (llm-compressor) or the AWQ GEMM format (GPTQModel); or a 4-bit float format (NVFP4A16,
    MXFP4A16: llm-compressor's AWQ searches its scales against the format's own rounding)."""

    method: Literal["awq"]
    format: Literal["compressed-tensors", "awq"] = "compressed-tensors"
    scheme: Literal["W4A16", "NVFP4A16", "MXFP4A16"] = "W4A16"
    group_size: PositiveInt = 64  # a float format's is the format's (16, 32)
    symmetric: bool = False  # AWQ's usual grid: asymmetric with a zero point (a float format has none)
    n_grid: PositiveInt = 20  # llm-compressor: grid points of the per-layer scale search; cost is linear in it
    duo_scaling: bool | Literal["both"] = True  # llm-compressor only
    ENGINE_ONLY: ClassVar[dict[str, tuple[str, Any]]] = {
        "n_grid": ("compressed-tensors", 20),
        "duo_scaling": ("compressed-tensors", True),
    }

    @model_validator(mode="after")
    def _grid_has_steps(self):
        # llm-compressor spaces the grid by 1 / (n_grid - 2) with duo scaling (its default), else by
        # 1 / (n_grid - 1): fewer points divide by zero after calibration (ZeroDivisionError)
        least = 2 if self.duo_scaling is False else 3
        if self.format == "compressed-tensors" and self.n_grid < least:
            raise ValueError(f"n_grid: {self.n_grid}: AWQ's grid search needs at least {least} points")
        return self

    @model_validator(mode="after")
    def _float_format(self):
        # AWQ's defaults (group 64, asymmetric) give way to a float format's own
        _format_fixes_its_groups(self)
        if self.scheme in schemes.FLOAT_FORMATS:
            fixed = schemes.FLOAT_FORMATS[self.scheme].group_size
            assert fixed is not None  # NVFP4A16's 16, MXFP4A16's 32
            self.group_size, self.symmetric = fixed, True
        return self


class RTNSpec(_LayerSchemes, _ModelFree):
    """Round-to-nearest: min-max scales (llm-compressor's QuantizationModifier); seconds on a small
    model. The cheapest way to a (mixed) compressed-tensors checkpoint. The floating-point formats
    (NVFP4A16, NVFP4, MXFP4A16, MXFP4, MXFP8A16, MXFP8) round their weights the same way; no
    calibration data but for NVFP4, whose activations' global scale is calibrated."""

    method: Literal["rtn"]
    scheme: Literal[
        "W4A16", "W8A16", "W8A8", "W4AFP8", "NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8"
    ] = "W4A16"
    group_size: PositiveInt | None = 64  # None: one scale per output channel (W8A8: always per channel)
    symmetric: bool = True

    def rounded_schemes(self) -> list[schemes.Scheme]:
        return [schemes.from_recipe(self.scheme, self.group_size, self.symmetric), *map(schemes.get, self.layers)]


class AutoRoundSpec(_LayerSchemes):
    """AutoRound: signed gradient descent tunes each weight's rounding and the clipping range,
    block by block, against the block's full-precision output (llm-compressor's AutoRoundModifier,
    auto-round underneath). Better than RTN and often GPTQ at 4 bits; costs `iters` forward and
    backward passes per block."""

    method: Literal["autoround"]
    scheme: Literal["W4A16", "W8A16"] = "W4A16"
    group_size: PositiveInt | None = 64
    symmetric: bool = True
    iters: PositiveInt = 200  # tuning steps per block; the cost is linear in it
    batch_size: PositiveInt = 8
    lr: float | None = Field(None, gt=0)  # None: auto-round's default (1 / iters)


_ROTATIONS: tuple[Literal["R1", "R2"], ...] = ("R1", "R2")


class SpinQuantSpec(_LayerSchemes):
    """SpinQuant's offline rotations, then GPTQ (or RTN): Hadamard rotations R1 (the residual
    stream) and R2 (attention heads) are fused into the weights, which spreads outliers across
    channels before rounding. No runtime cost and no runtime support needed; the embeddings are
    untied (the output head is stored separately, so a tied model's checkpoint grows)."""

    method: Literal["spinquant"]
    scheme: Literal["W4A16", "W8A16"] = "W4A16"
    group_size: PositiveInt | None = 64
    symmetric: bool = True
    rotations: list[Literal["R1", "R2"]] = Field(default_factory=lambda: list(_ROTATIONS))
    # hadamard: sizes that are powers of two; random-hadamard: also k * 2^n for known k (576 = 36 * 16)
    transform_type: Literal["hadamard", "random-hadamard"] = "random-hadamard"
    quantizer: Literal["gptq", "rtn"] = "gptq"  # what rounds the rotated weights
    dampening_frac: float = Field(0.01, gt=0, lt=1)  # GPTQ

    def rotation_problems(self, loaded, config) -> list[str]:
        """The rotations need sizes they can be built for: R1 the hidden size, R2 the head
        dimension (hadamard: powers of two; random-hadamard: k * 2^n for the k that
        compressed-tensors ships). One line per rotation that cannot be, naming the field."""
        import torch
        from compressed_tensors.transform.utils.hadamard import _fetch_hadamard_divisor, is_pow2
        from compressed_tensors.utils import get_head_dim

        sizes = {"R1": ("hidden size", config.hidden_size), "R2": ("head dimension", get_head_dim(config))}
        problems = []
        for rotation in self.rotations:
            what, n = sizes[rotation]
            hadamard = self.transform_type == "hadamard"
            if not (is_pow2(n) if hadamard else _fetch_hadamard_divisor(n, torch.float32) is not None):
                hint = " (try transform_type: random-hadamard)" if hadamard else ""
                problems.append(
                    f"{loaded.path}: {loaded.where('quantize', 'transform_type')}: no {self.transform_type} "
                    f"matrix of size {n}, the {what} of {loaded.recipe.model.source}, for rotation {rotation}{hint}"
                )
        return problems


def rotation_problems(loaded, config) -> list[str]:
    """SpinQuant's rotation sizes the model cannot take (none for a recipe of another method)."""
    spec = loaded.recipe.quantize
    return spec.rotation_problems(loaded, config) if isinstance(spec, SpinQuantSpec) else []


class FP8Spec(_LLMCompressorBase, _ModelFree):
    """FP8 weights and dynamic FP8 activations; needs no data (unless `kv_cache: fp8`, whose scales
    are calibrated). FP8_DYNAMIC: a weight scale per output channel, an activation scale per token;
    FP8_BLOCK: a weight scale per `block_size` x `block_size` block (DeepSeek's 128, what most large
    open models ship in), an activation scale per group of `block_size` inputs."""

    method: Literal["fp8"]
    scheme: Literal["FP8_DYNAMIC", "FP8_BLOCK"] = "FP8_DYNAMIC"
    block_size: PositiveInt | None = None  # FP8_BLOCK only; None: 128

    @model_validator(mode="after")
    def _block_for_blocks(self):
        if self.block_size is not None and self.scheme != "FP8_BLOCK":
            raise ValueError(f"block_size: applies to scheme FP8_BLOCK only; this recipe's scheme is {self.scheme}")
        return self

    def blocks(self) -> schemes.Scheme | None:
        """The FP8_BLOCK scheme at this recipe's block size, or None (FP8_DYNAMIC)."""
        return schemes.fp8_block(self.block_size or 128) if self.scheme == "FP8_BLOCK" else None


class SmoothQuantSpec(_LLMCompressorBase):
    """SmoothQuant to move activation outliers into weights, then GPTQ: INT8 W8A8."""

    method: Literal["smoothquant"]
    scheme: Literal["W8A8"] = "W8A8"
    smoothing_strength: float = Field(0.8, gt=0, lt=1)
    dampening_frac: float = Field(0.01, gt=0, lt=1)


class BnbSpec(_QuantizeBase):
    """bitsandbytes, quantized as the model loads (no calibration): LLM.int8 (INT8) or 4-bit NF4 /
    FP4; saved as a transformers checkpoint with bitsandbytes serialization."""

    method: Literal["bnb"]
    scheme: Literal["INT8", "NF4", "FP4"] = "NF4"
    double_quant: bool = False  # 4-bit: quantize the quantization constants too (~0.4 bit/param less)
    # 4-bit: the dtype the matmuls run in; bitsandbytes computes in floating point only
    compute_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    int8_threshold: float = Field(6.0, ge=0)  # INT8: activation outlier threshold of LLM.int8


# llama-quantize's file types (llama.cpp's tools/quantize), and those it refuses without an
# importance matrix (a tensor of theirs would be IQ1/IQ2/IQ3_XXS, or Q2_K inside Q2_K_S)
GGUF_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S",
              "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS",
              "IQ3_XS", "IQ3_S", "IQ3_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4_MOE", "F16", "BF16")  # fmt: skip
GGUF_NEED_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "Q2_K_S")
GGUF_TENSOR_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS")
# what a tensor may be given (llama-quantize --tensor-type NAME=TYPE): ggml's tensor types
GGUF_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                     "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS",
                     "TQ1_0", "TQ2_0", "MXFP4")  # fmt: skip


class GGUFSpec(Strict):
    """llama.cpp's own quantization: the base model as an F16 GGUF file, quantized by
    `llama-quantize` to `type`, optionally guided by an importance matrix that `llama-imatrix`
    computes on the recipe's calibration text; the checkpoint is the .gguf file (served by
    llama-server, loaded de-quantized by transformers). `layers` gives tensors another type:
    keys are ggml tensor types, values llama.cpp tensor names or patterns (`attn_v`,
    `blk\\.0\\.ffn_down`), passed as `--tensor-type PATTERN=TYPE`. A tensor `layers` gives a type
    whose blocks do not divide its rows (K-quants and IQ4_XS need multiples of 256) is refused,
    named, before anything runs, unless `fallback: true` lets llama-quantize choose another type
    for it (as its own presets do).

        quantize:
          method: gguf
          type: Q4_K_M
          imatrix: true
          layers:
            Q8_0: [attn_v, ffn_down]
    """

    JOB_CPUS: ClassVar[float] = 2  # llama-quantize and llama-imatrix use every thread they are given

    method: Literal["gguf"]
    type: str = "Q8_0"
    imatrix: bool = False  # compute an importance matrix on the calibration text (never the evaluation split)
    layers: dict[str, list[str]] = Field(default_factory=dict)
    # a `layers` type a tensor's rows cannot hold: false refuses it, true lets llama-quantize choose another
    fallback: bool = False

    @property
    def scheme(self) -> str:
        """The recipe's scheme, as other methods name it: the llama.cpp type."""
        return self.type

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value.upper() not in GGUF_TYPES:
            raise ValueError(f"unknown llama-quantize type '{value}'." + did_you_mean(value.upper(), GGUF_TYPES))
        return value.upper()

    @field_validator("layers")
    @classmethod
    def _known_tensor_types(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for name, patterns in value.items():
            if name.upper() not in GGUF_TENSOR_TYPES:
                raise ValueError(
                    f"layers: unknown tensor type '{name}'." + did_you_mean(name.upper(), GGUF_TENSOR_TYPES)
                )
            out[name.upper()] = patterns
        return out

    @model_validator(mode="after")
    def _imatrix_where_needed(self) -> GGUFSpec:
        needs = [self.type] * (self.type in GGUF_NEED_IMATRIX) + [t for t in self.layers if t in GGUF_TENSOR_IMATRIX]
        if needs and not self.imatrix:
            raise ValueError(
                f"{', '.join(needs)} needs an importance matrix (llama-quantize refuses without one): set imatrix: true "
                "(computed on the calibration text)"
            )
        return self


class StudentSpec(Strict):
    """Where the student starts; exactly one of the three (none given: `layers: every-other`).
    - `layers`: depth pruning, the teacher's layers at these indices (or `every-other`: 0, 2, 4, ...);
    - `config`: the teacher's config with these fields changed, randomly initialised;
    - `source`: another model (any model source) that shares the teacher's tokenizer."""

    layers: Literal["every-other"] | list[Annotated[int, Field(ge=0)]] | None = None
    config: dict[str, Any] | None = None
    source: str | None = None

    @model_validator(mode="after")
    def _one_init(self) -> StudentSpec:
        given = [name for name in ("layers", "config", "source") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of layers, config, source (got {', '.join(given)})")
        if not given:
            self.layers = "every-other"
        if isinstance(self.layers, list) and (not self.layers or len(set(self.layers)) != len(self.layers)):
            raise ValueError("layers: a non-empty list of distinct teacher layer indices")
        return self


class TrainTextSpec(Strict):
    """The text the student learns from. For builtin:python-docs this is its training split,
    never the evaluation split."""

    source: str = Field(DEFAULT_TEXT, description="builtin:python-docs, a local .txt/.jsonl file, or hub:DATASET")
    text_field: str = "text"
    split: str = "train"  # the split read from a hub dataset


class DistillSpec(Strict):
    """Knowledge distillation: a smaller student learns the teacher's (the model's) next-token
    distribution; saved as a bf16 transformers checkpoint. Trained with transformers' Trainer."""

    JOB_CPUS: ClassVar[float] = 2  # the Trainer's data loading beside the training loop

    method: Literal["distill"]
    scheme: Literal["BF16"] = "BF16"  # what the student is saved in
    student: StudentSpec = Field(default_factory=StudentSpec)
    data: TrainTextSpec = Field(default_factory=TrainTextSpec)
    temperature: float = Field(2.0, gt=0)  # softens both distributions; the KD loss is scaled by T^2
    lm_loss_weight: float = Field(0.0, ge=0, le=1)  # loss = (1 - w) * KD + w * next-token cross-entropy
    steps: PositiveInt = 200
    batch_size: PositiveInt = 4
    seq_len: PositiveInt = 256
    learning_rate: float = Field(2e-4, gt=0)
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    seed: int = 0
    save_steps: PositiveInt = 25  # a resumable checkpoint every N steps
    log_steps: PositiveInt = 5  # loss / tokens-per-second to MLflow every N steps
    # bf16 autocast for the matmuls; weights, optimizer state and the loss stay float32. auto: on
    # where the device computes bfloat16 natively (AMX, AVX512-BF16, CUDA), off where it emulates it
    bf16: bool | Literal["auto"] = "auto"

    def autocasts(self) -> bool:
        """`bf16` resolved on this device."""
        return hardware.native("bfloat16") if self.bf16 == "auto" else self.bf16


QuantizeSpec = Annotated[
    Union[
        GPTQSpec,
        AWQSpec,
        RTNSpec,
        AutoRoundSpec,
        SpinQuantSpec,
        FP8Spec,
        SmoothQuantSpec,
        BnbSpec,
        DistillSpec,
        GGUFSpec,
    ],
    Field(discriminator="method"),
]


# method name -> its settings class, e.g. "gptq" -> GPTQSpec
METHODS: dict[str, type[Strict]] = {
    get_args(spec.model_fields["method"].annotation)[0]: spec for spec in get_args(get_args(QuantizeSpec)[0])
}
