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
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from quantbench.core import environment
from quantbench.core.errors import UserError
from quantbench.core.files import canonical_sha
from quantbench.recipe import schemes
from quantbench.sources import data, models
from quantbench.tracking import TAG, Tracker
from quantbench.tune.measure import Unit, find_units, fisher_proxy, measured_kld

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
# Measuring (the units, the rounding and both measures are in measure.py)


def measure(
    model_path: Path, windows: list[list[int]], scheme_names: list[str], settings: Settings, rounding=None
) -> Sensitivity:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, settings.dtype)).eval()
    ids = torch.tensor(windows, dtype=torch.long)
    units = find_units(model, ids[:1, : min(32, ids.shape[1])], fuse=settings.fuse)
    scheme_list = [schemes.any_scheme(n) for n in scheme_names]
    modules = dict(model.named_modules())
    if settings.method == "fisher":
        table = fisher_proxy(model, modules, ids, units, scheme_list, rounding)
        extra = {"replay": "n/a", "windows_tokens": int(ids.numel())}
    else:
        table, replay = measured_kld(model, modules, ids, units, scheme_list, rounding)
        extra = {"replay": replay, "windows_tokens": int(ids.numel())}
    return Sensitivity("", False, settings, [s.name for s in scheme_list], units, table, 0.0, "", extra)


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
