"""Recipe files: the pydantic schema, loading with every error at once, and a content hash.

A recipe is a YAML file in recipes/; its file name is the name `make quantize RECIPE=` takes.
Every section has defaults here, in the schema, and nowhere else. A minimal recipe:

```yaml
# make quantize RECIPE=my-gptq
quantize:
  method: gptq
  scheme: W4A16
  group_size: 64
```
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import (
    Annotated,
    Any,
    ClassVar,
    Generic,
    Literal,
    TypeVar,
    Union,
    get_args,
    get_origin,
)

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from quantbench.core.errors import UserError, did_you_mean
from quantbench.core.files import canonical_sha
from quantbench.core.settings import parse_yaml, read_settings

DEFAULT_MODEL = "builtin:smollm2-135m-instruct"
DEFAULT_TEXT = "builtin:python-docs"
QUOTE_CHARS = 80  # an error message quotes at most this much of a value


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(Strict):
    """Where the base model comes from, and the dtype it is loaded in for quantization."""

    source: str = Field(
        DEFAULT_MODEL,
        description="builtin:NAME, a local HF checkpoint dir, a local .gguf file, or hub:ORG/NAME",
    )
    # Tensors the scheme leaves unquantized (norms, embeddings, lm_head) are saved in this
    # dtype; bfloat16 is what a GPU serves.
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # The dtype the job computes in (quantizing, the reload check, scoring); it never changes what
    # is saved. auto: the saved dtype where this device runs it natively (bfloat16 on AMX,
    # AVX512-BF16 and CUDA), float32 otherwise (an AVX2-only CPU emulates bfloat16, ~7x slower).
    # Recorded as the tag quantbench.compute_dtype.
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"

    def computes_in(self) -> str:
        """compute_dtype resolved on this device (quantbench.hardware)."""
        from quantbench.core import hardware

        return hardware.compute_dtype(self.compute_dtype, self.dtype)


class CalibrationSpec(Strict):
    """Text the algorithm calibrates on: `samples` windows of `seq_len` tokens, fixed by `seed`."""

    source: str = Field(
        DEFAULT_TEXT,
        description="builtin:python-docs, a local .txt/.jsonl file, or hub:DATASET",
    )
    samples: PositiveInt = 32
    seq_len: PositiveInt = 512
    seed: int = 0
    text_field: str = "text"  # the field read from .jsonl lines and hub datasets
    split: str = "train"  # the split read from a hub dataset


class _QuantizeBase(Strict):
    # CPUs a job of this method asks of a Ray node unless the recipe or sweep says (resources:)
    JOB_CPUS: ClassVar[float] = 1
    # Module names (or "re:" patterns) left unquantized, as llm-compressor's `ignore`.
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])


class _LLMCompressorBase(_QuantizeBase):
    # fp8: also quantize the KV cache to FP8 with per-tensor scales calibrated on the calibration
    # data (stored in the checkpoint; vLLM serves it with --kv-cache-dtype fp8). None: 16-bit cache.
    kv_cache: Literal["fp8"] | None = None


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
        from quantbench.recipe import schemes

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


class _TwoEngines(_LLMCompressorBase):
    """`format:` picks the engine where two can write the scheme: compressed-tensors
    (llm-compressor) or the GPTQ / AWQ format of AutoGPTQ / AutoAWQ, written by GPTQModel, their
    maintained successor."""

    # options only one engine has: field -> (the format that has it, its default)
    ENGINE_ONLY: ClassVar[dict[str, tuple[str, Any]]] = {}

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
    """GPTQ weight-only: INT4 (W4A16) or INT8 (W8A16); compressed-tensors output (llm-compressor)
    or the GPTQ format (GPTQModel)."""

    method: Literal["gptq"]
    format: Literal["compressed-tensors", "gptq"] = "compressed-tensors"
    scheme: Literal["W4A16", "W8A16"] = "W4A16"
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
    """AWQ activation-aware scaling, then INT4 weight-only quantization (W4A16); compressed-tensors
    output (llm-compressor) or the AWQ GEMM format (GPTQModel)."""

    method: Literal["awq"]
    format: Literal["compressed-tensors", "awq"] = "compressed-tensors"
    scheme: Literal["W4A16"] = "W4A16"
    group_size: PositiveInt = 64
    symmetric: bool = False  # AWQ's usual grid: asymmetric with a zero point
    n_grid: PositiveInt = 20  # llm-compressor: grid points of the per-layer scale search; cost is linear in it
    duo_scaling: bool | Literal["both"] = True  # llm-compressor only
    ENGINE_ONLY: ClassVar[dict[str, tuple[str, Any]]] = {
        "n_grid": ("compressed-tensors", 20),
        "duo_scaling": ("compressed-tensors", True),
    }


class RTNSpec(_LayerSchemes):
    """Round-to-nearest: min-max scales, no calibration data (llm-compressor's QuantizationModifier);
    seconds on a small model. The cheapest way to a (mixed) compressed-tensors checkpoint."""

    method: Literal["rtn"]
    scheme: Literal["W4A16", "W8A16", "W8A8"] = "W4A16"
    group_size: PositiveInt | None = 64  # None: one scale per output channel (W8A8: always per channel)
    symmetric: bool = True


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


class SpinQuantSpec(_LayerSchemes):
    """SpinQuant's offline rotations, then GPTQ (or RTN): Hadamard rotations R1 (the residual
    stream) and R2 (attention heads) are fused into the weights, which spreads outliers across
    channels before rounding. No runtime cost and no runtime support needed; the embeddings are
    untied (the output head is stored separately, so a tied model's checkpoint grows)."""

    method: Literal["spinquant"]
    scheme: Literal["W4A16", "W8A16"] = "W4A16"
    group_size: PositiveInt | None = 64
    symmetric: bool = True
    rotations: list[Literal["R1", "R2"]] = Field(default_factory=lambda: ["R1", "R2"])
    # hadamard: sizes that are powers of two; random-hadamard: also k * 2^n for known k (576 = 36 * 16)
    transform_type: Literal["hadamard", "random-hadamard"] = "random-hadamard"
    quantizer: Literal["gptq", "rtn"] = "gptq"  # what rounds the rotated weights
    dampening_frac: float = Field(0.01, gt=0, lt=1)  # GPTQ


class FP8Spec(_LLMCompressorBase):
    """FP8 weights (per channel) and dynamic per-token FP8 activations; needs no data (unless
    `kv_cache: fp8`, whose scales are calibrated)."""

    method: Literal["fp8"]
    scheme: Literal["FP8_DYNAMIC"] = "FP8_DYNAMIC"


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
              "IQ3_XS", "IQ3_S", "IQ3_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "F16", "BF16")  # fmt: skip
GGUF_NEED_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "Q2_K_S")
GGUF_TENSOR_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS")
# what a tensor may be given (llama-quantize --tensor-type NAME=TYPE): ggml's tensor types
GGUF_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                     "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS",
                     "TQ1_0", "TQ2_0")  # fmt: skip


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
        from quantbench.core import hardware

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


class CheckSpec(Strict):
    """The reload check: the saved checkpoint is loaded back from disk and must be sane."""

    ppl_tokens: PositiveInt = 4096  # evaluation-split tokens scored for base and reload
    window: PositiveInt = 512  # perplexity window length
    # A sanity bound, not a quality gate: reloaded ppl / base ppl above this fails the run.
    max_ppl_ratio: float = Field(2.0, gt=1)
    prompt: str = "The Python interpreter"
    generate_tokens: PositiveInt = 16
    # Before anything runs, refuse a base model that predicts the held-out text worse than a unigram
    # model of its own tokens (a tokenizer, BOS or dtype that does not match its weights). Turn off
    # only for a model you know is random (tests' teachers).
    base_ppl_bound: bool = True


class EvaluateSpec(Strict):
    """Score the reloaded checkpoint against the base model right after quantizing."""

    suite: str = "default"  # suites/<suite>.yaml


class BenchSpec(Strict):
    """Measure speed against the base model after the evaluate stage, through a serving engine."""

    profile: str = "cpu-smoke"  # profiles/<profile>.yaml
    # auto: the first engine of quantbench.engines.AUTO (vLLM, transformers serve, in-process hf)
    # that serves the checkpoint's format on this device; an engine's name: that engine (an error
    # before the job if it cannot serve); hf: in-process transformers generate (not a serving
    # engine); serve: a server, the first that serves the format. One of engines.backend_choices()
    # less openai (a recipe starts its own servers).
    backend: str = "auto"

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        from quantbench import engines

        choices = [b for b in engines.backend_choices() if b != "openai"]
        if value not in choices:
            raise ValueError(f"unknown value '{value}'." + did_you_mean(value, choices))
        return value


class ResourcesSpec(Strict):
    """What one job asks of a Ray node (`quantbench sweep NAME --ray`); a local run ignores it.
    Unset: num_cpus from the method, num_gpus 1 on a cluster with GPUs (0 without), no memory
    reserved. Where a job runs does not change what it computes: these are not in the recipe's sha."""

    num_cpus: float | None = Field(None, gt=0)
    num_gpus: float | None = Field(None, ge=0)
    memory_gb: float | None = Field(None, gt=0)


class Recipe(Strict):
    description: str = ""
    model: ModelSpec = Field(default_factory=ModelSpec)
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec)
    quantize: QuantizeSpec
    check: CheckSpec = Field(default_factory=CheckSpec)
    evaluate: EvaluateSpec | None = None  # no section: no evaluation
    bench: BenchSpec | None = None  # no section: no speed measurement
    resources: ResourcesSpec | None = None  # asked of a Ray node; a sweep's resources: fill what is unset
    # What the produce step may take on this machine, in minutes: the job estimates its produce time
    # before it starts (from a measured forward pass) and says so when the estimate is over;
    # `quantize --strict-budget` then refuses (exit 2). None: no budget.
    budget_minutes: float | None = Field(None, gt=0, allow_inf_nan=False)  # .inf is no budget: leave it out


# method name -> its settings class, e.g. "gptq" -> GPTQSpec
METHODS: dict[str, type[Strict]] = {
    get_args(spec.model_fields["method"].annotation)[0]: spec for spec in get_args(get_args(QuantizeSpec)[0])
}


@dataclass(frozen=True)
class LoadedRecipe:
    name: str  # the file stem: what RECIPE= takes
    path: Path
    recipe: Recipe
    overrides: tuple[str, ...] = ()

    @property
    def resolved(self) -> dict[str, Any]:
        return self.recipe.model_dump(mode="json")

    def where(self, *loc: str) -> str:
        """`quantize.group_size (line 5)`: a field and its line in the recipe file, for messages."""
        line = _yaml_line(parse_yaml(read_settings(self.path), str(self.path))[1], loc)
        return ".".join(loc) + (f" (line {line})" if line else "")

    @property
    def sha(self) -> str:
        """Content hash of the resolved recipe (defaults filled in, overrides applied), without
        `resources:` and `budget_minutes:` (where and how long a job runs, not what it computes)."""
        resolved = {k: v for k, v in self.resolved.items() if k not in ("resources", "budget_minutes")}
        return canonical_sha(resolved, compact=True)

    def resources(self, fallback: ResourcesSpec | None = None) -> dict[str, float | None]:
        """What a job of this recipe asks of a Ray node: the recipe's resources:, then `fallback`
        (a sweep's), then the method's CPUs; num_gpus None means "1 on a cluster with GPUs"."""
        asked = {"num_cpus": self.recipe.quantize.JOB_CPUS, "num_gpus": None, "memory_gb": None}
        for spec in (fallback, self.recipe.resources):
            if spec is not None:
                asked.update({k: v for k, v in spec.model_dump().items() if v is not None})
        return asked


Settings = TypeVar("Settings", bound=BaseModel)


def load_named(directory: Path, name: str, schema: type[Settings], field: str, kind: str) -> Settings:
    """A small settings file by name (suites/NAME.yaml, profiles/NAME.yaml), validated by `schema`."""
    return validate_file(named_path(directory, name, field, kind), schema)


def named_path(directory: Path, name: str, field: str, kind: str) -> Path:
    """directory/NAME.yaml; UserError naming the close matches (or where they are looked for) when there is none."""
    path = directory / f"{name}.yaml"
    if not path.is_file():
        available = sorted(p.stem for p in directory.glob("*.yaml"))
        if not available:  # no such directory here, or an empty one: say where they are looked for
            raise UserError(
                f"{field}: unknown {kind} '{name}' (no {path}): there are no {kind} files in "
                f"{directory.resolve()}/. Run from the repository's root (where {directory.name}/ is), "
                f"or point QUANTBENCH_{directory.name.upper()} at the directory that holds them"
            )
        raise UserError(f"{field}: unknown {kind} '{name}' (no {path})." + did_you_mean(name, available))
    return path


def validate_file(path: Path, schema: type[Settings]) -> Settings:
    """A settings file validated by `schema`; every problem as `file: field: message`."""
    data, _ = parse_yaml(read_settings(path), str(path))
    try:
        return schema.model_validate(data or {})
    except ValidationError as exc:
        raise UserError(
            [f"{path}: {'.'.join(map(str, e['loc'])) or '(top level)'}: {e['msg']}" for e in exc.errors()]
        ) from None


@dataclass
class CheckedFile(Generic[Settings]):
    """A settings file checked by a schema as a recipe is: every problem with its line. `settings`
    is the file validated without the fields that have a problem (None when it cannot be), so the
    checks that follow the schema's (a stack's steps, a sweep's jobs) still run and say theirs."""

    path: Path
    node: yaml.Node | None
    settings: Settings | None
    problems: list[str]
    invalid: list[tuple]  # where the schema's problems are, e.g. ("steps", 1, "concurrency")

    def line(self, *loc: str | int) -> int | None:
        return _yaml_line(self.node, loc)


def check_file(path: Path, schema: type[Settings]) -> CheckedFile[Settings]:
    """Read and check a settings file (a stack, a sweep); problems as `file: field (line N): message`."""
    data, node = parse_yaml(read_settings(path), str(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return CheckedFile(
            path, node, None, [f"{path}: must be a mapping of settings, got {type(data).__name__}"], [()]
        )
    try:
        return CheckedFile(path, node, schema.model_validate(data), [], [])
    except ValidationError as exc:
        problems = [f"{path}: {line}" for line in _explain(exc, data, node, schema=schema)]
        invalid = [tuple(e["loc"]) for e in exc.errors()]
        return CheckedFile(path, node, _without(schema, data, invalid), problems, invalid)


def _without(schema: type[Settings], data: dict, invalid: list[tuple]) -> Settings | None:
    """`data` validated with every field that has a problem removed (left at its default); None
    when that is not enough (a required field, or a problem that is not one field's)."""
    import copy

    data = copy.deepcopy(data)
    for loc in invalid:
        parent: Any = data
        for part in loc[:-1]:
            ok = isinstance(parent, dict) and part in parent or isinstance(parent, list) and part < len(parent)
            parent = parent[part] if ok else None
        if not loc or not isinstance(parent, dict):
            return None
        parent.pop(loc[-1], None)
    try:
        return schema.model_validate(data)
    except ValidationError:
        return None


def short(value: Any) -> str:
    """A value as an error message may quote it: its repr, cut to a short prefix."""
    text = repr(value)
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + f"… ({len(text):,} characters)"


# ---------------------------------------------------------------------------------------------
# Finding recipes by name


def recipes_dir() -> Path:
    return Path(os.environ.get("QUANTBENCH_RECIPES", "recipes"))


def available_recipes(directory: Path | None = None) -> list[str]:
    directory = directory or recipes_dir()
    return sorted(p.stem for p in directory.glob("*.yaml")) if directory.is_dir() else []


def resolve_recipe_path(name_or_path: str, directory: Path | None = None) -> Path:
    """A name (`awq-int4`) means recipes/awq-int4.yaml; anything ending in .yaml/.yml is a path."""
    directory = directory or recipes_dir()
    if name_or_path.endswith((".yaml", ".yml")):
        path = Path(name_or_path)
        if path.is_dir():
            raise UserError(f"{path}: is a directory, not a recipe file")
        if not path.is_file():
            raise UserError(f"{path}: recipe file does not exist")
        return path
    path = directory / f"{name_or_path}.yaml"
    if not path.is_file():
        raise UserError(
            f"unknown recipe '{name_or_path}' (no {path})." + did_you_mean(name_or_path, available_recipes(directory))
        )
    return path


# ---------------------------------------------------------------------------------------------
# Loading: YAML -> overrides -> schema, with every problem reported at once


class RecipeError(UserError):
    """A recipe's problems, with `partial`: the recipe without the sections that have them (those at
    their defaults), or None when its model or quantize section has one. Checks of the model and its
    layers (validate, prepare) still run on it, so every problem is reported at once."""

    def __init__(self, problems: list[str], partial: LoadedRecipe | None, invalid: frozenset[str] = frozenset()):
        super().__init__(problems)
        self.partial = partial
        self.invalid = invalid  # the top-level sections with a problem (at their defaults in `partial`)


def load_recipe(path: str | Path, overrides: tuple[str, ...] | list[str] = ()) -> LoadedRecipe:
    """Load and validate one recipe file; raise RecipeError listing every problem found (the
    --set items that cannot apply and the schema's problems with the rest, together)."""
    path = Path(path)
    data, node = parse_yaml(read_settings(path), str(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: the recipe must be a mapping of sections, got {type(data).__name__}")
    problems = []
    applied: list[tuple[tuple[str, ...], str]] = []  # (key path, item) of the overrides that took effect
    for item in overrides:
        try:
            applied.append((_apply_override(data, item), item))
        except ValueError as exc:
            problems.append(f"{path}: --set {item}: {exc}")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        problems += [f"{path}: {line}" for line in _explain(exc, data, node, applied)]
        invalid = frozenset(str(e["loc"][0]) if e["loc"] else "" for e in exc.errors())
        raise RecipeError(problems, _partial(path, data, invalid, overrides), invalid) from None
    loaded = LoadedRecipe(name=path.stem, path=path, recipe=recipe, overrides=tuple(overrides))
    if problems:
        raise RecipeError(problems, loaded)
    return loaded


def _partial(path: Path, data: dict, invalid: frozenset[str], overrides) -> LoadedRecipe | None:
    """The recipe with every top-level section that has a problem dropped (see RecipeError)."""
    if invalid & {"", "model", "quantize"}:
        return None
    try:
        recipe = Recipe.model_validate({k: v for k, v in data.items() if k not in invalid})
    except ValidationError:
        return None
    return LoadedRecipe(name=path.stem, path=path, recipe=recipe, overrides=tuple(overrides))


def _apply_override(data: dict, item: str) -> tuple[str, ...]:
    """`calibration.samples=8`: the value is parsed as YAML (so 8 is an int, [a, b] a list).
    Returns the key path it set."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ValueError("expected KEY.PATH=VALUE")
    try:
        value, _ = parse_yaml(raw, "VALUE")
    except UserError as exc:
        raise ValueError(exc.problems[0].removeprefix("VALUE: ")) from None
    *parents, leaf = key.split(".")
    target = data
    for part in parents:
        child = target.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"'{part}' is not a section")
        target = child
    target[leaf] = value
    return (*parents, leaf)


def _explain(
    exc: ValidationError,
    data: dict,
    node: yaml.Node | None,
    applied: list[tuple[tuple[str, ...], str]] = (),
    schema: type[BaseModel] | None = None,
) -> list[str]:
    """One line per problem: the field, where it was written (a line of the file, or the --set
    item that set it) and what is wrong."""
    lines = []
    for err in exc.errors():
        loc = _strip_union_tags(err["loc"], data)
        if err["type"].startswith("union_tag_"):
            loc += ("method",)
        field = ".".join(str(p) for p in loc) or "(top level)"
        keys = tuple(str(p) for p in loc)
        by = [item for path, item in applied if keys[: len(path)] == path or path[: len(keys)] == keys]
        line = None if by else _yaml_line(node, loc)
        where = f" (--set {by[-1]})" if by else f" (line {line})" if line else ""
        lines.append(f"{field}{where}: {_message(err, loc, data, schema or Recipe)}")
    return lines


def _strip_union_tags(loc: tuple, data: dict) -> tuple:
    """pydantic puts the union tag in the location (quantize.gptq.group_size); users never wrote it."""
    out: list = []
    value: Any = data
    for part in loc:
        if isinstance(value, dict) and part not in value and part in METHODS and value.get("method") == part:
            continue
        out.append(part)
        value = value.get(part) if isinstance(value, dict) else None
    return tuple(out)


def _yaml_line(node: yaml.Node | None, loc: tuple) -> int | None:
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == str(part)), None)
            if match is None:
                break
            line = match[0].start_mark.line + 1
            node = match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def _message(err: dict, loc: tuple, data: dict, schema: type[BaseModel]) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1], data, schema)
        return f"unknown key '{loc[-1]}'." + did_you_mean(str(loc[-1]), allowed)
    if kind == "union_tag_invalid":
        tag = err["ctx"]["tag"]
        return f"unknown method '{tag}'." + did_you_mean(str(tag), METHODS)
    if kind == "union_tag_not_found":
        return "missing 'method'. Available: " + ", ".join(sorted(METHODS))
    if kind == "literal_error" and isinstance(err.get("input"), str):
        choices = [c.strip().strip("'") for c in err["ctx"]["expected"].replace(" or ", ",").split(",")]
        return f"unknown value {short(err['input'])}." + did_you_mean(
            err["input"][:QUOTE_CHARS], [c for c in choices if c]
        )
    if kind == "value_error":  # our own validators: the message says what is wrong, the section is the input
        return err["msg"].removeprefix("Value error, ")
    return f"{err['msg']} (got {short(err['input'])})" if "input" in err and kind != "missing" else err["msg"]


def _allowed_keys(loc: tuple, data: dict, schema: type[BaseModel]) -> list[str]:
    """The field names of the schema section at `loc`, for 'did you mean'."""
    cls: Any = schema
    value: Any = data
    for part in loc:
        if isinstance(part, int):  # an item of a list section (a stack's steps): its class is the list's
            value = value[part] if isinstance(value, list) and part < len(value) else None
            continue
        field = cls.model_fields.get(str(part))
        value = value.get(part) if isinstance(value, dict) else None
        if field is None:
            return []
        cls = field.annotation
        if get_origin(cls) is list:
            cls = get_args(cls)[0]
        if get_origin(cls) in (Union, UnionType):
            sections = [a for a in get_args(cls) if isinstance(a, type) and issubclass(a, BaseModel)]
            if len(sections) == 1:  # an optional section (`evaluate: EvaluateSpec | None`)
                cls = sections[0]
            else:  # the quantize union: the section's method picks the class
                method = value.get("method") if isinstance(value, dict) else None
                cls = METHODS.get(method)
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return []
    return list(cls.model_fields)
