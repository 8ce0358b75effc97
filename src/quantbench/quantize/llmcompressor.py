"""GPTQ, AWQ, RTN, AutoRound, SpinQuant (+ GPTQ or RTN), FP8 and SmoothQuant through
llm-compressor; writes compressed-tensors checkpoints (the format vLLM serves, and transformers
loads). GPTQ, RTN, AutoRound and SpinQuant take per-layer schemes (`layers:`): one
config_groups entry per scheme, the recipe's own scheme last on every other Linear layer."""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import sys
from contextlib import contextmanager, redirect_stdout
from importlib import metadata
from pathlib import Path
from typing import Any

# llm-compressor configures its loguru sink on import, before a run's log file is added: a console
# sink on the sys.stdout of that moment, where --json prints, at INFO ("No accelerator available!
# Compressing model on CPU instead" once per layer). Imported with stdout on stderr (nothing reaches
# stdout), then that sink is replaced by one that writes warnings only, to whatever sys.stderr is
# when a line is written (a sink bound to the stream of the import's moment wrote into a closed test
# capture later, a "Logging error" traceback), and only translates them while a command keeps the
# console quiet; its lines go to the run's log file (core.logs).
with redirect_stdout(sys.stderr):
    import llmcompressor  # noqa: F401
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from llmcompressor.logger import support_log_once
from loguru import logger as _loguru

from quantbench.core import logs
from quantbench.core.files import drop_file_pages, mapped_files
from quantbench.quantize import (
    Inputs,
    Produced,
    ProduceFootprint,
    Quantizer,
    calibration_card,
    group_size_problem,
    model_free,
    recipe_layers,
)
from quantbench.recipe import schemes
from quantbench.recipe.methods import (
    AutoRoundSpec,
    AWQSpec,
    FP8Spec,
    GPTQSpec,
    RTNSpec,
    SmoothQuantSpec,
    SpinQuantSpec,
    rotation_problems,
)
from quantbench.sources.checkpoint import linear_layers
from quantbench.sources.shapes import BYTES, Shape

log = logging.getLogger(__name__)

_loguru.remove()
_loguru.add(
    logs.library_sink,
    level="WARNING",
    format="{time:HH:mm:ss} llm-compressor {level}: {message}",
    filter=support_log_once,  # type: ignore[arg-type]  # typed for a dict, called with loguru's record (one)
)
# Its sequential pipeline draws two bars per layer ("(3/31): Calibrating", "Propagating"): one bar of ours instead
logs.relay(r"\((\d+)/(\d+)\): Calibrating", "produce (layers)", "layer")
# What of llm-compressor's warnings changes what the user gets, said once in our words
logs.translate(
    r"(\d+) mappings were skipped due to incompatible shapes",
    "AWQ skipped {0} layer mappings whose shapes do not match (e.g. grouped-query attention's v_proj -> o_proj): "
    "those layers are quantized without AWQ's scaling",
)
logs.translate(
    r"Skipping smooth_layer (\S+), NaN or inf outputs",
    "AWQ left {0} unscaled: its outputs were NaN or inf on the calibration data",
)
logs.translate(
    r"Skipping (\S+) for mapping .* because (no balance layers were found|no layers are targeted)",
    "AWQ skipped the mapping at {0}: {1}",
)

MIXED = (GPTQSpec, RTNSpec, AutoRoundSpec, SpinQuantSpec)  # the specs with `layers:`


# recipe `kv_cache:` -> llm-compressor's kv_cache_scheme (static per-tensor scales, calibrated)
KV_CACHE_SCHEMES = {"fp8": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}}


class LLMCompressorQuantizer(Quantizer):
    """llm-compressor's oneshot on the loaded base model, in place; saved compressed."""

    library = "llm-compressor"
    format = "compressed-tensors"
    trains = False
    on_load = False
    takes_model = True  # it quantizes the job's loaded base model in place

    @staticmethod
    def loaders() -> str:
        import compressed_tensors

        return f"compressed-tensors {compressed_tensors.__version__} — vLLM, SGLang, transformers (+compressed-tensors)"

    def __init__(self, spec: GPTQSpec | AWQSpec | RTNSpec | AutoRoundSpec | SpinQuantSpec | FP8Spec | SmoothQuantSpec):
        self.spec = spec
        self.scheme = own_scheme(spec)
        mixed = [schemes.get(name) for name in spec.layers] if isinstance(spec, MIXED) else []
        self.calibrates = (
            not isinstance(spec, (FP8Spec, RTNSpec))
            or spec.kv_cache is not None
            or any(s.calibrates for s in [self.scheme, *mixed])
        )
        self.mixes_per_layer = isinstance(spec, MIXED)
        # model_free: rounded from the base's files one layer at a time; the job loads no model for it
        self.model_free = bool(getattr(spec, "model_free", False))
        self.takes_model = not self.model_free

    def quantization_config(self) -> dict:
        """compressed-tensors' config sketched from the scheme: weight type and bits, input
        activations' type and bits, the storage format (integer weights packed when weight-only,
        nvfp4 / mxfp4 packed, mxfp8), the KV cache's scheme (tests/helpers.assert_sketched holds it
        to what llm-compressor writes)."""
        weights, activations = self.scheme.weights or {}, self.scheme.activations
        group = {
            "weights": {"type": weights["type"], "num_bits": weights["num_bits"]},
            "input_activations": (
                {"type": activations["type"], "num_bits": activations["num_bits"]} if activations else None
            ),
        }
        quant: dict[str, Any] = {
            "quant_method": "compressed-tensors",
            "config_groups": {"group_0": group},
            "format": self.scheme.stored_as,
        }
        if getattr(self.spec, "kv_cache", None):
            quant["kv_cache_scheme"] = {"type": "float", "num_bits": 8}
        return quant

    def check(self, loaded, config) -> list[str]:
        free = model_free.experts_problem(loaded, config) if self.model_free else []
        if isinstance(self.spec, MIXED) and self.spec.layers:
            return (
                layer_problems(loaded, config)
                + rotation_problems(loaded, config)
                + self.experts_problem(loaded, config)
                + free
            )
        scheme = self.scheme
        # a floating-point format's group size is the format's: the recipe said it by its scheme
        field = "scheme" if scheme.preset else "group_size"
        return (
            (group_size_problem(loaded, config, scheme.group_size, field) if scheme.group_size else [])
            + (block_problem(loaded, config, scheme) if scheme.block_shape else [])
            + rotation_problems(loaded, config)
            + self.experts_problem(loaded, config)
            + free
        )

    def prepare(self, loaded, base, tokenizer) -> dict[str, str]:
        if self.model_free:
            model_free.weight_map(base.path)  # safetensors files to read, or a UserError naming model.source
        return {}

    def experts_problem(self, loaded, config) -> list[str]:
        """Asymmetric integer weights (a zero point each group) on a mixture of experts: transformers
        5 cannot reload them (its fused-experts conversion leaves every expert's weight_zero_point
        unused and fails; measured on the size ladder's moe-8x rung with AWQ's default). Refused
        before the job calibrates for minutes."""
        if Shape.from_config(config).experts <= 1 or getattr(self.spec, "symmetric", True):
            return []
        return [
            f"{loaded.path}: {loaded.where('quantize', 'symmetric')}: false (zero points) on a mixture of experts "
            f"({loaded.recipe.model.source}): transformers {metadata.version('transformers')} cannot reload asymmetric "
            "compressed-tensors experts; set quantize.symmetric: true"
        ]

    def weight_bits(self, hidden: int) -> float:
        """Stored bits per quantized weight, scales included (a layer of `hidden` inputs and outputs)."""
        return self.scheme.bits(hidden, hidden)

    def computes_in(self, model) -> str | None:
        """Model-free rounding computes in the saved dtype (the same bits as the loaded path where
        the job's compute dtype is that one)."""
        return model.dtype if self.model_free else None

    def footprint(self, shape, loaded, compute: str):
        """The produce step's memory: the loaded base (in place) and, while saving, its quantized
        tensors compressed beside it; a calibrating method also caches every calibration window's
        activations at the layer it is working on (llm-compressor's sequential pipeline), and GPTQ
        keeps a float32 Hessian per Linear layer of that layer; a method that neither calibrates nor
        writes weights (`detaches`) reads the base once. Model-free: model_free.footprint."""
        bits = self.weight_bits(shape.hidden)
        saved = BYTES[loaded.recipe.model.dtype]
        quantized = int(shape.quantized_params * bits / 8)
        checkpoint = quantized + (shape.params - shape.quantized_params) * saved
        if self.model_free:
            taken = [self.scheme, *(schemes.get(n) for n in getattr(self.spec, "layers", {}))]
            return model_free.footprint(shape, saved, checkpoint, taken)
        held = [("its compressed tensors while saving", quantized)]
        fits = []
        if self.calibrates:
            cal = loaded.recipe.calibration
            tokens = cal.samples * cal.seq_len
            width = shape.hidden * 2 + shape.intermediate * (2 if isinstance(self.spec, AWQSpec) else 1)
            held.append(("calibration activations at one layer", tokens * width * BYTES[compute]))
            if isinstance(self.spec, (GPTQSpec, SmoothQuantSpec)) or (
                isinstance(self.spec, SpinQuantSpec) and self.spec.quantizer == "gptq"
            ):
                held.append(("one layer's Hessians", shape.hessian_bytes))
            fits.append("fewer calibration windows (--set calibration.samples=N) or shorter ones (calibration.seq_len)")
        elif hasattr(self.spec, "model_free"):  # data-free: rounded from the files, no model loaded
            fits.append("--set quantize.model_free=true (read one decoder layer at a time, no model loaded)")
        once = not (self.calibrates or self.detaches)
        return ProduceFootprint(held, checkpoint, fits_with=fits, reads_base_once=once)

    @property
    def detaches(self) -> bool:
        """Its method rescales or updates weights in place: `produce` copies them out of the files first."""
        return not isinstance(self.spec, (FP8Spec, RTNSpec))

    def produce(self, inputs: Inputs) -> Produced:
        from llmcompressor.core import reset_session

        if self.model_free:
            return model_free.produce(inputs, *self.groups())
        model = inputs.take_model()
        if self.detaches:
            detach_from_files(model)
        try:
            with traced_namespaces_forgotten():
                self.quantize(model, inputs.calibration)
            self.save(model, inputs.tokenizer, inputs.staging, inputs.loaded.recipe.model.dtype)
        finally:
            # llm-compressor's session keeps the model it compressed (and its modifiers' state): let
            # it go, or the reload check loads the checkpoint beside a second copy of the model
            reset_session()
        return Produced(card="\n".join([calibration_card(inputs), *experts_card(inputs, self.calibrates)]))

    def groups(self) -> tuple[dict[str, QuantizationScheme], list[str]]:
        """compressed-tensors' config groups and ignore list of this recipe, as the modifiers use
        them (the model-free path's config)."""
        from compressed_tensors.quantization import preset_name_to_scheme

        spec = self.spec
        if isinstance(spec, MIXED):
            groups, ignore = config_groups(spec)
            for name, group in groups.items():  # the format each group is stored in, as the loaded path's save says it
                group.format = (self.scheme if name == "group_0" else schemes.get(name)).stored_as
            return groups, ignore
        if isinstance(spec, FP8Spec):
            blocks = spec.blocks()
            scheme = (
                blocks.quantization_scheme(["Linear"]) if blocks else preset_name_to_scheme(spec.scheme, ["Linear"])
            )
            scheme.format = self.scheme.stored_as
            return {"group_0": scheme}, list(spec.ignore)
        raise TypeError(f"{type(spec).__name__} has no model-free path")

    def modifiers(self) -> list:
        """The llm-compressor recipe for this spec, as modifier objects."""
        from llmcompressor.modifiers.gptq import GPTQModifier
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

        spec = self.spec
        kv = {"kv_cache_scheme": KV_CACHE_SCHEMES[spec.kv_cache]} if spec.kv_cache else {}
        if isinstance(spec, MIXED):
            groups, ignore = config_groups(spec)
            if isinstance(spec, GPTQSpec):
                return [
                    GPTQModifier(
                        config_groups=groups,
                        ignore=ignore,
                        block_size=spec.block_size,
                        dampening_frac=spec.dampening_frac,
                        **kv,
                    )
                ]
            if isinstance(spec, RTNSpec):
                return [QuantizationModifier(config_groups=groups, ignore=ignore, **kv)]
            if isinstance(spec, AutoRoundSpec):
                from llmcompressor.modifiers.autoround import AutoRoundModifier

                # torch.compile of the tuning loop needs a compiler toolchain and pays off on GPUs
                return [
                    AutoRoundModifier(
                        config_groups=groups,
                        ignore=ignore,
                        iters=spec.iters,
                        batch_size=spec.batch_size,
                        lr=spec.lr,
                        enable_torch_compile=torch.accelerator.is_available(),
                        **kv,
                    )
                ]
            from llmcompressor.modifiers.transform import SpinQuantModifier

            rotate = SpinQuantModifier(rotations=spec.rotations, transform_type=spec.transform_type)
            if spec.quantizer == "gptq":
                return [
                    rotate,
                    GPTQModifier(config_groups=groups, ignore=ignore, dampening_frac=spec.dampening_frac, **kv),
                ]
            return [rotate, QuantizationModifier(config_groups=groups, ignore=ignore, **kv)]
        if isinstance(spec, AWQSpec):
            # AWQ only rescales channels; the quantization modifier after it rounds the weights
            # on the grid AWQ searched against.
            weights = (
                self.scheme.quantization_scheme(["Linear"])
                if self.scheme.preset
                else weight_only_scheme(4, spec.group_size, spec.symmetric)
            )
            return [
                AWQModifier(n_grid=spec.n_grid, duo_scaling=spec.duo_scaling),
                QuantizationModifier(config_groups={"group_0": weights}, ignore=spec.ignore, **kv),
            ]
        if isinstance(spec, FP8Spec):
            if blocks := spec.blocks():
                groups = {"group_0": blocks.quantization_scheme(["Linear"])}
                return [QuantizationModifier(config_groups=groups, ignore=spec.ignore, **kv)]
            return [QuantizationModifier(targets=["Linear"], scheme=spec.scheme, ignore=spec.ignore, **kv)]
        return [
            SmoothQuantModifier(smoothing_strength=spec.smoothing_strength),
            GPTQModifier(
                targets=["Linear"], scheme=spec.scheme, ignore=spec.ignore, dampening_frac=spec.dampening_frac, **kv
            ),
        ]

    def quantize(self, model, calibration: list[list[int]] | None) -> None:
        from llmcompressor import oneshot

        kwargs = {}
        if self.calibrates:
            from datasets import Dataset
            from datasets.table import InMemoryTable

            assert calibration is not None  # the job makes windows for a method that calibrates
            columns = {"input_ids": calibration, "attention_mask": [[1] * len(row) for row in calibration]}
            # A fingerprint of our own, from the ids: without one, datasets 5.2 hashes the whole table,
            # which fails on Python 3.12 ("Can't pickle <class 'MonthDayNano'>", any dill from 0.3.8
            # to 0.4.1, pyarrow 22 or 25: tests/test_offline_check.py, docs/offline.md)
            fingerprint = hashlib.sha256(json.dumps(calibration).encode()).hexdigest()[:16]
            kwargs = {
                "dataset": Dataset(InMemoryTable.from_pydict(columns), fingerprint=fingerprint),
                "num_calibration_samples": len(calibration),
                "max_seq_length": max(len(row) for row in calibration),
                # The windows are already chosen and ordered by calibration.seed. llm-compressor's
                # default draws them in an unseeded random order (a RandomSampler on torch's global
                # generator), and AWQ's and GPTQ's sums over batches then round differently run
                # to run: the same recipe and seed gave different checkpoints.
                "shuffle_calibration_samples": False,
            }
        with cpu_safe_pinning():
            oneshot(model=model, recipe=self.modifiers(), **kwargs)
        if isinstance(self.spec, AutoRoundSpec):
            log.info(
                "AutoRound: zero points of %d asymmetric layers carried into the checkpoint",
                carry_autoround_zero_points(model),
            )

    @staticmethod
    def round_to_nearest(model, scheme: schemes.Scheme, ignore: list[str]) -> None:
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import QuantizationModifier

        groups = {"group_0": scheme.quantization_scheme(["Linear"])}
        recipe: list = [QuantizationModifier(config_groups=groups, ignore=ignore)]
        with cpu_safe_pinning():
            oneshot(model=model, recipe=recipe)

    def save(self, model, tokenizer, dest: Path, dtype: str) -> None:
        """Saved in the recipe's dtype (`model.dtype`), whatever dtype the job computed in: unquantized
        tensors and scales are cast, then the weights are compressed against the cast scales."""
        saved = getattr(torch, dtype)
        if model.dtype != saved:
            model.to(saved)
        model.save_pretrained(dest, save_compressed=True)
        tokenizer.save_pretrained(dest)


def detach_from_files(model) -> None:
    """Every CPU parameter of a model loaded from safetensors copied out of the file it maps, one at a
    time. A loaded model's tensors are views of a private mapping of each file, which stays while any
    tensor of the file lives: a weight rescaled in place (AWQ, SmoothQuant, rotations) becomes an
    anonymous copy of its page inside that mapping, which stays when the quantizer replaces the weight
    (a 352 MiB model's AWQ: +590 MiB anonymous, +375 detached first). The pages of each weight copied
    are handed back as it goes (`drop_file_pages`): the mapping kept them beside the copies until its
    last weight was copied (the 1B rung's AWQ produce peaked at 4.64 GiB, 2.17 of it those pages)."""
    mapped = mapped_files(".safetensors")
    with torch.no_grad():
        for param in model.parameters():
            if param.device.type == "cpu":
                old = param.data
                param.data = old.clone()
                if old.is_contiguous():
                    drop_file_pages(old.data_ptr(), old.numel() * old.element_size(), mapped)


@contextmanager
def traced_namespaces_forgotten():
    """Drop, on the way out, what llm-compressor's sequential pipeline registered in torch.fx. To
    trace a model it execs each forward in a copy of its module's globals with `self` bound to the
    model, and calls torch.fx.wrap from there: torch.fx records each calling namespace in a
    module-level registry for good, and with it the model. Measured on a 1B model with AWQ: ~1.3 GiB
    still held through the reload check and the evaluation; on the default model every tensor of the
    quantized model stayed alive after the job let it go."""
    from torch.fx import _symbolic_trace

    registry = _symbolic_trace._wrapped_fns_to_patch
    before = set(registry)
    try:
        yield
    finally:
        for key in [k for k in registry if k not in before]:
            del registry[key]


def experts_card(inputs: Inputs, calibrates: bool) -> list[str]:
    """For a mixture of experts, how many calibration tokens each expert saw: every one of them
    (llm-compressor's `moe_calibrate_all_experts`, its default, routes every token through every
    expert while calibrating, so an expert the router seldom picks is not quantized from a handful)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(inputs.base.path)
    text = getattr(config, "text_config", config)
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or 0
    if experts <= 1 or not calibrates or not inputs.calibration:
        return []
    tokens = sum(len(row) for row in inputs.calibration)
    return [f"- Experts: all {experts} experts of every layer calibrated on all {tokens:,} calibration tokens"]


def carry_autoround_zero_points(model) -> int:
    """AutoRound's zero points into the checkpoint's. llm-compressor's AutoRoundModifier hands
    AutoRound's scales back as `weight_scale` but leaves its zero points behind (as `zp`, unsigned:
    0..2^b-1), so every asymmetric layer was saved with zero point 0: measured on the default
    model, a tuned mixed recipe with asymmetric groups at KLD 0.677; on tiny models 2-5x RTN's
    weight error (tests/quantize/test_mixed.py). compressed-tensors' zero points are signed (-2^(b-1)..):
    zp - 2^(b-1). Layers whose zero point is already set (a fixed llm-compressor) are left as they
    are. Returns how many layers were carried over."""
    carried = 0
    for name, module in model.named_modules():
        zp, args = getattr(module, "zp", None), getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if (
            not isinstance(zp, torch.Tensor)
            or args is None
            or args.symmetric
            or not hasattr(module, "weight_zero_point")
        ):
            continue
        target = module.weight_zero_point
        if torch.count_nonzero(target) == 0:
            if zp.numel() != target.numel():
                raise RuntimeError(
                    f"AutoRound's zero points of {name} ({tuple(zp.shape)}) do not fit the checkpoint's "
                    f"({tuple(target.shape)})"
                )
            signed = zp.detach().to(torch.float32).round() - 2 ** (args.num_bits - 1)
            target.data = signed.reshape(target.shape).to(device=target.device, dtype=target.dtype)
            carried += 1
        del module.zp
    return carried


def default_scheme(spec) -> schemes.Scheme:
    """The scheme of every layer a mixed recipe's `layers:` does not name."""
    return schemes.from_recipe(spec.scheme, spec.group_size, spec.symmetric)


def own_scheme(spec) -> schemes.Scheme:
    """The scheme a recipe of any llm-compressor method gives every layer it quantizes (a mixed
    recipe's: those its `layers:` does not name)."""
    if isinstance(spec, MIXED):
        return default_scheme(spec)
    if isinstance(spec, AWQSpec):
        return schemes.from_recipe(spec.scheme, spec.group_size, spec.symmetric)
    if isinstance(spec, FP8Spec):
        return spec.blocks() or schemes.SCHEMES["FP8"]
    return schemes.SCHEMES["W8A8"]  # SmoothQuant


def block_problem(loaded, config, scheme: schemes.Scheme) -> list[str]:
    """A block scheme's blocks must tile every weight it quantizes: rows and columns both."""
    assert scheme.block_shape is not None
    rows, columns = scheme.block_shape
    bad = [(name, i, o) for name, i, o in recipe_layers(config, loaded.recipe.quantize.ignore) if not scheme.fits(i, o)]
    if not bad:
        return []
    shapes = sorted({(o, i) for _, i, o in bad})
    detail = "; ".join(
        f"{o}x{i} ({sum(1 for b in bad if (b[2], b[1]) == (o, i))} layers, e.g. "
        f"{next(b[0] for b in bad if (b[2], b[1]) == (o, i))})"
        for o, i in shapes
    )
    widths = {w for _, i, o in recipe_layers(config, loaded.recipe.quantize.ignore) for w in (i, o)}
    sizes = [b for b in (128, 64, 32, 16) if all(w % b == 0 for w in widths)]
    hint = f" Block sizes that tile every layer: {', '.join(map(str, sizes))} (quantize.block_size)." if sizes else ""
    return [
        f"{loaded.path}: {loaded.where('quantize', 'block_size')}: blocks of {rows}x{columns} do not tile these "
        f"weights (rows x columns) of {loaded.recipe.model.source}: {detail}.{hint}"
    ]


def config_groups(spec) -> tuple[dict[str, QuantizationScheme], list[str]]:
    """llm-compressor's config_groups for a recipe with `layers:` (one group per scheme, the
    recipe's own last, on every other Linear layer), and its ignore list (with the BF16 layers)."""
    groups = {}
    ignore = list(spec.ignore)
    for name, targets in spec.layers.items():
        scheme = schemes.get(name)
        if scheme.quantized:
            groups[name] = scheme.quantization_scheme(list(targets))
        else:
            ignore += [t for t in targets if t not in ignore]
    groups["group_0"] = default_scheme(spec).quantization_scheme(["Linear"])
    return groups, ignore


def layer_problems(loaded, config) -> list[str]:
    """A mixed recipe on a model's shapes: every group size divides the input width of the layers
    that take it; every target of `layers:` names a layer; no layer is claimed by two schemes."""
    from compressed_tensors.utils.match import match_name

    spec = loaded.recipe.quantize
    shapes = linear_layers(config)
    names = list(shapes)
    default = default_scheme(spec)
    taken = schemes.assign(names, default.name, spec.layers, spec.ignore)
    problems = []
    source = loaded.recipe.model.source
    for scheme_name, targets in spec.layers.items():
        for target in targets:
            if not any(match_name(n, target) for n in names):
                close = difflib.get_close_matches(target, names, n=1, cutoff=0.6)
                hint = f" Did you mean '{close[0]}'?" if close else f" Layers are named like '{names[0]}'."
                problems.append(
                    f"{loaded.path}: {loaded.where('quantize', 'layers', scheme_name)}: '{target}' matches no "
                    f"quantizable Linear layer of {source}.{hint}"
                )
    for name, claimed in schemes.overlaps(names, spec.layers).items():
        problems.append(
            f"{loaded.path}: {loaded.where('quantize', 'layers')}: layer {name} is matched under "
            f"{' and '.join(claimed)}; give each layer one scheme"
        )
    by_scheme: dict[str, list[str]] = {}
    for name, scheme_name in taken.items():
        scheme = default if scheme_name == default.name else schemes.get(scheme_name)
        if not scheme.fits(shapes[name][0]):
            by_scheme.setdefault(scheme_name, []).append(name)
    for scheme_name, bad in by_scheme.items():
        scheme = default if scheme_name == default.name else schemes.get(scheme_name)
        field = ("quantize", "group_size") if scheme_name == default.name else ("quantize", "layers", scheme_name)
        widths = sorted({shapes[n][0] for n in bad})
        problems.append(
            f"{loaded.path}: {loaded.where(*field)}: {scheme_name} (group size {scheme.group_size}) does not "
            f"divide the input width of {len(bad)} layer(s) of {source} it applies to (widths "
            f"{', '.join(map(str, widths))}; e.g. {bad[0]})"
        )
    return problems


def weight_only_scheme(bits: int, group_size: int | None, symmetric: bool) -> QuantizationScheme:
    weights = QuantizationArgs(
        num_bits=bits,
        type="int",
        symmetric=symmetric,
        strategy="group" if group_size else "channel",
        group_size=group_size,
    )
    return QuantizationScheme(targets=["Linear"], weights=weights)


@contextmanager
def cpu_safe_pinning():
    """Let llm-compressor 0.14's AWQ run on a machine without an accelerator.

    Before each layer's scale search AWQ pins its cached activations
    (`IntermediatesCache.pin_memory`) so later host-to-GPU copies can be non-blocking. Pinning
    needs an accelerator and raises "Cannot access accelerator device when none is available"
    without one. On such a machine nothing is ever copied to a device, so pinning has no
    purpose: for the duration, and only then, it becomes a no-op. Nothing else changes.
    tests/quantize/test_llmcompressor.py fails if the library stops needing this or moves it.
    """
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield
        return
    original = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = _no_pinning  # type: ignore[method-assign]
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original  # type: ignore[method-assign]


def _no_pinning(self, batch_index: int, input_names: list[str] | None = None) -> None:
    return None
