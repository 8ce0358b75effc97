"""A tune's candidates: an allocation written as a recipe file (`write_recipe`: everything a
candidate is, which `make quantize RECIPE=<path>` re-runs) and what measuring it found (`Candidate`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from quantbench.core.files import atomic_write
from quantbench.recipe import LoadedRecipe, load_recipe, schemes
from quantbench.recipe.methods import GGUF_TYPES
from quantbench.tune import allocate, sensitivity
from quantbench.tune import gguf as gguf_tune
from quantbench.tune.patterns import targets
from quantbench.tune.plan import Plan


@dataclass
class Candidate:
    name: str
    recipe: str  # path of the recipe file
    sha: str
    budget_bits: float
    predicted_kld: float
    predicted_size_mb: float
    bits_per_weight: float  # predicted
    counts: dict[str, int]
    predicted_ms: float | None = None  # predicted decode ms/token (a latency tune)
    run_id: str | None = None
    status: str = "pending"  # pending | finished | reused | failed
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    checks: list[dict] = field(default_factory=list)
    passed: bool = False  # the whole policy
    quality_passed: bool = False  # every check more bits can fix
    wall_s: float = 0.0

    def failed_checks(self) -> list[dict]:
        return [c for c in self.checks if not c["passed"]]


def write_recipe(
    plan: Plan,
    alloc: allocate.Allocation,
    units: list[sensitivity.Unit],
    parent: str,
    template: LoadedRecipe | None = None,
) -> tuple[Path, str, str]:
    """The allocation as a recipe file in the tune's directory: the template (by default the
    tune's first) with `layers:` (the most common scheme the method can take as its own becomes the
    recipe's `scheme`); returns (path, name, sha)."""
    template = template or plan.template
    doc = template.recipe.model_dump(mode="json", exclude_unset=False)
    q = doc["quantize"]
    by_unit = {u.name: u for u in units}
    layers_of: dict[str, list[str]] = {}
    for unit_name, scheme_name in alloc.choice.items():
        layers_of.setdefault(scheme_name, []).extend(by_unit[unit_name].layers)
    if plan.gguf_names is not None:
        # the most common quantized type is the recipe's own (llama-quantize ignores per-tensor types
        # when the file type is F16); every tensor is named with its type, that type's too (for its
        # own file type llama-quantize may bump a tensor: with an importance matrix, measured, 3 of
        # the default model's Q5_0 tensors became Q5_1), the embeddings pinned: the file is the allocation
        # (a file type: Q4_K and Q5_K are tensor types only, llama.cpp's file types being Q4_K_S/M ...)
        quantized = sorted(s for s in layers_of if s != "F16" and s in GGUF_TYPES) or [gguf_tune.EMBEDDINGS]
        q["type"] = max(quantized, key=lambda s: len(layers_of.get(s, [])))
        q["layers"] = {
            s: gguf_tune.patterns([plan.gguf_names[n] for n in layers]) for s, layers in sorted(layers_of.items())
        }
        q["layers"].setdefault(gguf_tune.EMBEDDINGS, []).extend(gguf_tune.PINNED)
    else:
        own = _own_scheme(q["method"], layers_of)
        if own is not None:
            q["scheme"], q["group_size"], q["symmetric"] = own
        default = schemes.from_recipe(q["scheme"], q["group_size"], q["symmetric"]).name
        q["layers"] = {s: targets(layers) for s, layers in sorted(layers_of.items()) if s != default}
    needed = plan.policy.policy.stages
    if "evaluate" in needed and doc.get("evaluate") is None:
        doc["evaluate"] = {"suite": "default"}
    if "bench" in needed and doc.get("bench") is None:
        # auto, the choice a recipe's own bench section makes: vLLM where it serves the candidate
        # here (its environment created on first use), else transformers serve, else in-process hf
        doc["bench"] = {"profile": "cpu-smoke", "engine": "auto"}
    counts = ", ".join(f"{n} x {s}" for s, n in sorted(alloc.counts().items(), key=lambda x: -x[1]))
    name = f"{template.name}-mixed-{alloc.bits_per_weight:.3f}b"
    doc["description"] = (
        f"{template.name} with per-layer schemes by `quantbench tune --policy {plan.policy.name}`: "
        f"{alloc.bits_per_weight:.3f} bits per weight ({counts} units)"
    )
    path = plan.directory / "recipes" / f"{name}.yaml"
    header = (
        f"# Run: make quantize RECIPE={path}\n"
        f"# Made by `quantbench tune --policy {plan.policy.name}` (tune {plan.tune_id}, MLflow parent run {parent})\n"
        f"# from recipe {template.path}: predicted KLD {alloc.predicted_kld:.4g} (sum of the units' sensitivities "
        f"on calibration text),\n# predicted size {alloc.size_mb:.1f} MiB, {alloc.bits_per_weight:.3f} bits per "
        f"quantizable weight. Units: {counts}.\n"
        + (
            f"# Predicted decode time: {alloc.predicted_ms:.2f} ms/token (the latency cost table measured here).\n"
            if alloc.predicted_ms is not None
            else ""
        )
    )
    text = header + yaml.safe_dump(doc, sort_keys=False, width=200)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text)
    loaded = load_recipe(path)
    return path, name, loaded.sha


def _own_scheme(method: str, layers_of: dict[str, list[str]]) -> tuple[str, int | None, bool] | None:
    """The most common chosen scheme a recipe of `method` can name as its own (scheme, group_size,
    symmetric)."""
    own = {
        "W4A16-G64": ("W4A16", 64, True),
        "W4A16-G32": ("W4A16", 32, True),
        "W4A16-G64-ASYM": ("W4A16", 64, False),
        "W4A16-G32-ASYM": ("W4A16", 32, False),
        "W8A16": ("W8A16", None, True),
    }
    if method == "rtn":
        own["W8A8"] = ("W8A8", None, True)
    ranked = sorted(layers_of, key=lambda s: -len(layers_of[s]))
    return next((own[s] for s in ranked if s in own), None)
