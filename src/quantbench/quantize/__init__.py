"""Quantizers: what makes a checkpoint from a base model, one module each, imported only when a recipe
names their method: `quantbench --help`, validation of other methods and most tests import none.

Every quantizer module subclasses `Quantizer` (below), which owns the method's facts. The pipeline
never asks a quantizer how it works: it gives it `Inputs` and gets back `Produced` with the checkpoint
written into `Inputs.staging`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from quantbench.core.errors import UserError, did_you_mean
from quantbench.sources.checkpoint import skeleton

if TYPE_CHECKING:  # for the types alone: transformers imports torch, the recipe schema pydantic
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from quantbench.recipe import LoadedRecipe
    from quantbench.sources.models import ResolvedModel
    from quantbench.tracking import Run

# method (or method/format, where a recipe's `format:` picks another quantizer) -> "module:object"
QUANTIZERS = {
    "gptq": "quantbench.quantize.llmcompressor:LLMCompressorQuantizer",
    "awq": "quantbench.quantize.llmcompressor:LLMCompressorQuantizer",
    "fp8": "quantbench.quantize.llmcompressor:LLMCompressorQuantizer",
    "smoothquant": "quantbench.quantize.llmcompressor:LLMCompressorQuantizer",
    "rtn": "quantbench.quantize.llmcompressor:LLMCompressorQuantizer",
    "autoround": "quantbench.quantize.llmcompressor:LLMCompressorQuantizer",
    "spinquant": "quantbench.quantize.llmcompressor:LLMCompressorQuantizer",
    "bnb": "quantbench.quantize.bnb:BnbQuantizer",
    "distill": "quantbench.quantize.distill:DistillQuantizer",
    "gguf": "quantbench.quantize.gguf:GGUFQuantizer",
    "gptq/gptq": "quantbench.quantize.gptqmodel:GPTQModelQuantizer",
    "awq/awq": "quantbench.quantize.gptqmodel:GPTQModelQuantizer",
}
# the package a quantizer module needs, for a clear error when it is missing
PACKAGES = {
    "quantbench.quantize.llmcompressor": "llmcompressor",
    "quantbench.quantize.bnb": "bitsandbytes",
    "quantbench.quantize.distill": "transformers",
    "quantbench.quantize.gptqmodel": "gptqmodel",
    "quantbench.quantize.gguf": "gguf",
}


@dataclass
class Inputs:
    """What a quantizer gets to make a checkpoint; everything here was checked before the run began."""

    loaded: LoadedRecipe
    base: ResolvedModel
    tokenizer: PreTrainedTokenizerBase
    calibration: list[list[int]] | None  # token windows, when the quantizer calibrates
    staging: Path  # write the checkpoint here (the directory exists and is empty)
    log_path: Path  # the run's log file (a child process appends its output to it)
    workdir: Path  # state that must survive an interrupted job (training checkpoints), keyed by the recipe
    held_out: tuple[list[int], int]  # (token ids, window) of the reload check's text
    run: Run  # for curves logged while the quantizer works (training loss)
    model: PreTrainedModel | None = None  # the base model, loaded in the job's compute dtype; take it with take_model()

    def take_model(self):
        """The loaded base model, handed over: the pipeline keeps no reference, so a quantizer that
        does not use it (one that loads its own copy) frees it by not taking it."""
        model, self.model = self.model, None
        return model

    def drop_model(self) -> None:
        self.model = None


@dataclass
class Produced:
    """What a quantizer reports once the checkpoint is in `Inputs.staging`."""

    metrics: dict[str, float] = field(default_factory=dict)  # its own metrics (e.g. distill/*)
    reference_ppl: float | None = None  # the reload check bounds against this instead of the base's (a trained model)
    card: str = ""  # how it was made, for the model card (markdown list items)
    pinned: str = ""  # what the produce step pinned for a repeatable checkpoint (quantize/stage.py)


@dataclass
class ProduceFootprint:
    """What a quantizer declares of its produce step (the quantizer's `footprint`)."""

    held: list[tuple[str, int]]  # (what, bytes) resident at its peak, the runtime excluded
    checkpoint: int  # bytes the checkpoint will take on disk
    temp_disk: int = 0  # held on disk meanwhile (converted files, a work directory)
    fits_with: list[str] = field(default_factory=list)
    takes_model: bool = True  # it computes on the job's loaded base model (else it loads or reads its own)
    prepare_held: list[tuple[str, int]] = field(default_factory=list)  # its prepare (a conversion), at its peak
    prepare_disk: int = 0  # what its prepare leaves on disk (a cached conversion)
    # what reloading its checkpoint holds beyond the weights de-quantized to the compute dtype (the check)
    reload_held: list[tuple[str, int]] = field(default_factory=list)
    # it reads each of the base's weights and writes none: loaded as views of the base's files (in
    # their dtype), their pages are handed back as they are read (the job's produce)
    reads_base_once: bool = False


# A child Python (llama.cpp's converter, GPTQModel's worker) before it reads a model, and llama.cpp's
# tools besides the file they map: for the footprints.
CHILD_RUNTIME = int(0.5 * 2**30)
LLAMACPP_RUNTIME = int(0.15 * 2**30)


class Quantizer:
    """What every quantizer is: one subclass per quantizer module, named in `QUANTIZERS`. The
    pipeline asks the quantizer it holds for every fact about its method; nothing outside the
    module branches on a method's name.

    - `library`, `format`: the library that writes the checkpoint (tag `quantbench.engine`), and in
      which format;
    - `calibrates`: it needs calibration windows (`Inputs.calibration`);
    - `trains`: it makes a new model by training (the reload check bounds that model against itself);
    - `on_load`: it quantizes while the model loads (no pass over data);
    - `takes_model`: it computes on the job's base model loaded in the compute dtype (else the job
      loads none for it: one copy of the model at a time);
    - `mixes_per_layer`: it takes a scheme per layer (a recipe's `layers:`; what `tune` writes);
    - `loaders()`: which runtimes load what it writes (tags and model card);
    - `quantization_config()`: the `quantization_config` its checkpoint's config.json will carry, as
      far as a serving engine reads it, known before the checkpoint exists (None: not quantized);
    - `check(loaded, config)`: problems of this recipe on this model's shapes, from its config alone
      (also what `quantbench validate` runs);
    - `prepare(loaded, base, tokenizer)`: further input checks before the run starts (e.g. training
      text); returns the sha of any text it will read, by role;
    - `produce(inputs)`: write the checkpoint into `inputs.staging`;
    - `computes_in(model)`: the dtype it computes in where that is not the model section's
      `computes_in()` (None: the job's; the run's `quantbench.compute_dtype` says it);
    - `footprint(shape, loaded, compute)`: its produce step's memory and disk (None: the planner
      assumes one more copy of the model beside what it takes);
    - `prepared(base)`: what its `prepare` would make of this base is in the cache already (the
      planner then plans no conversion);
    - `round_to_nearest(model, scheme, ignore)`: a loaded model's Linear layers but `ignore` rounded
      to one scheme in place, without a recipe (the RTN quantizer's; tune's served cost table).
    """

    library: ClassVar[str]
    format: str
    calibrates: bool = False
    trains: ClassVar[bool] = False
    on_load: ClassVar[bool] = False
    takes_model: bool = True
    mixes_per_layer: bool = False

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    def loaders(self) -> str:
        raise NotImplementedError

    def quantization_config(self) -> dict | None:
        raise NotImplementedError

    def check(self, loaded, config) -> list[str]:
        return []

    def prepare(self, loaded, base, tokenizer) -> dict[str, str]:
        return {}

    def prepared(self, base) -> bool:
        """Whether what `prepare` makes of this base (sources.models.ResolvedModel; a conversion its
        footprint plans as `prepare_held`) is made already, in quantbench's cache."""
        return False

    def produce(self, inputs: Inputs) -> Produced:
        raise NotImplementedError

    def computes_in(self, model) -> str | None:
        return None

    def footprint(self, shape, loaded, compute: str) -> ProduceFootprint | None:
        return None

    @staticmethod
    def round_to_nearest(model, scheme, ignore: list[str]) -> None:
        raise NotImplementedError


def quantizer_key(method: str, format: str | None = None) -> str:
    return f"{method}/{format}" if f"{method}/{format}" in QUANTIZERS else method


def quantizer_class(method: str, format: str | None = None) -> type[Quantizer]:
    """The quantizer class for a recipe's method (and format); its module is imported now."""
    key = quantizer_key(method, format)
    if key not in QUANTIZERS:
        methods = [m for m in QUANTIZERS if "/" not in m]
        raise UserError(f"quantize.method: unknown method '{method}'." + did_you_mean(method, methods))
    module_name, _, attr = QUANTIZERS[key].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        package = PACKAGES.get(module_name, exc.name)
        what = f"'{method}' with format '{format}'" if "/" in key else f"'{method}'"
        raise UserError(
            f"quantize.method: {what} needs the package '{package}', which is not installed ({exc})"
        ) from None
    return getattr(module, attr)


def make_quantizer(spec) -> Quantizer:
    """The quantizer for a recipe's `quantize:` section."""
    return quantizer_class(spec.method, getattr(spec, "format", None))(spec)


def calibration_card(inputs: Inputs) -> str:
    """The model card's line on calibration data."""
    cal = inputs.loaded.recipe.calibration
    if inputs.calibration is None:
        return "- Calibration: none"
    return f"- Calibration: {len(inputs.calibration)} × {cal.seq_len} tokens of `{cal.source}`"


# ---------------------------------------------------------------------------------------------
# Shapes: quantizers that group weights need widths their group size divides


def recipe_layers(config, ignore: list[str]) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of every Linear layer a recipe would quantize, read from
    the model's `checkpoint.skeleton` (no weights), matched as llm-compressor matches targets
    (`checkpoint.linear_layers` has every Linear layer but the head, with no recipe)."""
    from compressed_tensors.utils import match_named_modules

    return [
        (name, m.in_features, m.out_features) for name, m in match_named_modules(skeleton(config), ["Linear"], ignore)
    ]


def group_size_problem(loaded, config, group_size: int, field: str = "group_size") -> list[str]:
    """A group size must divide the input width of every layer it quantizes."""
    widths: dict[int, list[str]] = {}
    for name, width, _ in recipe_layers(config, loaded.recipe.quantize.ignore):
        widths.setdefault(width, []).append(name)
    bad = {w: names for w, names in widths.items() if w % group_size}
    if not bad:
        return []
    detail = "; ".join(f"width {w} ({len(n)} layers, e.g. {n[0]})" for w, n in sorted(bad.items()))
    divisors = [g for g in (256, 128, 64, 32, 16) if all(w % g == 0 for w in widths)]
    hint = f" Group sizes that fit every layer: {', '.join(map(str, divisors))}." if divisors else ""
    return [
        f"{loaded.path}: {loaded.where('quantize', field)}: {group_size} does not divide the input width of "
        f"these layers of {loaded.recipe.model.source}: {detail}.{hint}"
    ]
