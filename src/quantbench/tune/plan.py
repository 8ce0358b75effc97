"""What a tune is asked (`Request`) and what it will do (`Plan`): `prepare` makes every input check
(policy, schemes, template recipes, the model's shapes, the budget) and writes nothing."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from quantbench import engines
from quantbench.core.errors import UserError
from quantbench.core.files import canonical_sha
from quantbench.engines import ServingEngine, llamacpp
from quantbench.engines import llamacpp_build as build
from quantbench.quantize import make_quantizer
from quantbench.recipe import LoadedRecipe, load_recipe, resolve_recipe_path, schemes
from quantbench.recipe.methods import rotation_problems
from quantbench.release import gate
from quantbench.sources import models
from quantbench.sources.checkpoint import linear_layers, skeleton
from quantbench.tune import allocate, sensitivity
from quantbench.tune import gguf as gguf_tune

DEFAULT_TEMPLATE = "gptq-w4a16"


@dataclass
class Request:
    policy: str
    bits: float | None = None
    max_size_mb: float | None = None
    # None: the engine's defaults (schemes.DEFAULT_TUNE_SCHEMES, or DEFAULT_GGUF_TUNE_TYPES for llama.cpp)
    schemes: list[str] | None = None
    budget_runs: int = 6
    # None: the engine's (gptq-w4a16 for vLLM, gguf-q4_0 for llama.cpp); a gguf template makes it a llama.cpp tune
    template: str | None = None
    engine: str | None = None  # vllm | llamacpp; None: the template's
    # size: the smallest checkpoint that passes; latency: the fastest, by predicted decode time
    # (cost.py's table, measured through the engine); `latency_ms` makes one candidate under that budget
    objective: str = "size"
    latency_ms: float | None = None
    remeasure_costs: bool = False  # the latency cost table measured again, the cached one replaced
    # more templates (other methods: autoround-w4a16, spinquant-w4a16, ...): the answer's allocation is
    # also made with each, and the best measured one wins
    alternatives: list[str] = field(default_factory=list)
    sensitivity: sensitivity.Settings = field(default_factory=sensitivity.Settings)
    # where candidates are quantized: None here; a Ray address ("" for the cluster running here,
    # else a local Ray) runs each on a Ray node with the resources its recipe asks for
    ray: str | None = None
    # candidates at once (with `ray` only): each search round measures this many budgets inside the
    # interval, and the alternatives run together
    parallel: int = 1


@dataclass
class Plan:
    request: Request
    policy: gate.LoadedPolicy
    template: LoadedRecipe
    alternatives: list[LoadedRecipe]
    base: models.ResolvedModel
    tokenizer: object
    shapes: dict[str, tuple[int, int, bool]]  # every quantizable layer (all Linear layers but the output head)
    unquantized: set[str]  # layers the template ignores: they stay unquantized
    dtype_bits: int
    fixed_bytes: float
    tune_id: str
    directory: Path
    gguf_names: dict[str, str] | None = None  # a llama.cpp tune: HF layer -> GGUF tensor base name
    base_gguf: Path | None = None  # a llama.cpp tune: the base as an F16 GGUF
    engine: ServingEngine | None = None  # what serves the tune's format: a latency tune measures through it

    @property
    def gguf(self) -> bool:
        return self.gguf_names is not None


def prepare(request: Request, outputs: Path, experiment: str | None) -> Plan:
    from transformers import AutoConfig, AutoTokenizer

    _check_numbers(request)
    policy = gate.load_policy(request.policy)
    engine = _engine(request)
    if request.template is None:
        request.template = engine.tune_template if engine is not None else DEFAULT_TEMPLATE
    template, *alternatives = [_template(name) for name in [request.template, *request.alternatives]]
    spec = template.recipe.quantize
    gguf = spec.method == "gguf"
    fmt = make_quantizer(spec).format
    if engine is not None and fmt != engine.tune_format:
        raise UserError(
            f"--engine {request.engine}: --from {template.name} is a {spec.method} recipe; a {engine.label} tune "
            f"needs a {engine.tune_format} recipe (e.g. {engine.tune_template})"
        )
    engine = engine or next((e for e in engines.tunable() if e.tune_format == fmt), None)  # the format's
    names = _scheme_names(request, gguf)
    _check_float_formats(names, [template, *alternatives])
    _check_search_options(request)
    ignore = getattr(spec, "ignore", [])
    _check_alternatives(template, alternatives, ignore, gguf)
    base = models.resolve(template.recipe.model.source, experiment=experiment)
    config = AutoConfig.from_pretrained(base.path)
    shapes = linear_layers(config)
    unquantized = _unquantized(shapes, ignore, names, base.source)
    # the templates' own group sizes do not matter (each candidate gets its schemes); what the
    # method needs of the model's shapes does (SpinQuant's rotation sizes)
    problems = [p for t in (template, *alternatives) for p in rotation_problems(t, config)]
    if problems:
        raise UserError(problems)
    dtype_bits = 32 if template.recipe.model.dtype == "float32" else 16
    gguf_names = base_file = None
    if gguf:
        gguf_names = gguf_tune.tensor_names(config, list(shapes))
        # llama.cpp stores each tensor with its own type: measure layers alone, not fused units
        request.sensitivity = replace(request.sensitivity, fuse=False)
        base_file = llamacpp.base_gguf(base.path, build.ensure("a llama.cpp tune"))
        fixed_bytes = gguf_tune.fixed_bytes(base_file, set(gguf_names.values()))
    else:
        fixed_bytes = _fixed_bytes(base.path, shapes, dtype_bits)
    _check_budget(request, names, shapes, unquantized, dtype_bits, fixed_bytes)
    tokenizer = AutoTokenizer.from_pretrained(base.path)
    tune_id = _tune_id(request, policy, template, alternatives, names, base)
    return Plan(
        request,
        policy,
        template,
        alternatives,
        base,
        tokenizer,
        shapes,
        unquantized,
        dtype_bits,
        fixed_bytes,
        tune_id,
        outputs / "tune" / f"{policy.name}-{tune_id}",
        gguf_names,
        base_file,
        engine,
    )


def _engine(request: Request):
    """The engine --engine names (one a tune chooses types for), or None for the template's."""
    tunable = {e.name: e for e in engines.tunable()}
    if request.engine is not None and request.engine not in tunable:
        raise UserError(f"--engine: '{request.engine}'; a tune chooses types for {' or '.join(tunable)}")
    return tunable[request.engine] if request.engine is not None else None


def _scheme_names(request: Request, gguf: bool) -> list[str]:
    """--schemes checked and written as the schemes' own names (the engine's defaults when not given)."""
    if request.schemes is None:
        request.schemes = list(schemes.DEFAULT_GGUF_TUNE_TYPES if gguf else schemes.DEFAULT_TUNE_SCHEMES)
    if not request.schemes:
        raise UserError("--schemes: give at least one scheme")
    names = [schemes.tune_scheme(n, "--schemes", gguf=gguf).name for n in request.schemes]
    if len(set(names)) != len(names):
        raise UserError(f"--schemes: {', '.join(request.schemes)} names a scheme twice")
    request.schemes = names
    return names


def _check_float_formats(names: list[str], templates: list[LoadedRecipe]) -> None:
    """The 4-bit float formats a tune may choose are written by GPTQ and round-to-nearest only."""
    floats = [n for n in names if n in schemes.TUNE_FLOAT_FORMATS]
    for template in templates if floats else []:
        if template.recipe.quantize.method not in ("gptq", "rtn"):
            raise UserError(
                f"--schemes: {', '.join(floats)}: a tune's candidates are made by their template's method, and "
                f"--from {template.name} is {template.recipe.quantize.method}; the float formats are made by gptq "
                "or rtn (e.g. --from gptq-w4a16)"
            )


def _check_search_options(request: Request) -> None:
    """One budget, the objective it implies, and how many candidates run and how many at once."""
    budgets = [b for b, v in (("--bits", request.bits), ("--max-size-mb", request.max_size_mb),
                              ("--latency-ms", request.latency_ms)) if v is not None]  # fmt: skip
    if len(budgets) > 1:
        raise UserError(f"give one budget: {' or '.join(budgets)}")
    if request.latency_ms is not None:
        request.objective = "latency"
    if request.objective not in ("size", "latency"):
        raise UserError(f"--objective: '{request.objective}'; size or latency")
    if request.remeasure_costs and request.objective != "latency":
        raise UserError(
            "--remeasure-costs: only a latency tune reads the cost table (--objective latency or --latency-ms)"
        )
    if request.objective == "latency" and (request.bits is not None or request.max_size_mb is not None):
        raise UserError(f"--objective latency searches on decode time; {budgets[0]} is a size budget")
    if request.budget_runs < 1:
        raise UserError(f"--budget-runs: {request.budget_runs}; at least 1 candidate")
    if request.parallel < 1:
        raise UserError(f"--parallel: {request.parallel}; at least 1 candidate at a time")
    if request.parallel > 1 and request.ray is None:
        raise UserError(
            f"--parallel {request.parallel} needs --ray: every candidate measures its speed, and "
            f"{request.parallel} of them on this machine would measure each other; on a Ray cluster each runs "
            "on a node with the resources its recipe asks for"
        )


def _check_alternatives(template: LoadedRecipe, alternatives: list[LoadedRecipe], ignore, gguf: bool) -> None:
    """Every other --from recipe is for the same model, dtype, ignore list and engine as the first."""
    for other in alternatives:
        if (
            other.recipe.model.source != template.recipe.model.source
            or other.recipe.model.dtype != template.recipe.model.dtype
            or getattr(other.recipe.quantize, "ignore", []) != ignore
            or (other.recipe.quantize.method == "gguf") != gguf
        ):
            raise UserError(
                f"--from {other.name}: every template must name the same model, dtype and ignore list as "
                f"{template.name}, and be a gguf recipe if it is one (the allocation is made for one model "
                "and one engine's types)"
            )


def _unquantized(shapes: dict, ignore, names: list[str], source: str) -> set[str]:
    """The layers the template's ignore list leaves unquantized; every other layer must fit one of
    the schemes."""
    taken = schemes.assign(list(shapes), "quantized", {}, ignore)
    unquantized = {n for n in shapes if taken[n] == "BF16"}  # the template's ignore list stays ignored
    stuck = {
        n: s
        for n, s in shapes.items()
        if n not in unquantized and not any(schemes.any_scheme(x).fits(s[0]) for x in names)
    }
    allocate.check_fits({n: s[0] for n, s in stuck.items()}, names, source)
    return unquantized


def _tune_id(request: Request, policy, template: LoadedRecipe, alternatives, names: list[str], base) -> str:
    """The tune's id: the sha of everything that decides what it does (a re-run with the same finds its outputs)."""
    key = {
        "policy": policy.sha,
        "template": template.sha,
        "schemes": sorted(names),
        **({"alternatives": [t.sha for t in alternatives]} if alternatives else {}),
        "bits": request.bits,
        "max_size_mb": request.max_size_mb,
        "budget_runs": request.budget_runs,
        **({"parallel": request.parallel} if request.parallel > 1 else {}),  # rounds of N choose other budgets
        **({"objective": request.objective, "latency_ms": request.latency_ms} if request.objective != "size" else {}),
        "base": base.fingerprint,
        "sensitivity": {k: v for k, v in asdict(request.sensitivity).items() if k != "fuse" or not v},
    }
    return canonical_sha(key)[:12]


def _template(name: str) -> LoadedRecipe:
    loaded = load_recipe(resolve_recipe_path(name))
    spec = loaded.recipe.quantize
    if not make_quantizer(spec).mixes_per_layer:  # the quantizer says (its module is imported now)
        raise UserError(
            f"--from {name}: method {spec.method} cannot take per-layer schemes; a tune needs a "
            "recipe whose quantizer takes a scheme per layer (e.g. gptq-w4a16, a method: rtn recipe in "
            "compressed-tensors, or gguf-q4_0 for llama.cpp)"
        )
    return loaded


def _fixed_bytes(path: Path, shapes: dict, dtype_bits: int) -> float:
    """Bytes of everything a tune does not quantize (embeddings, norms, an untied head), stored
    in the recipe's dtype: the base model's parameters minus the quantizable layers'."""
    from transformers import AutoConfig

    seen = {name: p.numel() for name, p in skeleton(AutoConfig.from_pretrained(path)).named_parameters()}
    quantizable = sum(i * o + (o if b else 0) for i, o, b in shapes.values())
    return (sum(seen.values()) - quantizable) * dtype_bits / 8


def _check_numbers(request: Request) -> None:
    """The numbers given on the command line, all at once, before anything is loaded or a run opens:
    argparse takes nan, inf and negative floats, which a search would only meet deep inside."""
    problems = []
    for flag, value in (
        ("--bits", request.bits),
        ("--max-size-mb", request.max_size_mb),
        ("--latency-ms", request.latency_ms),
    ):
        if value is not None and not (math.isfinite(value) and value > 0):
            problems.append(f"{flag} {value:g}: not a finite number above 0")
    if request.sensitivity.windows < sensitivity.MIN_WINDOWS:
        problems.append(
            f"--sensitivity-windows: {request.sensitivity.windows}; the sensitivity is measured on at least "
            f"{sensitivity.MIN_WINDOWS} held-back window"
        )
    if problems:
        raise UserError(problems)


def _check_budget(
    request: Request, names: list[str], shapes: dict, unquantized: set[str], dtype_bits: int, fixed_bytes: float
) -> None:
    def stored(pick) -> float:  # the stored bits of every layer under the cheapest (or costliest) scheme that fits it
        return sum(
            pick(
                schemes.any_scheme(x).bits(i, o, dtype_bits, b) * i * o
                for x in (["BF16"] if n in unquantized else names)
                if schemes.any_scheme(x).fits(i)
            )
            for n, (i, o, b) in shapes.items()
        )

    cheapest = stored(min)
    if request.bits is not None:
        allocate.check_bits(request.bits, cheapest, sum(i * o for i, o, _ in shapes.values()), names, stored(max))
    if request.max_size_mb is not None:
        allocate.check_size(request.max_size_mb, cheapest, fixed_bytes, names)
