"""`quantbench tune --policy NAME`: the smallest checkpoint that passes a policy, by per-layer
mixed precision.

    prepare (policy, schemes, template recipe, model shapes, budget: nothing written)
    -> sensitivity (sensitivity.py: stored once per base model, schemes and calibration text)
    -> allocate a scheme per unit under a budget (allocate.py: least predicted KLD)
    -> write the allocation as a real recipe file, run it as a `quantbench quantize` child process
       (quantize, reload check, evaluate, bench, like any other run) under a `quantbench.role=tune`
       parent run
    -> search the budget: bisection on the *measured* verdict of the policy's quality checks
    -> gate the answer with the policy (a pass moves the alias, as `quantbench gate` does)

With `--bits` or `--max-size-mb` the budget is given and one candidate is made. Without, the
search starts where the predicted KLD meets the policy's KLD limit (scaled by what the last
candidate measured against its prediction) and keeps the interval between the largest failing
and the smallest passing candidate, cutting it at least a tenth each time, until `--budget-runs`
candidates were measured or the interval holds no other allocation.

Everything a candidate is lives in its recipe file (outputs/tune/<policy>-<tune id>/recipes/),
which `make quantize RECIPE=<path>` re-runs. Re-running the same tune replays the same decisions
and reuses every candidate that already has a FINISHED run (found by recipe sha).
"""

from __future__ import annotations

import json
import tempfile
import logging
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from quantbench.core import tables
from quantbench.core.errors import UserError
from quantbench.core.files import atomic_write, canonical_sha
from quantbench.core.intervals import pareto
from quantbench.recipe import (
    LoadedRecipe,
    load_recipe,
    recipes_dir,
    resolve_recipe_path,
    schemes,
)
from quantbench.recipe.methods import GGUF_TYPES
from quantbench.release import gate
from quantbench.sources import models
from quantbench.sources.checkpoint import linear_layers, skeleton
from quantbench.tracking import TAG, Tracker
from quantbench.tune import allocate, cost, sensitivity
from quantbench.tune.patterns import targets

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = "gptq-w4a16"
DEFAULT_GGUF_TEMPLATE = "gguf-q4_0"
MIXED_METHODS = ("gptq", "rtn", "autoround", "spinquant", "gguf")
TOLERANCE_BITS = 0.05  # the search stops when passing and failing candidates are this close (bits per weight)
TOLERANCE_MS = 0.01  # ... or, searching on predicted decode time, this close as a share of it
CANDIDATE_TIMEOUT_S = 6 * 3600  # one candidate's quantize + evaluate + bench, at most
# Checks more bits cannot fix: the search bisects on the others (quality), the answer reports all.
NOT_QUALITY = ("run status", "licence", "checkpoint on disk")


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


# ---------------------------------------------------------------------------------------------
# prepare: every input check, nothing written


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

    @property
    def gguf(self) -> bool:
        return self.gguf_names is not None


def prepare(request: Request, outputs: Path, experiment: str | None) -> Plan:
    from transformers import AutoConfig, AutoTokenizer

    _check_numbers(request)
    policy = gate.load_policy(request.policy)
    if request.engine not in (None, "vllm", "llamacpp"):
        raise UserError(f"--engine: '{request.engine}'; a tune chooses types for vllm or llamacpp")
    if request.template is None:
        request.template = DEFAULT_GGUF_TEMPLATE if request.engine == "llamacpp" else DEFAULT_TEMPLATE
    template, *alternatives = [_template(name) for name in [request.template, *request.alternatives]]
    spec = template.recipe.quantize
    gguf = spec.method == "gguf"
    if request.engine is not None and gguf != (request.engine == "llamacpp"):
        raise UserError(
            f"--engine {request.engine}: --from {template.name} is a {spec.method} recipe; "
            + (
                "llama.cpp types need a method: gguf recipe (e.g. gguf-q4_0)"
                if not gguf
                else "a vLLM tune needs a compressed-tensors recipe (e.g. gptq-w4a16)"
            )
        )
    if request.schemes is None:
        request.schemes = list(schemes.DEFAULT_GGUF_TUNE_TYPES if gguf else schemes.DEFAULT_TUNE_SCHEMES)
    if not request.schemes:
        raise UserError("--schemes: give at least one scheme")
    names = [schemes.tune_scheme(n, "--schemes", gguf=gguf).name for n in request.schemes]
    if len(set(names)) != len(names):
        raise UserError(f"--schemes: {', '.join(request.schemes)} names a scheme twice")
    request.schemes = names
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
    ignore = getattr(spec, "ignore", [])
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
    base = models.resolve(template.recipe.model.source, experiment=experiment)
    config = AutoConfig.from_pretrained(base.path)
    shapes = linear_layers(config)
    taken = schemes.assign(list(shapes), "quantized", {}, ignore)
    unquantized = {n for n in shapes if taken[n] == "BF16"}  # the template's ignore list stays ignored
    stuck = {
        n: s
        for n, s in shapes.items()
        if n not in unquantized and not any(schemes.any_scheme(x).fits(s[0]) for x in names)
    }
    allocate.check_fits({n: s[0] for n, s in stuck.items()}, names, base.source)
    # the templates' own group sizes do not matter (each candidate gets its schemes); what the
    # method needs of the model's shapes does (SpinQuant's rotation sizes)
    from quantbench.quantize.llmcompressor import rotation_problems

    problems = [p for t in (template, *alternatives) for p in rotation_problems(t, config)]
    if problems:
        raise UserError(problems)
    dtype_bits = 32 if template.recipe.model.dtype == "float32" else 16
    gguf_names = base_file = None
    if gguf:
        from quantbench.engines import llamacpp
        from quantbench.engines import llamacpp_build as build
        from quantbench.tune import gguf as gguf_tune

        gguf_names = gguf_tune.tensor_names(config, list(shapes))
        # llama.cpp stores each tensor with its own type: measure layers alone, not fused units
        request.sensitivity = replace(request.sensitivity, fuse=False)
        base_file = llamacpp.base_gguf(base.path, build.ensure("a llama.cpp tune"))
        fixed_bytes = gguf_tune.fixed_bytes(base_file, set(gguf_names.values()))
    else:
        fixed_bytes = _fixed_bytes(base.path, shapes, dtype_bits)
    _check_budget(request, names, shapes, unquantized, dtype_bits, fixed_bytes)
    tokenizer = AutoTokenizer.from_pretrained(base.path)
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
    tune_id = canonical_sha(key)[:12]
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
    )


def _template(name: str) -> LoadedRecipe:
    loaded = load_recipe(resolve_recipe_path(name))
    spec = loaded.recipe.quantize
    if spec.method not in MIXED_METHODS or getattr(spec, "format", "compressed-tensors") != "compressed-tensors":
        raise UserError(
            f"--from {name}: method {spec.method} cannot take per-layer schemes; a tune needs a "
            f"recipe of method {', '.join(MIXED_METHODS)} (compressed-tensors, or gguf for llama.cpp)"
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


# ---------------------------------------------------------------------------------------------
# Candidates: an allocation written as a recipe file


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
        from quantbench.tune import gguf as gguf_tune

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
        doc["bench"] = {"profile": "cpu-smoke", "backend": "auto"}
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


# ---------------------------------------------------------------------------------------------
# Running quantize jobs (one call site: an executor that runs them elsewhere slots in here)


@dataclass
class QuantizeJob:
    name: str
    recipe: Path
    log: Path
    tags: dict[str, str]


@dataclass
class JobOutcome:
    job: QuantizeJob
    exit_code: int | None
    result: dict | None  # the child's --json summary
    wall_s: float
    reason: str = ""


def run_quantize_jobs(
    jobs: list[QuantizeJob], *, executor, tracker: Tracker, outputs: Path, parent: str | None, concurrency: int = 1
) -> list[JobOutcome]:
    """Run `quantbench quantize RECIPE --json` for each job through the sweep's attempt loop
    (`executor.Runner`), up to `concurrency` at once: here as a child process, or on a Ray node
    (`executor`), each child's run carrying `job.tags` and the parent run id, its output into
    `job.log`'s directory. One attempt each (a candidate that fails is a measured outcome, not
    retried). Ctrl-C or SIGTERM stops every attempt in flight (its run ends KILLED) and propagates."""
    from quantbench.jobs.executor import Job, Limits, Runner

    if not jobs:
        return []
    tasks = []
    for job in jobs:
        job.log.parent.mkdir(parents=True, exist_ok=True)
        tasks.append(
            Job(job.name, str(job.recipe), [], job.name, tags=job.tags, resources=load_recipe(job.recipe).resources())
        )
    runner = Runner(
        executor,
        Limits(timeout_s=CANDIDATE_TIMEOUT_S, retries=0, backoff_s=0, concurrency=concurrency),
        tracker=tracker,
        experiment=tracker.experiment,
        outputs=outputs,
        logs=jobs[0].log.parent,
        parent=parent,
        label="tune",
    )
    runner.run(tasks)
    outcomes = []
    for job, task in zip(jobs, tasks):
        attempt = task.attempts[-1]
        Path(attempt["log"]).replace(job.log)  # the candidate's log where the tune's state names it
        result = {"run_id": task.run_id, "metrics": task.metrics} if task.status == "finished" else None
        outcomes.append(JobOutcome(job, attempt.get("exit"), result, task.wall_s, task.reason))
    return outcomes


# ---------------------------------------------------------------------------------------------
# The search


def problem(plan: Plan, sens: sensitivity.Sensitivity, costs: cost.CostTable | None = None) -> allocate.Problem:
    """The allocation problem of a tune: over bits, or with `costs` (a latency tune) over predicted
    decode ms/token."""
    p = allocate.problem(sens, plan.request.schemes or [], plan.dtype_bits, plan.fixed_bytes, plan.unquantized)
    if costs is not None:
        p.base_ms = costs.ms[costs.reference]
        p.unit_ms = [
            {name: unit.params * costs.per_weight(name) for name, _, _ in opts}
            for unit, opts in zip(sens.units, p.options)
        ]
    return p


class Search:
    def __init__(
        self,
        plan: Plan,
        tracker: Tracker,
        sens: sensitivity.Sensitivity,
        parent,
        experiment: str,
        outputs: Path,
        state: dict,
        executor,
        costs: cost.CostTable | None = None,
    ):
        self.plan, self.tracker, self.sens, self.parent, self.executor = plan, tracker, sens, parent, executor
        self.experiment, self.outputs, self.state = experiment, outputs, state
        self.problem = problem(plan, sens, costs)
        self.candidates: list[Candidate] = []
        self.allocations: dict[str, allocate.Allocation] = {}  # recipe sha -> allocation

    def _spent(self, alloc: allocate.Allocation) -> float:
        """What an allocation spends of the searched budget: bits, or predicted decode ms."""
        return alloc.predicted_ms if alloc.predicted_ms is not None else alloc.bits

    def _close(self, lo: float, hi: float, share: float = 1.0) -> bool:
        """Whether a budget interval is too narrow to cut again (`share` of the tolerance)."""
        if self.problem.by_ms:
            return hi - lo < share * TOLERANCE_MS * hi
        return (hi - lo) / self.problem.total_params < share * TOLERANCE_BITS

    def _describe(self, budget: float) -> str:
        if self.problem.by_ms:
            return f"{budget:.2f} ms/token"
        return f"{budget / self.problem.total_params:.3f} bits/weight"

    def budgets(self) -> None:
        request = self.plan.request
        if request.latency_ms is not None:
            self.measure(allocate.solve(self.problem, request.latency_ms), request.latency_ms)
            return
        if request.bits is not None:
            self.measure(allocate.for_bits(self.problem, request.bits), request.bits * self.problem.total_params)
            return
        if request.max_size_mb is not None:
            self.measure(
                allocate.for_size(self.problem, request.max_size_mb), self.problem.bits_for_size(request.max_size_mb)
            )
            return
        cheapest, best = self.problem.bounds()
        lo, hi = cheapest, best  # bits (or ms): lo fails (assumed until measured), hi passes (assumed)
        lo_measured = hi_measured = False
        # the policy's KLD limit: a number, or a bound on one end of the interval (`{value, on}`)
        bound = self.plan.policy.policy.max.get("quality/kld_mean")
        limit = bound.value if isinstance(bound, gate.Bound) else bound
        used = 0
        while used < request.budget_runs:
            # a round: the model's pick, and with --parallel N, N - 1 more around it
            targets = self._targets(
                min(request.parallel, request.budget_runs - used), limit, lo, hi, lo_measured, hi_measured
            )
            wanted: list[tuple[allocate.Allocation, float]] = []
            for target in targets:
                alloc = allocate.solve(self.problem, target)
                if any(_same(alloc, c) for c in self.candidates) or any(
                    f"{alloc.bits_per_weight:.3f}" == f"{a.bits_per_weight:.3f}" for a, _ in wanted
                ):
                    continue  # measured already, or a batch-mate (and its recipe name) at the same bits
                wanted.append((alloc, target))
            if not wanted:
                log.info(
                    "tune: the allocation%s at %s %s measured already; the search has converged",
                    "s" if len(targets) > 1 else "",
                    ", ".join(self._describe(t) for t in targets),
                    "were" if len(targets) > 1 else "was",
                )
                break
            measured = self.measure_many([(alloc, target, None) for alloc, target in wanted])
            used += len(measured)
            if any(c.status == "failed" for c in measured):
                break
            spent = [(self._spent(alloc), cand) for (alloc, _), cand in zip(wanted, measured)]
            passing = [x for x, c in spent if c.quality_passed]
            if passing:
                hi, hi_measured = min(passing), True
            failing = [x for x, c in spent if not c.quality_passed and x < hi]
            if failing and max(failing) > lo:
                lo, lo_measured = max(failing), True
            if not passing and max(x for x, _ in spent) >= best - 1e-6:
                log.info(
                    "tune: even the allocation with the least predicted KLD fails the policy's quality checks; "
                    "more bits cannot help with these schemes"
                )
                break
            if hi_measured and self._close(lo, hi):
                break

    def _targets(self, k: int, limit, lo, hi, lo_measured, hi_measured) -> list[float]:
        """The next round's budgets inside (lo, hi): the model's pick (`_target`) and, for k > 1,
        k - 1 more around it, below and above in turn, (hi - lo) / 2k apart (the pick's error is
        unknown until measured), kept inside the interval."""
        pick = self._target(limit, lo, hi, lo_measured, hi_measured)
        step = (hi - lo) / (2 * k)
        points = [pick]
        for j in range(1, 2 * k):
            if len(points) == k:
                break
            offset = step * ((j + 1) // 2) * (-1 if j % 2 else 1)
            if lo < pick + offset < hi:
                points.append(pick + offset)
        return sorted(points)

    def _target(self, limit, lo, hi, lo_measured, hi_measured) -> float:
        """The next budget (total bits) inside (lo, hi): where the predicted KLD, scaled by what the
        nearest candidate measured against its prediction, meets the policy's limit; the plain
        midpoint when the policy has no KLD limit or KLD was not what failed."""
        done = [c for c in self.candidates if c.status in ("finished", "reused") and "quality/kld_mean" in c.metrics]
        pivot = None
        if limit is not None:
            scale = 1.0
            if done:
                near = min(done, key=lambda c: abs(c.budget_bits - (lo + hi) / 2))
                scale = near.metrics["quality/kld_mean"] / max(near.predicted_kld, 1e-12)
                if not done[-1].quality_passed and done[-1].metrics["quality/kld_mean"] <= limit:
                    scale = None  # KLD passed but another quality check failed: bisect
            if scale is not None:
                pivot = self._budget_for(limit / scale, lo, hi)
        if pivot is None:
            pivot = (lo + hi) / 2
        if not lo_measured and not hi_measured:
            return pivot
        margin = 0.1 * (hi - lo)
        return min(max(pivot, lo + margin), hi - margin)

    def _budget_for(self, predicted: float, lo: float, hi: float) -> float:
        """The smallest budget in [lo, hi] whose allocation's predicted KLD is at most `predicted`."""
        if allocate.solve(self.problem, hi).predicted_kld > predicted:
            return hi
        a, b = lo, hi
        for _ in range(30):
            mid = (a + b) / 2
            if allocate.solve(self.problem, mid, resolution=1000).predicted_kld <= predicted:
                b = mid
            else:
                a = mid
            if self._close(a, b, share=0.1):
                break
        return b

    def alternatives(self) -> None:
        """The answer's allocation made with each other template (method), measured the same way."""
        if not self.plan.alternatives:
            return
        chosen, _ = answer(self.candidates, self.plan.request.objective)
        if chosen is None:
            return
        alloc = self.allocations[chosen.sha]
        for template in self.plan.alternatives:
            log.info(
                "tune: the chosen allocation (%.3f bits/weight) with %s (method %s)",
                alloc.bits_per_weight,
                template.name,
                template.recipe.quantize.method,
            )
        self.measure_many([(alloc, chosen.budget_bits, template) for template in self.plan.alternatives])

    def measure(
        self, alloc: allocate.Allocation, budget_bits: float, template: LoadedRecipe | None = None
    ) -> Candidate:
        return self.measure_many([(alloc, budget_bits, template)])[0]

    def measure_many(self, wanted: list[tuple[allocate.Allocation, float, LoadedRecipe | None]]) -> list[Candidate]:
        """Each allocation (with its budget and template) written as a recipe and measured: reused
        where a run of the same recipe exists, the rest quantized, evaluated and benched as child
        runs, up to --parallel at once; then held to the policy."""
        batch: list[tuple[int, Candidate, allocate.Allocation]] = []
        jobs: list[tuple[QuantizeJob, int, Candidate]] = []
        for alloc, budget_bits, template in wanted:
            path, name, sha = write_recipe(self.plan, alloc, self.sens.units, self.parent.run_id, template)
            self.allocations[sha] = alloc
            cand = Candidate(
                name,
                str(path),
                sha,
                budget_bits,
                alloc.predicted_kld,
                alloc.size_mb,
                alloc.bits_per_weight,
                alloc.counts(),
                alloc.predicted_ms,
            )
            self.candidates.append(cand)
            step = len(self.candidates)
            batch.append((step, cand, alloc))
            done = self.tracker.find_runs({TAG + "recipe_sha": sha})
            if done:
                cand.run_id, cand.status = done[0], "reused"
                log.info("tune [%d] %s: measured before (run %s)", step, name, done[0])
                continue
            log.info(
                "tune [%d] %s: predicted KLD %.4g, %.3f bits/weight, %.1f MiB%s -> quantize, evaluate, bench",
                step,
                name,
                alloc.predicted_kld,
                alloc.bits_per_weight,
                alloc.size_mb,
                f", {alloc.predicted_ms:.2f} ms/token decode" if alloc.predicted_ms is not None else "",
            )
            job = QuantizeJob(
                name,
                path,
                self.plan.directory / "logs" / f"{name}.log",
                {TAG + "tune": self.plan.tune_id, TAG + "tune_policy": self.plan.policy.name},
            )
            jobs.append((job, step, cand))
        if jobs:
            self._save(status="running " + ", ".join(job.name for job, _, _ in jobs))
            outcomes = run_quantize_jobs(
                [job for job, _, _ in jobs],
                executor=self.executor,
                tracker=self.tracker,
                outputs=self.outputs,
                parent=self.parent.run_id,
                concurrency=self.plan.request.parallel,
            )
            for outcome, (job, step, cand) in zip(outcomes, jobs):
                cand.wall_s = outcome.wall_s
                if outcome.result is None:
                    cand.status, cand.reason = "failed", outcome.reason
                    log.warning("tune [%d] %s failed: %s (log %s)", step, cand.name, outcome.reason, job.log)
                else:
                    cand.run_id, cand.status = outcome.result["run_id"], "finished"
        for step, cand, alloc in batch:
            if cand.status != "failed":
                self._held_to_policy(step, cand, alloc)
        self._save()
        return [cand for _, cand, _ in batch]

    def _held_to_policy(self, step: int, cand: Candidate, alloc: allocate.Allocation) -> None:
        """A measured candidate's checks against the policy; its predictions logged to its run, the
        tune's step metrics to the parent run."""
        run = self.tracker.existing(cand.run_id)
        info, data = run.info, run.data
        cand.metrics = dict(data.metrics)
        try:
            checks = gate.evaluate_policy(self.plan.policy.policy, info.status, dict(data.tags), cand.metrics)
        except gate.MissingInterval as exc:  # e.g. a task scored on too few items for an interval
            key = str(exc)
            why = "logged without the interval the policy holds to its limit"
            checks = [gate.Check(key, cand.metrics.get(key), "an interval's end", False, why)]
        cand.checks = [asdict(c) for c in checks]
        cand.passed = all(c.passed for c in checks)
        cand.quality_passed = all(c.passed for c in checks if not _beyond_bits(c.check))
        predicted = {"tune/predicted_kld": alloc.predicted_kld, "tune/predicted_size_mb": alloc.size_mb}
        if alloc.predicted_ms is not None:
            predicted["tune/predicted_decode_ms"] = alloc.predicted_ms
        run.log_metrics(predicted)
        measured = cand.metrics.get("quality/kld_mean")
        decode = cand.metrics.get("speed/decode_tok_s")
        self.parent.log_metrics(
            {
                k: v
                for k, v in {
                    "tune/predicted_kld": alloc.predicted_kld,
                    "tune/measured_kld": measured,
                    "tune/bits_per_weight": cand.metrics.get("model/bits_per_weight"),
                    "tune/size_mb": cand.metrics.get("model/size_mb"),
                    "tune/passed": float(cand.passed),
                    "tune/predicted_decode_ms": alloc.predicted_ms,
                    "tune/decode_ms": 1000.0 / decode if decode else None,
                }.items()
                if v is not None
            },
            step=step,
        )
        log.info(
            "tune [%d] %s: measured KLD %s (predicted %.4g), %s MiB: %s",
            step,
            cand.name,
            f"{measured:.4g}" if measured is not None else "—",
            alloc.predicted_kld,
            f"{cand.metrics.get('model/size_mb', float('nan')):.1f}",
            "PASS" if cand.passed else "fails " + ", ".join(c["check"] for c in cand.failed_checks()),
        )

    def _save(self, status: str = "") -> None:
        self.state["candidates"] = [asdict(c) for c in self.candidates]
        self.state["status"] = status
        _write_state(self.plan.directory, self.state)


def _beyond_bits(check: str) -> bool:
    """A check more bits cannot fix (speed, licence, ...): not what the budget search bisects on."""
    if check in NOT_QUALITY or check.startswith("stage "):
        return True
    name = check.removeprefix("recovery/")
    return name.startswith(("speed/", "speedup/", "base_speed/")) or check.startswith("speedup/")


def _same(alloc: allocate.Allocation, cand: Candidate) -> bool:
    return (
        abs(alloc.bits_per_weight - cand.bits_per_weight) < 1e-9
        and abs(alloc.predicted_kld - cand.predicted_kld) < 1e-12
    )


# ---------------------------------------------------------------------------------------------
# State on disk, the lock


def _read_state(directory: Path) -> dict:
    path = directory / "state.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_state(directory: Path, state: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / "state.json", json.dumps(state, indent=2, default=str))


def _lock(directory: Path):
    from quantbench.core.processes import hold_lock

    return hold_lock(directory, "this tune")


# ---------------------------------------------------------------------------------------------
# The answer, the frontier


def shipped_references(tracker: Tracker, base_fingerprint: str, gguf: bool | None = None) -> list:
    """The newest FINISHED run of each shipped recipe (recipes/) on this base model that has a
    KLD: the uniform reference points of the frontier (with `gguf`, only llama.cpp's presets, or
    only the others: a tune is drawn beside what its engine serves)."""
    from quantbench.recipe import available_recipes

    shipped = set(available_recipes(recipes_dir()))
    newest = {}
    for r in tracker.search({TAG + "role": "candidate", TAG + "base_fingerprint": base_fingerprint}):
        recipe = r.data.tags.get(TAG + "recipe")
        if (
            recipe in shipped
            and TAG + "tune" not in r.data.tags
            and "quality/kld_mean" in r.data.metrics
            and recipe not in newest
            and (gguf is None or (r.data.tags.get(TAG + "format") == "gguf") == gguf)
        ):
            newest[recipe] = r
    return list(newest.values())


def frontier(candidates: list[Candidate], references: list, policy: str) -> list[dict]:
    """Every measured tuned candidate and shipped reference on (size, KLD), with whether it is on
    the size-vs-KLD Pareto frontier and which shipped recipes are both smaller and lower in KLD."""
    points = []
    for c in candidates:
        if c.run_id and "quality/kld_mean" in c.metrics and "model/size_mb" in c.metrics:
            points.append(
                {
                    "kind": "tuned",
                    "run_id": c.run_id,
                    "recipe": c.recipe,
                    "name": c.name,
                    "passed": c.passed,
                    "size_mb": c.metrics["model/size_mb"],
                    "kld": c.metrics["quality/kld_mean"],
                    "bits_per_weight": c.metrics.get("model/bits_per_weight"),
                    "predicted_kld": c.predicted_kld,
                    "decode_speedup": c.metrics.get("speedup/decode_tok_s"),
                }
            )
    for r in references:
        m = r.data.metrics
        if "model/size_mb" in m:
            points.append(
                {
                    "kind": "shipped",
                    "run_id": r.info.run_id,
                    "recipe": r.data.tags.get(TAG + "recipe"),
                    "name": r.data.tags.get(TAG + "recipe"),
                    "passed": r.data.tags.get(f"{TAG}gate.{policy}") == "pass",
                    "size_mb": m["model/size_mb"],
                    "kld": m["quality/kld_mean"],
                    "bits_per_weight": m.get("model/bits_per_weight"),
                    "predicted_kld": None,
                    "decode_speedup": m.get("speedup/decode_tok_s"),
                }
            )
    for p, keep in zip(points, pareto([(p["size_mb"], p["kld"]) for p in points])):
        p["frontier"] = keep
        p["dominated_by"] = (
            [
                q["name"]
                for q in points
                if q["kind"] == "shipped" and q["size_mb"] < p["size_mb"] and q["kld"] < p["kld"]
            ]
            if p["kind"] == "tuned"
            else []
        )
    return sorted(points, key=lambda p: p["size_mb"])


def plot_frontier(points: list[dict], path: Path, title: str) -> Path:
    """Size vs KLD (and, when candidates were benched, decode speedup vs KLD): tuned candidates
    coloured by verdict, shipped uniform recipes in grey, the size-vs-KLD frontier dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = [p for p in points if p.get("decode_speedup") is not None]
    fig, axes = plt.subplots(1, 2 if speed else 1, figsize=(13 if speed else 8, 5.5), dpi=110, squeeze=False)
    panels = [("size_mb", "model/size_mb (lower is better)", points)]
    if speed:
        panels.append(("decode_speedup", "speedup/decode_tok_s (higher is better)", speed))
    for ax, (x_key, x_label, shown) in zip(axes[0], panels):
        for p in shown:
            tuned = p["kind"] == "tuned"
            color = ("tab:green" if p["passed"] else "tab:orange") if tuned else "tab:gray"
            ax.scatter(
                [p[x_key]], [p["kld"]], s=60 if tuned else 45, color=color, marker="o" if tuned else "s", zorder=3
            )
            label = f"{p['bits_per_weight']:.2f} b/w" if tuned and p.get("bits_per_weight") else p["name"]
            ax.annotate(label, (p[x_key], p["kld"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
        if x_key == "size_mb":
            line = sorted((p["size_mb"], p["kld"]) for p in shown if p["frontier"])
            if len(line) > 1:
                ax.plot(*zip(*line), color="tab:green", linestyle="--", zorder=2, label="Pareto frontier (size vs KLD)")
        if shown:
            ax.set_yscale("log")
        ax.set_xlabel(x_label)
        ax.set_ylabel("quality/kld_mean (lower is better)")
        ax.grid(alpha=0.3)
    ax = axes[0][0]
    ax.scatter([], [], color="tab:green", label="tuned, passes the policy")
    ax.scatter([], [], color="tab:orange", label="tuned, fails the policy")
    ax.scatter([], [], color="tab:gray", marker="s", label="shipped uniform recipe")
    ax.legend(loc="best", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def answer(candidates: list[Candidate], objective: str = "size") -> tuple[Candidate | None, list[dict]]:
    """The chosen candidate (the smallest that passes the policy, or with the latency objective the
    fastest: measured decode time where benched, else predicted; else the smallest / fastest whose
    quality passes; else the one with the fewest failed checks, then the lowest KLD; a tie goes to
    the lower KLD) and, when none passes, every check no candidate met with the closest value any
    candidate reached."""
    measured = [c for c in candidates if c.checks]
    if not measured:
        return None, []

    def size(c: Candidate) -> tuple[float, float]:
        # size (or decode time) first; at one size (the same allocation made by two methods) the lower KLD
        kld = c.metrics.get("quality/kld_mean", math.inf)
        if objective == "latency":
            decode = c.metrics.get("speed/decode_tok_s")
            return (1000.0 / decode if decode else c.predicted_ms or math.inf), kld
        return round(c.metrics.get("model/size_mb", math.inf), 3), kld

    passing = [c for c in measured if c.passed]
    if passing:
        return min(passing, key=size), []
    quality = [c for c in measured if c.quality_passed]
    best = (
        min(quality, key=size)
        if quality
        else min(measured, key=lambda c: (len(c.failed_checks()), c.metrics.get("quality/kld_mean", math.inf)))
    )
    unmet = []
    for i, check in enumerate(measured[0].checks):
        if any(c.checks[i]["passed"] for c in measured if len(c.checks) > i):
            continue
        values = [(c.checks[i]["value"], c) for c in measured if isinstance(c.checks[i]["value"], (int, float))]
        closest = None
        if values:
            op = str(check["threshold"]).split()[0]
            value, c = max(values, key=lambda v: v[0]) if op == ">=" else min(values, key=lambda v: v[0])
            closest = {"value": value, "run_id": c.run_id, "name": c.name}
        unmet.append({"check": check["check"], "threshold": check["threshold"], "closest": closest})
    return best, unmet


# ---------------------------------------------------------------------------------------------
# The verb


def run(request: Request, *, outputs: Path = Path("outputs"), experiment: str | None = None) -> dict:
    from quantbench.jobs import ray_executor

    plan = prepare(request, outputs, experiment)
    executor = ray_executor.make(request.ray)  # a bad Ray address fails here, before anything is written
    try:
        tracker = Tracker(experiment)
        if request.ray is not None:
            executor.check_store(tracker)
        lock = _lock(plan.directory)
        try:
            return _run(plan, tracker, outputs, executor)
        finally:
            lock.close()
    finally:
        executor.close()


def _rounding(plan: Plan, folder: Path):
    """What rounds a llama.cpp tune's K- and I-quants (llama-quantize), and every type when the
    template weighs by an importance matrix (computed here as its candidates compute theirs: on
    the template's calibration windows); None for a vLLM tune."""
    if plan.base_gguf is None or plan.gguf_names is None:
        return None
    from quantbench.engines import llamacpp
    from quantbench.engines import llamacpp_build as build
    from quantbench.sources import data
    from quantbench.tune import gguf as gguf_tune

    plan.directory.mkdir(parents=True, exist_ok=True)
    log_path = plan.directory / "llama-quantize.log"
    tools = build.ensure("a llama.cpp tune")
    imatrix = None
    if getattr(plan.template.recipe.quantize, "imatrix", False):
        cal = plan.template.recipe.calibration
        text = data.load_text(cal.source, field="calibration.source", text_field=cal.text_field, hub_split=cal.split)

        def compute() -> Path:
            windows = data.recipe_windows(plan.tokenizer, text, cal)
            return llamacpp.imatrix(tools, plan.base_gguf, plan.tokenizer, windows, cal.seq_len, folder, log_path)

        described = {"text": data.text_sha(text), "samples": cal.samples, "seq_len": cal.seq_len, "seed": cal.seed}
        imatrix = (canonical_sha(described)[:16], compute)
    return gguf_tune.EngineRounding(tools, plan.base_gguf, plan.gguf_names, folder, log_path, imatrix)


def _run(plan: Plan, tracker: Tracker, outputs: Path, executor) -> dict:
    request = plan.request
    state = _read_state(plan.directory)
    # candidates left RUNNING by a tune that died (this tune holds its lock now)
    tracker.fail_orphans({TAG + "tune": plan.tune_id, TAG + "role": "candidate"}, "tune")
    with tempfile.TemporaryDirectory(prefix="quantbench-rounding-") as tmp:
        sens = sensitivity.get(
            tracker,
            plan.base,
            plan.tokenizer,
            request.schemes,
            plan.template.recipe.calibration,
            request.sensitivity,
            _rounding(plan, Path(tmp)),
        )
    costs = None
    if request.objective == "latency" and plan.gguf:
        costs = cost.get(
            plan.base,
            request.schemes or [],
            sorted(set((plan.gguf_names or {}).values())),
            remeasure=request.remeasure_costs,
        )
    elif request.objective == "latency":
        costs = cost.get_vllm(
            plan.base,
            request.schemes or [],
            plan.shapes,
            plan.unquantized,
            plan.directory / "cost-table-servers.log",
            remeasure=request.remeasure_costs,
        )
    if costs is not None and costs.unserved:
        # what the engine does not serve here is never proposed (its reasons from the engine interface)
        request.schemes = [s for s in request.schemes or [] if s not in costs.unserved]
        if not request.schemes:
            raise UserError(
                "--schemes: vLLM serves none of them here: " + "; ".join(f"{k}: {v}" for k, v in costs.unserved.items())
            )
    if costs is not None:
        fastest, slowest = problem(plan, sens, costs).bounds()
        if request.latency_ms is not None and request.latency_ms < fastest - 1e-9:
            raise UserError(
                f"--latency-ms {request.latency_ms:g}: below {fastest:.2f} ms/token, the fastest any mix of "
                f"{', '.join(request.schemes or [])} is predicted to decode here ({costs.cpu}, {costs.threads} threads; "
                f"the least-KLD mix: {slowest:.2f} ms/token)"
            )
    parent_id = state.get("parent_run")
    resumed = bool(parent_id and tracker.existing(parent_id) is not None)
    tags = {
        TAG + "role": "tune",
        TAG + "tune": plan.tune_id,
        TAG + "tune_policy": plan.policy.name,
        TAG + "base_model": plan.base.source,
        TAG + "base_fingerprint": plan.base.fingerprint,
        TAG + "recipe": plan.template.name,
        TAG + "sensitivity_run": sens.run_id,
        "mlflow.note.content": f"`quantbench tune --policy {plan.policy.name}` from recipe `{plan.template.name}` on "
        f"`{plan.base.source}`: per-layer schemes from {', '.join(request.schemes)}.",
    }
    run_ = (
        tracker.resume_run(parent_id)
        if resumed
        else tracker.start_run(f"tune · {plan.policy.name} · {models.short_name(plan.base.source)}", tags)
    )
    state = {
        "tune": plan.tune_id,
        "parent_run": run_.run_id,
        "policy": plan.policy.name,
        "candidates": [],
        "status": "",
    }
    _write_state(plan.directory, state)
    with run_:
        if not resumed:
            run_.log_params(
                {
                    "tune": {
                        "policy": plan.policy.name,
                        "template": str(plan.template.path),
                        "alternatives": ",".join(str(t.path) for t in plan.alternatives),
                        "schemes": ",".join(request.schemes),
                        "bits": request.bits,
                        "max_size_mb": request.max_size_mb,
                        "objective": request.objective,
                        "latency_ms": request.latency_ms,
                        "budget_runs": request.budget_runs,
                        "parallel": request.parallel,
                        "sensitivity": request.sensitivity.method,
                    }
                }
            )
        search = Search(plan, tracker, sens, run_, tracker.experiment, outputs, state, executor, costs)
        search.budgets()
        search.alternatives()
        best, unmet = answer(search.candidates, request.objective)
        references = shipped_references(tracker, plan.base.fingerprint, gguf=plan.gguf)
        points = frontier(search.candidates, references, plan.policy.name)
        verdict = None
        if best is not None:
            verdict = gate.run(best.run_id, str(plan.policy.path), experiment=tracker.experiment)
        summary = _summary(plan, sens, search.candidates, best, unmet, points, verdict, run_.run_id, resumed, costs)
        out = plan.directory
        plot_frontier(
            points,
            out / "frontier.png",
            f"tune {plan.policy.name} · {models.short_name(plan.base.source)}: size vs KLD",
        )
        (out / "tune.json").write_text(json.dumps(summary, indent=2, default=str))
        (out / "tune.txt").write_text(text(summary) + "\n")
        run_.log_artifact(out / "tune.json", "tune")
        run_.log_artifact(out / "tune.txt", "tune")
        run_.log_artifact(out / "frontier.png", "tune")
        for c in search.candidates:
            run_.log_artifact(Path(c.recipe), "tune/recipes")
        run_.set_tags(
            {
                TAG + "tune_best_run": best.run_id if best else "",
                TAG + "tune_passed": str(summary["passed"]).lower(),
                TAG + "tune_runs": ",".join(c.run_id for c in search.candidates if c.run_id),
            }
        )
        final = {"tune/candidates": len(search.candidates), "tune/passed_final": float(summary["passed"])}
        if best is not None:
            final.update(
                {
                    "tune/best_size_mb": best.metrics.get("model/size_mb", math.nan),
                    "tune/best_kld": best.metrics.get("quality/kld_mean", math.nan),
                    "tune/best_bits_per_weight": best.metrics.get("model/bits_per_weight", math.nan),
                }
            )
        run_.log_metrics({k: v for k, v in final.items() if not (isinstance(v, float) and math.isnan(v))})
        state["status"] = "done"
        _write_state(plan.directory, state)
    return summary


def _summary(plan, sens, candidates, best, unmet, points, verdict, parent, resumed, costs=None) -> dict:
    return {
        "parent_run": parent,
        "tune": plan.tune_id,
        "policy": plan.policy.name,
        "objective": plan.request.objective,
        "cost_table": (
            {
                "path": str(cost.path(costs.key)),
                "engine": costs.engine,
                "cpu": costs.cpu,
                "threads": costs.threads,
                "reference": costs.reference,
                "ms": costs.ms,
                "unserved": costs.unserved,
            }
            if costs is not None
            else None
        ),
        "resumed": resumed,
        "best_run": best.run_id if best else None,
        "recipe": best.recipe if best else None,
        "passed": bool(verdict and verdict["passed"]),
        "registered": verdict["registered"] if verdict else None,
        "unmet_checks": unmet,
        "failed_checks": [c for c in (verdict or {}).get("checks", []) if not c["passed"]],
        "sensitivity_run": sens.run_id,
        "sensitivity_reused": sens.reused,
        "frontier": points,
        "candidates": [
            {k: v for k, v in asdict(c).items() if k != "checks"}
            | {"failed_checks": [x["check"] for x in c.failed_checks()]}
            for c in candidates
        ],
        "directory": str(plan.directory),
    }


def text(summary: dict) -> str:
    """What `quantbench tune` prints: the candidates, the frontier, the answer."""
    body = []
    for i, c in enumerate(summary["candidates"], 1):
        m = c["metrics"]
        cell = lambda k, f: format(m[k], f) if k in m else "—"  # noqa: E731
        verdict = (
            "pass" if c["passed"] else ("fails " + ", ".join(c["failed_checks"]) if c["failed_checks"] else c["reason"])
        )
        body.append(
            [
                str(i),
                c["name"],
                c["status"],
                cell("model/bits_per_weight", ".3f"),
                cell("model/size_mb", ".1f"),
                f"{c['predicted_kld']:.4f}",
                cell("quality/kld_mean", ".4f"),
                cell("speedup/decode_tok_s", ".2f"),
                verdict,
            ]
        )
    headers = ["#", "candidate", "status", "bits/w", "MiB", "KLD pred", "KLD", "decode x", "verdict"]
    rows = [tables.table(headers, body, "rllrrrrrl")]
    timed = [(i, c) for i, c in enumerate(summary["candidates"], 1) if c.get("predicted_ms") is not None]
    if timed:
        rows.append(
            "decode time per token, predicted from the cost table (measured through the bench's engine): "
            + "; ".join(
                f"#{i} {c['predicted_ms']:.2f} ms"
                + (
                    f" ({1000 / c['metrics']['speed/decode_tok_s']:.2f})"
                    if c["metrics"].get("speed/decode_tok_s")
                    else ""
                )
                for i, c in timed
            )
        )
    shipped = [p for p in summary["frontier"] if p["kind"] == "shipped"]
    if shipped:
        rows.append(
            "shipped uniform recipes (reference): "
            + "; ".join(f"{p['name']} {p['size_mb']:.1f} MiB KLD {p['kld']:.4f}" for p in shipped)
        )
    if summary["best_run"] is None:
        rows.append("no candidate was measured")
    elif summary["passed"]:
        rows.append(
            f"PASS: {summary['best_run']} ({summary['recipe']}) passes {summary['policy']}"
            + (
                f"; registered {summary['registered']['model']} v{summary['registered']['version']} -> "
                f"alias '{summary['registered']['alias']}'"
                if summary.get("registered")
                else ""
            )
        )
    else:
        rows.append(
            f"no candidate passes {summary['policy']}; best: {summary['best_run']} ({summary['recipe']}), which "
            f"still fails: {', '.join(c['check'] for c in summary['failed_checks'])}"
        )
        for u in summary["unmet_checks"]:
            closest = u["closest"]
            got = f"closest {closest['value']:.4g} ({closest['name']})" if closest else "never measured"
            rows.append(f"  no candidate met {u['check']} {u['threshold']}: {got}")
    rows.append(
        f"parent run: {summary['parent_run']}   sensitivity run: {summary['sensitivity_run']}"
        f"{' (reused)' if summary['sensitivity_reused'] else ''}   outputs: {summary['directory']}"
    )
    return "\n".join(rows)
