"""Per-layer sensitivity: how far a model's next-token distribution moves when one layer alone is
quantized with a scheme, for every quantizable layer and every candidate scheme.

Layers are measured in *units*: the layers that read one input tensor in one block (q/k/v,
gate/up), which vLLM fuses into one matrix and serves only with one scheme, are one unit; every
other layer is a unit of its own. Units are found by watching which layers receive the same
input in a forward pass, so no architecture table is needed.

Two measures:
- `kld` (measured): the unit's weights are rounded to the nearest grid point of the scheme
  (compressed-tensors' own qparams and fake quantization; dynamic input activations fake-quantized
  per token as vLLM runs them), and the mean KL(base || perturbed) over held-back calibration
  windows is measured exactly. Only the blocks from the unit's on are recomputed (each block's
  input is cached); a check at the start proves the replay reproduces the model's own logits.
- `fisher` (proxy): one backward pass per window with labels sampled from the model itself gives
  the Fisher information of the output distribution; a unit's score is the second-order estimate
  of the same KLD: 1/2 * sum(F * (W - Q(W))^2) over its weights (diagonal Fisher), plus, for
  schemes that quantize activations (W8A8, FP8), 1/2 * sum over tokens of (g . e)^2, with g the
  gradient at the unit's input and e that token's rounding error. bench/sensitivity_proxy.py
  measures how well it ranks units against `kld`.

Text: windows of the calibration split that the recipe's own calibration windows do not touch
(held back), never the evaluation split; each starts with the model's BOS where its tokenizer adds
one, as the calibration windows do (data.windows). The result is stored once per (base fingerprint,
schemes, calibration text sha, settings) in an MLflow run tagged `quantbench.role=sensitivity`
with the table (`sensitivity/table.csv`, `sensitivity/sensitivity.json`) and a heat map
(`sensitivity/heatmap.png`), and reused like the evaluation baseline.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from quantbench.core import environment
from quantbench.core.errors import UserError
from quantbench.core.files import canonical_sha
from quantbench.core.logs import terminal
from quantbench.recipe import schemes
from quantbench.sources import data, models
from quantbench.tracking import TAG, Tracker

log = logging.getLogger(__name__)

VERSION = 1  # of the measurement code; part of the reuse key
ARTIFACT = "sensitivity/sensitivity.json"
Method = Literal["kld", "fisher"]


# the fewest held-back windows either measure can be taken on: the Fisher proxy sums one backward
# pass per window, the measured KLD averages over windows (and finds the units on the first)
MIN_WINDOWS = 1


@dataclass(frozen=True)
class Settings:
    method: Method = "fisher"
    windows: int = 4  # held-back calibration windows, at least MIN_WINDOWS
    seq_len: int = 256
    seed: int = 1
    # float32: in bfloat16 any perturbation of a weight re-rounds everything after it, a KLD floor
    # of ~0.0017 per unit on SmolLM2 that drowns the small ones (measured; W8A16's true KLD is 1e-5)
    dtype: str = "float32"
    # layers that read one input share a unit (vLLM fuses them and serves one scheme for them);
    # llama.cpp stores every tensor with its own type, so a GGUF tune measures each layer alone
    fuse: bool = True


@dataclass
class Unit:
    name: str  # the layer's name, or the block prefix + the fused layers' short names (self_attn.q+k+v_proj)
    layers: list[str]
    in_features: int
    out_features: list[int]
    block: int | None  # index of the decoder block it sits in

    @property
    def params(self) -> int:
        return sum(self.in_features * out for out in self.out_features)

    def bits(self, scheme: schemes.Scheme, dtype_bits: int = 16) -> float | None:
        """Total stored bits of the unit under `scheme`; None when the scheme does not fit."""
        if not scheme.fits(self.in_features):
            return None
        return sum(scheme.bits(self.in_features, out, dtype_bits) * self.in_features * out for out in self.out_features)

    @property
    def kind(self) -> str:
        """The unit's name without its block index (self_attn.q+k+v_proj), for the heat map."""
        return re.sub(r"^.*?\.\d+\.", "", self.name) if self.block is not None else self.name


@dataclass
class Sensitivity:
    run_id: str
    reused: bool
    settings: Settings
    schemes: list[str]
    units: list[Unit]
    kld: list[list[float | None]]  # [unit][scheme]: KLD (or proxy) with that unit alone quantized; None: does not fit
    wall_s: float
    key: str
    extra: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        return {
            "settings": asdict(self.settings),
            "schemes": self.schemes,
            "units": [asdict(u) for u in self.units],
            "kld": self.kld,
            "wall_s": self.wall_s,
            "key": self.key,
            "version": VERSION,
            **self.extra,
        }

    @classmethod
    def from_json(cls, doc: dict, run_id: str) -> Sensitivity:
        return cls(
            run_id,
            True,
            Settings(**doc["settings"]),
            doc["schemes"],
            [Unit(**u) for u in doc["units"]],
            doc["kld"],
            doc["wall_s"],
            doc["key"],
            {k: doc[k] for k in ("replay", "windows_tokens") if k in doc},
        )


def key(
    base_fingerprint: str,
    scheme_names: list[str],
    text_sha: str,
    settings: Settings,
    bos: int | None = None,
    rounding: str | None = None,
) -> str:
    doc = {
        "base": base_fingerprint,
        "schemes": {n: asdict(schemes.any_scheme(n)) for n in sorted(scheme_names)},
        "text": text_sha,
        # `fuse` only when off: results stored before it existed (fused) stay valid
        "settings": {k: v for k, v in asdict(settings).items() if k != "fuse" or not v},
        "version": VERSION,
    }
    if bos is not None:  # windows that start with BOS; absent as before, so results stored without one stay valid
        doc["bos"] = bos
    if rounding is not None:  # types rounded by an engine's quantizer: its build (absent otherwise, as before)
        doc["rounding"] = rounding
    return canonical_sha(doc)


# ---------------------------------------------------------------------------------------------
# The verb's stage: find the stored result or measure it


def get(
    tracker: Tracker, base, tokenizer, scheme_names: list[str], calibration, settings: Settings, rounding=None
) -> Sensitivity:
    """The sensitivity of `base` to `scheme_names`, reused from an earlier run when one matches.
    `calibration` is a recipe's calibration section (text source; its windows are held back);
    `rounding` (a `tune.gguf.EngineRounding`) rounds the types only an engine quantizes."""
    text = data.load_text(
        calibration.source, field="calibration.source", text_field=calibration.text_field, hub_split=calibration.split
    )
    text_sha = data.text_sha(text)
    bos = data.bos_id(tokenizer)
    by_engine = [n for n in scheme_names if getattr(schemes.any_scheme(n), "by_engine", False)]
    if by_engine and rounding is None:
        raise ValueError(f"sensitivity to {', '.join(by_engine)} needs an engine's rounding")
    engine = rounding is not None and any(rounding.rounds(schemes.any_scheme(n)) for n in scheme_names)
    k = key(base.fingerprint, scheme_names, text_sha, settings, bos, rounding.key if engine else None)
    found = tracker.find_runs({TAG + "role": "sensitivity", TAG + "sensitivity_key": k})
    if found:
        run = tracker.existing(found[0])
        with tempfile.TemporaryDirectory() as tmp:
            doc = json.loads(run.download(ARTIFACT, Path(tmp)).read_text())
        log.info(
            "sensitivity: reusing run %s (%d units x %d schemes, measured in %.0f s)",
            run.run_id,
            len(doc["units"]),
            len(doc["schemes"]),
            doc["wall_s"],
        )
        return Sensitivity.from_json(doc, run.run_id)
    windows = sensitivity_windows(tokenizer, text, calibration, settings)
    tags = {
        TAG + "role": "sensitivity",
        TAG + "sensitivity_key": k,
        TAG + "base_model": base.source,
        TAG + "base_fingerprint": base.fingerprint,
        TAG + "sensitivity_method": settings.method,
        TAG + "bos": data.bos_tag(tokenizer, bos),
        **{TAG + t: v for t, v in environment.describe().items()},
        "mlflow.note.content": f"Per-layer sensitivity of `{base.source}` to {', '.join(scheme_names)} "
        f"({settings.method}, {settings.windows} x {settings.seq_len} held-back calibration tokens).",
    }
    with tracker.start_run(f"sensitivity · {models.short_name(base.source)} · {settings.method}", tags) as run:
        run.log_params({"sensitivity": {**asdict(settings), "schemes": ",".join(scheme_names), "text_sha": text_sha}})
        started = time.perf_counter()
        result = measure(base.path, windows, scheme_names, settings, rounding)
        result.run_id, result.key, result.wall_s = run.run_id, k, time.perf_counter() - started
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            (out / "sensitivity.json").write_text(json.dumps(result.as_json(), indent=1))
            (out / "table.csv").write_text(table_csv(result))
            heatmap(result, out / "heatmap.png")
            run.log_artifacts(out, "sensitivity")
        run.log_metrics(
            {
                "sensitivity/wall_s": result.wall_s,
                "sensitivity/units": len(result.units),
                "sensitivity/evaluations": sum(v is not None for row in result.kld for v in row),
            }
        )
    log.info(
        "sensitivity: %d units x %d schemes in %.0f s (run %s)",
        len(result.units),
        len(scheme_names),
        result.wall_s,
        result.run_id,
    )
    return result


def sensitivity_windows(tokenizer, text: str, calibration, settings: Settings) -> list[list[int]]:
    """The windows sensitivity is measured on: held back from the recipe's calibration windows, and
    started as they are (with the tokenizer's BOS where it adds one)."""
    bos = data.bos_id(tokenizer)
    ids = data.text_ids(tokenizer, text)
    exclude = _recipe_windows(len(ids), calibration, bos)
    return held_back_windows(ids, settings.windows, settings.seq_len, settings.seed, exclude, bos)


def _recipe_windows(n_tokens: int, calibration, bos: int | None = None) -> list[tuple[int, int]]:
    """Text token ranges the recipe's calibration windows take (so sensitivity holds them back);
    the same choice as data.calibration_windows makes."""
    step = data.span(calibration.seq_len, bos)
    available = n_tokens // step
    if calibration.samples > available:
        return []

    starts = random.Random(calibration.seed).sample(range(available), calibration.samples)
    return [(i * step, (i + 1) * step) for i in starts]


def held_back_windows(
    ids: list[int], count: int, seq_len: int, seed: int, exclude: list[tuple[int, int]], bos: int | None = None
) -> list[list[int]]:
    """`count` windows of `seq_len` tokens whose text overlaps none of the `exclude` ranges, chosen by
    `seed`, each starting with `bos` when the tokenizer wants one (data.windows)."""

    step = data.span(seq_len, bos)
    free = [
        i
        for i in range(len(ids) // step)
        if not any(i * step < end and start < (i + 1) * step for start, end in exclude)
    ]
    if len(free) < count:
        raise UserError(
            f"sensitivity: the calibration text holds {len(free)} windows of {seq_len} tokens beside the "
            f"recipe's own calibration windows; asked for {count} (fewer windows, or a shorter seq_len)"
        )
    return data.windows(ids, seq_len, bos, sorted(random.Random(seed).sample(free, count)))


# ---------------------------------------------------------------------------------------------
# Measuring


def measure(
    model_path: Path, windows: list[list[int]], scheme_names: list[str], settings: Settings, rounding=None
) -> Sensitivity:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, settings.dtype)).eval()
    ids = torch.tensor(windows, dtype=torch.long)
    units = find_units(model, ids[:1, : min(32, ids.shape[1])], fuse=settings.fuse)
    scheme_list = [schemes.any_scheme(n) for n in scheme_names]
    modules = dict(model.named_modules())
    if settings.method == "fisher":
        table = _fisher(model, modules, ids, units, scheme_list, rounding)
        extra = {"replay": "n/a", "windows_tokens": int(ids.numel())}
    else:
        table, replay = _measured(model, modules, ids, units, scheme_list, rounding)
        extra = {"replay": replay, "windows_tokens": int(ids.numel())}
    return Sensitivity("", False, settings, [s.name for s in scheme_list], units, table, 0.0, "", extra)


@torch.inference_mode()
def find_units(model, ids: torch.Tensor, fuse: bool = True) -> list[Unit]:
    """The model's quantizable Linear layers (all but the output head) in forward order, grouped
    into units: layers of one block that receive the very same input tensor (with `fuse`; without,
    every layer is a unit of its own)."""
    head = model.get_output_embeddings()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
    seen: dict[str, tuple] = {}
    order: list[str] = []
    hooks = []
    for name, module in linears.items():

        def hook(mod, args, name=name):
            x = args[0]
            seen[name] = (x.data_ptr(), tuple(x.shape), x.stride())
            order.append(name)

        hooks.append(module.register_forward_pre_hook(hook))
    try:
        model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    units: list[Unit] = []
    by_input: dict[tuple, Unit] = {}
    for name in order:
        module = linears[name]
        parent = name.rsplit(".", 1)[0]
        key_ = (parent, seen[name]) if fuse else (name,)
        block = _block_index(name)
        if key_ in by_input:
            unit = by_input[key_]
            unit.layers.append(name)
            unit.out_features.append(module.out_features)
            continue
        unit = Unit(name, [name], module.in_features, [module.out_features], block)
        by_input[key_] = unit
        units.append(unit)
    for name in linears:  # a layer the forward never reached (unused): a unit of its own, last
        if name not in seen:
            units.append(
                Unit(name, [name], linears[name].in_features, [linears[name].out_features], _block_index(name))
            )
    for unit in units:
        if len(unit.layers) > 1:
            parent = unit.layers[0].rsplit(".", 1)[0]
            unit.name = f"{parent}.{'+'.join(n.rsplit('.', 1)[1] for n in unit.layers)}"
    return units


def _block_index(name: str) -> int | None:
    match = re.search(r"\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def fake_quantize_weight(weight: torch.Tensor, scheme: schemes.Scheme, layer: str = "", rounding=None) -> torch.Tensor:
    """Round-to-nearest with min-max scales, through compressed-tensors' qparams and QDQ; a llama.cpp
    type rounds as llama.cpp does (a type only llama-quantize quantizes, or any with an importance
    matrix: as `rounding` reads the layer's tensor back from its file)."""
    if rounding is not None and rounding.rounds(scheme):
        return rounding(layer, weight, scheme.name)
    if isinstance(scheme, schemes.GgufType):
        return scheme.fake_quantize(weight)
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**scheme.weights)
    w = weight.detach().float()
    if scheme.group_size:
        grouped = w.view(w.shape[0], -1, scheme.group_size)
        lo, hi = grouped.amin(-1), grouped.amax(-1)
    else:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale, zero = calculate_qparams(lo, hi, args)
    return fake_quantize(w, scale, zero, args).to(weight.dtype)


def fake_quantize_tokens(x: torch.Tensor, activations: dict) -> torch.Tensor:
    """Dynamic per-token quantization of a layer's input, as the serving kernels do it."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**activations)
    flat = x.float().reshape(-1, x.shape[-1])
    scale, zero = calculate_qparams(flat.amin(-1, keepdim=True), flat.amax(-1, keepdim=True), args)
    return fake_quantize(flat, scale, zero, args).reshape(x.shape).to(x.dtype)


class _Quantized:
    """Within the block, the unit's layers run with the scheme's weights (and activations)."""

    def __init__(self, modules: dict, unit: Unit, scheme: schemes.Scheme, rounding=None):
        self.modules, self.unit, self.scheme, self.rounding = modules, unit, scheme, rounding

    def __enter__(self):
        self.saved, self.hooks = {}, []
        for name in self.unit.layers:
            module = self.modules[name]
            self.saved[name] = module.weight.data
            module.weight.data = fake_quantize_weight(module.weight.data, self.scheme, name, self.rounding)
            if self.scheme.activations:
                acts = self.scheme.activations
                self.hooks.append(
                    module.register_forward_pre_hook(lambda m, args: (fake_quantize_tokens(args[0], acts), *args[1:]))
                )
        return self

    def __exit__(self, *exc):
        for name, weight in self.saved.items():
            self.modules[name].weight.data = weight
        for h in self.hooks:
            h.remove()


def _decoder_layers(model) -> torch.nn.ModuleList | None:
    inner = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(inner, "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) else None


class _Replay:
    """Logits of the model from block `b` on, given block b's cached input: the decoder's layer
    list is cut to layers[b:] and the cached hidden states go in as `inputs_embeds`. `check()`
    proves on the unperturbed model that this reproduces its own logits; where it does not (an
    architecture that scales its embeddings, say), every measurement runs the full forward."""

    def __init__(self, model, ids: torch.Tensor):
        self.model, self.ids = model, ids
        self.layers = _decoder_layers(model)
        self.inputs: list[torch.Tensor] = []
        self.ok = False
        if self.layers is None:
            return
        hooks = [layer.register_forward_pre_hook(self._keep, with_kwargs=True) for layer in self.layers]
        try:
            self.base_logits = model(input_ids=ids).logits.float()
        finally:
            for h in hooks:
                h.remove()

    def _keep(self, module, args, kwargs):
        self.inputs.append((args[0] if args else kwargs["hidden_states"]).detach())

    def logits(self, block: int | None) -> torch.Tensor:
        if not self.ok or block is None or block == 0:
            return self.model(input_ids=self.ids).logits.float()
        full = self.layers
        inner = _decoder_layers(self.model)
        owner = getattr(self.model, getattr(self.model, "base_model_prefix", "model"))
        owner.layers = torch.nn.ModuleList(list(full)[block:])
        try:
            return self.model(inputs_embeds=self.inputs[block]).logits.float()
        finally:
            owner.layers = inner

    def check(self) -> str:
        if self.layers is None or len(self.inputs) != len(self.layers):
            return "full forward (no decoder layer list found)"
        self.ok = True
        for block in sorted({1, len(self.layers) // 2, len(self.layers) - 1} - {0}):
            if not torch.allclose(self.logits(block), self.base_logits, atol=1e-3, rtol=1e-3):
                self.ok = False
                return f"full forward (replaying from block {block} did not reproduce the model's logits)"
        return "from the unit's block (checked against the model's own logits)"


@torch.inference_mode()
def _measured(model, modules, ids, units, scheme_list, rounding=None) -> tuple[list[list[float | None]], str]:

    replay = _Replay(model, ids)
    how = replay.check()
    log.info("sensitivity: replay %s", how)
    base = replay.base_logits if replay.layers is not None else model(input_ids=ids).logits.float()
    base_lp = torch.log_softmax(base, -1)
    neg_entropy = (base_lp.exp() * base_lp).sum(-1)
    base_p = base_lp.exp()
    del base, base_lp
    table: list[list[float | None]] = []
    work = sum(1 for u in units for s in scheme_list if s.quantized and s.fits(u.in_features))
    bar = tqdm(total=work, desc="sensitivity", unit="eval", leave=False, file=terminal())
    for unit in units:
        row: list[float | None] = []
        for scheme in scheme_list:
            if not scheme.fits(unit.in_features):
                row.append(None)
                continue
            if not scheme.quantized:
                row.append(0.0)
                continue
            with _Quantized(modules, unit, scheme, rounding):
                lp = torch.log_softmax(replay.logits(unit.block), -1)
            kld = (neg_entropy - (base_p * lp).sum(-1)).clamp(min=0)
            row.append(float(kld[:, :-1].mean()))
            bar.update(1)
        table.append(row)
    bar.close()
    return table, how


def _fisher(model, modules, ids, units, scheme_list, rounding=None) -> list[list[float | None]]:
    """The second-order estimate of each unit's KLD, from one backward pass per window with labels
    sampled from the model (seeded): for the weights, 1/2 sum(F * dW^2) with F the diagonal Fisher
    of the weights; for dynamically quantized input activations (W8A8, FP8), 1/2 sum_t (g_t . e_t)^2
    with g_t the gradient at the unit's input and e_t the rounding error of that token, an
    unbiased estimate of e^T F e for the input's full Fisher."""

    model.float()
    params = {name: modules[name].weight for unit in units for name in unit.layers}
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    fisher = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in params.items()}
    act_schemes = [s for s in scheme_list if s.activations]
    act_total = {(u.name, s.name): 0.0 for u in units for s in act_schemes}
    inputs: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    hooks = []
    if act_schemes:
        # the embeddings' output carries a gradient, so even the first block's inputs get one
        hooks.append(model.get_input_embeddings().register_forward_hook(lambda m, args, out: out.requires_grad_()))
        for unit in units:

            def keep(module, args, name=unit.name):
                x = args[0]
                inputs[name] = x.detach()
                if x.requires_grad:
                    x.register_hook(lambda g: grads.__setitem__(name, g.detach()))

            hooks.append(modules[unit.layers[0]].register_forward_pre_hook(keep))
    generator = torch.Generator().manual_seed(0)
    try:
        for row in tqdm(ids, desc="sensitivity (fisher)", unit="window", leave=False, file=terminal()):
            inputs.clear()
            grads.clear()
            logits = model(input_ids=row[None]).logits[0, :-1].float()
            with torch.no_grad():
                labels = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
            loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
            model.zero_grad(set_to_none=True)
            loss.backward()
            for name, p in params.items():
                fisher[name] += p.grad.float() ** 2
            with torch.no_grad():
                for unit in units:
                    if unit.name not in grads:
                        continue
                    x, g = inputs[unit.name].float(), grads[unit.name].float()
                    for scheme in act_schemes:
                        error = fake_quantize_tokens(x, scheme.activations).float() - x
                        act_total[(unit.name, scheme.name)] += float(((g * error).sum(-1) ** 2).sum())
    finally:
        for h in hooks:
            h.remove()
    for p in params.values():
        p.requires_grad_(False)
        p.grad = None
    tokens = ids.shape[0] * (ids.shape[1] - 1)
    table: list[list[float | None]] = []
    with torch.no_grad():
        for unit in units:
            row: list[float | None] = []
            for scheme in scheme_list:
                if not scheme.fits(unit.in_features):
                    row.append(None)
                elif not scheme.quantized:
                    row.append(0.0)
                else:
                    total = 0.0
                    for name in unit.layers:
                        w = params[name].detach()
                        total += float(
                            (
                                fisher[name]
                                * (w.float() - fake_quantize_weight(w, scheme, name, rounding).float()) ** 2
                            ).sum()
                        )
                    total += act_total.get((unit.name, scheme.name), 0.0)
                    row.append(0.5 * total / tokens)
            table.append(row)
    return table


# ---------------------------------------------------------------------------------------------
# The table and the heat map


def table_csv(result: Sensitivity) -> str:
    head = ["unit", "layers", "block", "in_features", "params"] + [f"kld[{s}]" for s in result.schemes]
    lines = [",".join(head)]
    for unit, row in zip(result.units, result.kld):
        cells = [
            unit.name,
            "+".join(n.rsplit(".", 1)[-1] for n in unit.layers),
            "" if unit.block is None else str(unit.block),
            str(unit.in_features),
            str(unit.params),
        ] + ["" if v is None else f"{v:.6g}" for v in row]
        lines.append(",".join(cells))
    return "\n".join(lines) + "\n"


def heatmap(result: Sensitivity, path: Path) -> Path:
    """One panel per quantized scheme: blocks (rows) x unit kinds (columns), log10 of the KLD."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    shown = [i for i, name in enumerate(result.schemes) if schemes.any_scheme(name).quantized]
    kinds = list(dict.fromkeys(u.kind for u in result.units))
    blocks = sorted({u.block for u in result.units if u.block is not None}) or [0]
    values = [v for row in result.kld for i, v in enumerate(row) if i in shown and v]
    lo, hi = (math.log10(min(values)), math.log10(max(values))) if values else (-6.0, 0.0)
    fig, axes = plt.subplots(
        1,
        max(len(shown), 1),
        figsize=(2.2 + 1.6 * len(shown) * max(len(kinds), 2) / 4, 1.5 + 0.18 * len(blocks)),
        squeeze=False,
    )
    image = None
    for ax, i in zip(axes[0], shown):
        grid = np.full((len(blocks), len(kinds)), np.nan)
        for unit, row in zip(result.units, result.kld):
            if unit.block is not None and row[i]:
                grid[blocks.index(unit.block), kinds.index(unit.kind)] = math.log10(row[i])
        image = ax.imshow(grid, aspect="auto", cmap="magma_r", vmin=lo, vmax=hi, interpolation="nearest")
        ax.set_title(result.schemes[i], fontsize=9)
        ax.set_xticks(
            range(len(kinds)),
            [k.replace("self_attn.", "attn.").replace("mlp.", "") for k in kinds],
            rotation=60,
            ha="right",
            fontsize=7,
        )
        ax.set_yticks(range(len(blocks)), [str(b) for b in blocks], fontsize=6)
        ax.set_ylabel("block", fontsize=8)
    if image is not None:
        fig.colorbar(image, ax=axes[0].tolist(), label=f"log10 {'KLD' if result.settings.method == 'kld' else 'proxy'}")
    fig.suptitle(f"sensitivity: one unit quantized at a time ({result.settings.method})", fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
