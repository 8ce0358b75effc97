"""`quantbench stack NAME`: the speedup ledger. Each technique's multiplier and its quality cost,
stacked and measured in one run.

A stack file (stacks/NAME.yaml) names a base model, a workload (prompt and output lengths, requests,
repetitions) and an ordered list of steps. The first step is the naive start; every later step
changes one or more of `engine`, `dtype`, `model`, `concurrency` (or an open-loop `rate`), `draft`,
`kv_cache` and `prefix_cache` and keeps everything else from the steps before it, so each step adds
its techniques on top of all the earlier ones:

    steps:
      - {name: naive, engine: hf, dtype: float32}      # in-process transformers generate
      - {name: llama.cpp, engine: llamacpp}           # a serving engine (the base as an F16 GGUF)
      - {name: int4, model: recipe:gguf-q4_0}         # a quantized checkpoint (run first if never run)
      - {name: batching, concurrency: 8}              # 8 requests in flight (continuous batching)

Measuring: every step is measured in every round (A B C D, A B C D, ...), one after the other on
the same prompts (every round new ones, and steps served by one server each their own, drawn
alike from the held-out text: a server never meets a prompt twice, so a prefix cache reuses only a
shared prefix), so machine drift hits all alike and step i's repetition r pairs with step i-1's
(its multiplier's interval) and with step 0's (the cumulative one's). A step's speed is its output
throughput (tokens/s over the requests in flight at its concurrency); per-request decode rate, TTFT
and end-to-end latency are logged beside it. The cumulative multiplier is measured directly (the
last step against the first in the same rounds) and also as the product of the step multipliers
(each the median of its per-round ratios); the two agree within the rounds' noise, and the ledger
says by how much they differ.

Quality: a step that changes the model carries the quality of that model against the original
base, from its own quantbench run (the evaluate stage's `quality/kld_mean` with its interval, or
llama.cpp's `quality_engine/kld_mean` for a GGUF checkpoint; the reload check's `check/ppl_ratio`
where the run was not evaluated). With `--policy`, the policy's quality checks (not its speed ones)
are held against each step's model. Nothing here computes quality anew: `quantbench evaluate RUN`
does, and the ledger reads it.

MLflow: a parent run (`quantbench.role=stack`) with the ledger (`stack.json`, `stack.md`, the
waterfall plot `stack_waterfall.png`, the servers' logs) and `stack/<step>/multiplier|cumulative`;
one child run per step (`quantbench.role=stack_step`) with its speed and its multipliers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, field_validator, model_validator

from quantbench import engines
from quantbench.core.errors import UserError, did_you_mean
from quantbench.core.intervals import HIGH, LOW, ratio_interval
from quantbench.core.logs import terminal
from quantbench.recipe import DEFAULT_MODEL, CheckedFile, check_file, named_path, resolve_recipe_path
from quantbench.recipe.common import Strict
from quantbench.sources.checkpoint import RUN_ID
from quantbench.tracking import TAG, Tracker, tracking_uri

if TYPE_CHECKING:
    from quantbench.sources.models import ResolvedModel

log = logging.getLogger(__name__)

ENGINE_NAMES = ("hf", "transformers", "vllm", "llamacpp")  # the engines a step can name
# what a step can change
KNOBS = ("engine", "dtype", "model", "concurrency", "rate", "draft", "kv_cache", "prefix_cache")
PLOT = "stack_waterfall.png"
AGAINST_BASE_LOG = "against-base.log"
BASE = "<base>"  # a draft that is the base model (a step serving the base named as the draft)
CHAIN_TOKENS, CHAIN_WINDOW = 8192, 512  # a model made from another step's model, scored against the base
# the quality figure a step's model shows, first found in its run: (metric, label)
QUALITY_KEYS = (
    ("quality/kld_mean", "KLD"),
    ("quality_engine/kld_mean", "KLD (llama.cpp)"),
    ("check/ppl_ratio", "ppl ratio (reload check)"),
)


class Workload(Strict):
    """What every step is measured on: prompts of the same lengths (the same shared prefix) and output lengths."""

    prompt_tokens: PositiveInt = 128
    # the first this many of every prompt's tokens are the same for every request (a system prompt,
    # a shared document); a prefix_cache step lets the server reuse them, every other step
    # computes them anew
    prefix_tokens: NonNegativeInt = 0
    output_tokens: PositiveInt = 32
    # requests per measurement: at concurrency N default 2 x N (closed loop, N in flight); at a
    # request rate default 8, or 2 x the slots when more
    requests: PositiveInt | None = None
    repetitions: int = Field(3, ge=3, description="rounds measured (3 or more: each multiplier gets an interval)")
    warmup: int = Field(1, ge=0, description="rounds run first and dropped")
    seed: int = 0
    compile: bool = True  # vLLM compiles its graphs at start-up (what a deployment runs)

    @model_validator(mode="after")
    def _prefix_inside_the_prompt(self) -> Workload:
        if self.prefix_tokens >= self.prompt_tokens:
            raise ValueError(
                f"prefix_tokens {self.prefix_tokens}: the shared prefix is part of each prompt and must be "
                f"shorter than prompt_tokens ({self.prompt_tokens}), leaving each request tokens of its own"
            )
        return self

    def level_requests(self, concurrency: int, rate: float | None = None) -> int:
        return self.requests or (max(8, 2 * concurrency) if rate is not None else 2 * concurrency)


class Step(Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    engine: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    model: str | None = None  # run:ID, recipe:NAME, a checkpoint directory; default the base model
    # with model: recipe:NAME, the earlier step whose model the recipe starts from (its
    # model.source), e.g. a distilled student quantized; default the stack's base
    source: str | None = None
    concurrency: PositiveInt | None = None
    # open loop: requests arrive at this many per second (Poisson), the server batching at most the
    # concurrency in place (its slots); a later concurrency step goes back to closed loop
    rate: PositiveFloat | None = None
    # speculative decoding through the engine: the draft model, an earlier step's name (its model)
    # or run:ID / recipe:NAME / a checkpoint directory
    draft: str | None = None
    # the server's KV cache in this type (the engine's own names: llama.cpp q8_0, q4_0, ...)
    kv_cache: str | None = None
    # the server reuses the KV cache of the workload's shared prefix (llama.cpp's cache_prompt,
    # vLLM's prefix caching); steps without it send every request with the cache off
    prefix_cache: bool | None = None

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str | None) -> str | None:
        if value is not None and value not in ENGINE_NAMES:
            raise ValueError(f"unknown engine '{value}'. Available: {', '.join(ENGINE_NAMES)}")
        return value


class StackFile(Strict):
    description: str = ""
    base: str = DEFAULT_MODEL
    workload: Workload = Workload()
    steps: list[Step] = Field(min_length=2)


@dataclass(frozen=True)
class Config:
    """Everything a step is measured with: its own changes over the steps before it."""

    engine: str
    dtype: str
    model: str | None  # None: the base model
    concurrency: int
    source: str | None = None  # model is recipe:NAME applied to this step's model (None: the base)
    draft: str | None = None  # the draft model's key (speculative decoding), as model_key names models
    kv_cache: str | None = None  # the server's KV-cache type (None: the engine's 16-bit cache)
    rate: float | None = None  # open-loop arrivals per second (None: closed loop, `concurrency` in flight)
    prefix_cache: bool = False  # requests reuse the cached shared prefix

    @property
    def level(self) -> str:
        """The load level the step is measured at: c8 (8 in flight) or r4 (4 requests/s)."""
        from quantbench.speed.serving import level_name

        return level_name(self.concurrency, self.rate)

    @property
    def model_key(self) -> str | None:
        """The model, told apart from the same recipe applied to another step's model."""
        return f"{self.model}@{self.source}" if self.model and self.source else self.model

    def server_key(self) -> tuple[str, str, str | None, str | None, str | None]:
        return (self.engine, self.dtype, self.model_key, self.draft, self.kv_cache)


@dataclass
class Resolved:
    """A step's model, found: its checkpoint directory and what its run says about its quality."""

    path: Path
    run_id: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    label: str = ""
    base: str | None = None  # the model its run was measured against, where that is not the stack's base


def stacks_dir() -> Path:
    return Path(os.environ.get("QUANTBENCH_STACKS", "stacks"))


def load(name: str, tracker: Tracker | None = None) -> tuple[StackFile, list[Config]]:
    """The stack file and each step's full configuration. Every problem at once, each with its line,
    as a recipe's: the schema's, the step list's (a step with a schema problem left out of those) and
    the models and drafts the steps name (an unknown recipe, a draft that is no earlier step nor a
    model, with close matches; with `tracker`, a run id the store does not have)."""
    path = Path(name)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = named_path(stacks_dir(), name, "stack", "stack")
    checked = check_file(path, StackFile)
    problems = list(checked.problems)
    steps: list[Config] = []
    if checked.settings is not None:
        steps, found = configs(checked.settings, checked, tracker)
        problems += found
    if problems or checked.settings is None:
        raise UserError(problems)
    return checked.settings, steps


def configs(stack: StackFile, checked: CheckedFile, tracker: Tracker | None = None) -> tuple[list[Config], list[str]]:
    """Each step's configuration (its changes over the steps before it) and the step list's problems."""
    where = str(checked.path)
    # steps and sections with a schema problem are at their defaults here: what would be said of them is of the
    # defaults, not of what the file says
    skip = {loc[1] for loc in checked.invalid if len(loc) > 1 and loc[0] == "steps" and isinstance(loc[1], int)}
    workload_given = not any(loc[:1] == ("workload",) for loc in checked.invalid)
    problems: list[str] = []

    def at(i: int, knob: str | None = None) -> str:
        """`stacks/x.yaml: steps.2 (int4, line 7)`: a step, and the line of the knob said (or of the step)."""
        line = (knob and checked.line("steps", i, knob)) or checked.line("steps", i)
        return f"{where}: steps.{i} ({stack.steps[i].name}" + (f", line {line})" if line else ")")

    def say(i: int, problem: str | None) -> None:
        if problem is not None and i not in skip:
            problems.append(problem)

    first = stack.steps[0]
    if first.engine is None:
        say(0, f"{at(0)}: the first step is the naive start: name its engine (e.g. hf)")
    for knob in ("source", "draft"):
        if getattr(first, knob) is not None:
            say(
                0,
                f"{at(0, knob)}: {knob}: the first step is the naive start; it names no earlier step's model (make it "
                "a step of its own)",
            )
    if first.model is not None:
        say(0, _model_problem(at(0, "model"), "model", first.model, tracker))
    current = Config(
        first.engine or "hf",
        first.dtype or "auto",
        first.model,
        first.concurrency or 1,
        rate=first.rate,
        prefix_cache=bool(first.prefix_cache),
    )
    out = [current]
    seen = {first.name: 0}
    names = [s.name for s in stack.steps]
    for i, step in enumerate(stack.steps[1:], start=1):
        if step.name in seen:
            line = checked.line("steps", i, "name")
            say(i, f"{where}: steps.{i}.name{f' (line {line})' if line else ''}: '{step.name}' is also step "
                   f"{seen[step.name]}'s name")  # fmt: skip
        seen.setdefault(step.name, i)
        earlier = [n for n, j in seen.items() if j < i]
        source = None
        if step.source is not None:
            if not (step.model or "").startswith("recipe:"):
                say(
                    i,
                    f"{at(i, 'source')}: source: names the model a recipe starts from; it needs model: recipe:NAME "
                    "in the same step",
                )
            elif step.source not in seen or seen[step.source] == i:
                say(
                    i,
                    f"{at(i, 'source')}: source: '{step.source}' is not an earlier step."
                    + did_you_mean(step.source, earlier),
                )
            elif out[seen[step.source]].model is None:
                say(
                    i,
                    f"{at(i, 'source')}: source: step '{step.source}' serves the base model, which a recipe starts "
                    "from anyway; leave source out",
                )
            else:
                source = out[seen[step.source]].model_key
        if step.model is not None:
            say(i, _model_problem(at(i, "model"), "model", step.model, tracker))
        changes = {k: getattr(step, k) for k in KNOBS if getattr(step, k) is not None}
        if step.draft is not None:  # an earlier step's name stands for its model
            if seen.get(step.draft, i) < i:
                changes["draft"] = out[seen[step.draft]].model_key or BASE
            elif step.draft in names:
                say(i, f"{at(i, 'draft')}: draft: '{step.draft}' is step {names.index(step.draft)}, not an earlier "
                       "one: a draft is a model served before it")  # fmt: skip
            else:
                say(i, _model_problem(at(i, "draft"), "draft", step.draft, tracker, earlier))
        key = f"{step.model}@{source}" if source else step.model
        same = [
            k for k, v in changes.items() if (current.model_key == key if k == "model" else getattr(current, k) == v)
        ]
        if not changes:
            say(i, f"{at(i)}: changes nothing; set one of {', '.join(KNOBS)}")
        elif len(same) == len(changes):
            say(
                i,
                f"{at(i, same[0])}: {', '.join(f'{k}: {changes[k]}' for k in same)} is what the steps before it "
                "already use; a step must add something",
            )
        if "model" in changes:
            changes["source"] = source
        current = _apply(current, changes)
        out.append(current)

    for i, config in enumerate(out):
        engine = engines.get(config.engine)
        # each said once, where the knob meets an engine that cannot apply it (not again for each later step)
        refused = {k for k, no in refusals(config).items() if no and not (i and refusals(out[i - 1])[k])}
        if "draft" in refused:
            say(
                i,
                f"{at(i, 'draft')}: draft: speculative decoding through {engine.label}: {engine.drafts}; a draft step "
                "needs engine " + " or ".join(n for n in ENGINE_NAMES if engines.get(n).drafts is None),
            )
        if "kv_cache" in refused:
            offered = engine.kv_cache_types
            say(
                i,
                f"{at(i, 'kv_cache')}: kv_cache {config.kv_cache}: {engine.label} "
                + (f"takes {', '.join(offered)}" if offered else "takes no KV-cache type through quantbench")
                + "; a kv_cache step needs engine llamacpp (q8_0, q4_0, ...: its quality is scored with "
                "llama.cpp's tools)",
            )
        if "rate" in refused:
            say(
                i,
                f"{at(i, 'rate')}: rate {config.rate:g}: requests arriving at a rate need a server; {engine.label} "
                "runs in-process (one batched generate)",
            )
        if "prefix_cache" in refused:
            say(
                i,
                f"{at(i, 'prefix_cache')}: prefix_cache: {engine.label} {engine.prefix_cache}; a prefix_cache step "
                "needs engine " + " or ".join(n for n in ENGINE_NAMES if engines.get(n).prefix_cache is None),
            )
        if stack.steps[i].prefix_cache and not stack.workload.prefix_tokens and workload_given:
            say(
                i,
                f"{at(i, 'prefix_cache')}: prefix_cache: the workload's prompts share no prefix, so there is nothing "
                "to reuse; set workload.prefix_tokens (e.g. 96 of 128: a system prompt)",
            )
        if "dtype" in refused:
            say(
                i,
                f"{at(i, 'dtype')}: dtype {config.dtype}: llama.cpp serves a model's own GGUF file, the base model as "
                "an F16 file; dtype applies to hf, transformers and vllm",
            )
    return out, problems


def _model_problem(
    where: str, knob: str, ref: str, tracker: Tracker | None, earlier: list[str] | None = None
) -> str | None:
    """What is wrong with a model a step names (`recipe:NAME`, `run:ID`, a checkpoint directory;
    a draft also an earlier step's name, `earlier`): an unknown recipe, a path that is not there, a
    run the store does not have (looked up with `tracker` only). None when nothing is."""
    if ref.startswith("recipe:"):
        try:
            resolve_recipe_path(ref.removeprefix("recipe:"))
        except UserError as exc:
            return f"{where}: {knob}: {exc.problems[0]}"
        return None
    run_id = ref.removeprefix("run:")
    if ref.startswith("run:") or (RUN_ID.fullmatch(ref) and not Path(ref).exists()):
        if tracker is None or tracker.existing(run_id) is not None:
            return None
        return f"{where}: {knob}: MLflow run '{run_id}' does not exist at the tracking store ({tracking_uri()})"
    if Path(ref).exists():
        return None
    if earlier is None:
        return f"{where}: {knob}: '{ref}' is neither run:ID, recipe:NAME nor a checkpoint directory (no such path)"
    return (
        f"{where}: {knob}: '{ref}' is neither an earlier step's name, run:ID, recipe:NAME nor a checkpoint directory."
        + did_you_mean(ref, earlier)
    )


def refusals(config: Config) -> dict[str, bool]:
    """Per knob, whether the configuration's engine cannot apply it (here, through quantbench)."""
    engine = engines.get(config.engine)
    return {
        "draft": config.draft is not None and engine.drafts is not None,
        "kv_cache": config.kv_cache is not None and not kv_cache_scored(config),
        "rate": config.rate is not None and engine.kind == "in-process",
        "prefix_cache": config.prefix_cache and engine.prefix_cache is not None,
        "dtype": config.engine == "llamacpp" and config.dtype not in ("auto", "float16"),
    }


def _apply(config: Config, changes: dict) -> Config:
    """A step's changes on top of the configuration before it: a concurrency without a rate goes
    back to closed loop (N in flight)."""
    if "concurrency" in changes and "rate" not in changes:
        changes = {**changes, "rate": None}
    return dataclasses.replace(config, **changes)


def adds(step: Step, index: int) -> str:
    """What a step adds, in words, for the ledger."""
    if index == 0:
        return "the start"
    words = {"prefix_cache": lambda on: f"prefix cache {'on' if on else 'off'}", "rate": lambda r: f"rate {r:g}/s"}
    said = [words.get(k, lambda v, k=k: f"{k} {v}")(getattr(step, k)) for k in KNOBS if getattr(step, k) is not None]
    if step.source:
        said = [f"{s} of {step.source}" if s.startswith("model ") else s for s in said]
    return ", ".join(said)


# ---------------------------------------------------------------------------------------------
# Models


def resolve_models(
    stack: StackFile, steps: list[Config], tracker: Tracker, experiment: str | None, outputs: Path
) -> tuple[ResolvedModel, dict[str | None, Resolved]]:
    """The base model and each step's model: `run:ID` read from the store, `recipe:NAME` from its
    newest finished run in the experiment made from the same source (the stack's base, or the
    model of the step named by `source:`), run now through the quantize pipeline when there is
    none; a directory as it is. Bad references are refused before any recipe runs; the recipes
    then run in step order (a student before the recipe that quantizes it)."""
    from quantbench.jobs import pipeline, prepare
    from quantbench.recipe import load_recipe
    from quantbench.sources import models
    from quantbench.sources.checkpoint import check_loadable, resolve_target

    base = models.resolve(stack.base, field="base", experiment=experiment)
    found: dict[str | None, Resolved] = {None: Resolved(base.path, label=models.short_name(stack.base))}
    found[BASE] = found[None]
    pending: list[Config] = []
    problems: list[str] = []
    wanted = {c.model_key: c for c in steps if c.model is not None}
    for c in steps:  # a draft named by reference (not by an earlier step) is resolved like a step's model
        if c.draft is not None and c.draft != BASE and c.draft not in wanted:
            wanted[c.draft] = Config(c.engine, c.dtype, c.draft, 1)
    for config in wanted.values():
        ref, key = config.model, config.model_key
        assert ref is not None and key is not None
        if ref.startswith("recipe:"):
            name = ref.removeprefix("recipe:")
            source = _source_of(config, found, stack.base)
            runs = (
                []
                if source is None
                else tracker.search({TAG + "recipe": name, TAG + "role": "candidate", TAG + "base_model": source})
            )
            if runs:
                found[key] = _from_run(runs[0].info.run_id, tracker, ref, stack.base)
            else:
                try:
                    loaded = load_recipe(resolve_recipe_path(name))
                    problems += [f"model {ref}: {p}" for p in prepare.check_without_model(loaded, experiment)]
                except UserError as exc:
                    problems += [f"model {ref}: {p}" for p in exc.problems]
                pending.append(config)
            continue
        try:
            target = resolve_target(ref.removeprefix("run:"), tracker, stack.base)
            check_loadable(target.checkpoint)
        except UserError as exc:
            problems += [f"model {ref}: {p}" for p in exc.problems]
            continue
        run_id = target.run_id
        found[key] = _from_run(run_id, tracker, ref, stack.base) if run_id else Resolved(target.checkpoint, label=ref)
    if problems:
        raise UserError(problems)
    for config in pending:
        ref, name = config.model or "", (config.model or "").removeprefix("recipe:")
        source = _source_of(config, found, stack.base)
        assert source is not None  # the step it starts from ran before it
        log.info("stack: %s from %s has no finished run in this experiment: running it now "
                 "(quantbench quantize %s --set model.source=%s)", ref, source, name, source)  # fmt: skip
        # the stack measures speed itself: the recipe's bench stage is left out
        result = pipeline.quantize(
            name, overrides=(f"model.source={source}", "bench=null"), outputs=outputs, experiment=experiment
        )
        found[config.model_key] = _from_run(result.run_id, tracker, ref, stack.base)
    return base, found


def _source_of(config: Config, found: dict[str | None, Resolved], base: str) -> str | None:
    """The model.source a recipe step's recipe starts from: the stack's base, or the model of the
    step it names (`run:ID` of that model's run, or its directory); None while that model's recipe
    has not run yet."""
    if config.source is None:
        return base
    earlier = found.get(config.source)
    if earlier is None:
        return None
    return f"run:{earlier.run_id}" if earlier.run_id else str(earlier.path)


def _from_run(run_id: str, tracker: Tracker, ref: str, base: str) -> Resolved:
    from quantbench.sources.checkpoint import check_loadable, resolve_target

    target = resolve_target(run_id, tracker, None)
    check_loadable(target.checkpoint)
    run = tracker.get(run_id, ref)
    run_base = run.data.tags.get(TAG + "base_model", "")
    return Resolved(
        target.checkpoint, run_id, dict(run.data.metrics), f"{ref} ({run.info.run_name})",
        base=run_base if run_base != base else None,
    )  # fmt: skip


def quality_of(resolved: Resolved) -> dict | None:
    """The quality figure a model's run carries against the base: {metric, label, value, ci}."""
    if resolved.base is not None:  # its run measured it against another model: no figure against the base
        return None
    for key, label in QUALITY_KEYS:
        if key in resolved.metrics:
            low, high = resolved.metrics.get(key + LOW), resolved.metrics.get(key + HIGH)
            return {
                "metric": key,
                "label": label,
                "value": resolved.metrics[key],
                "ci": [low, high] if low is not None and high is not None else None,
            }
    return None


def _scoring_inputs(base: Path, workdir: Path) -> tuple[str, Path, Path]:
    """What llama-perplexity scores a model against the stack's base on: CHAIN_TOKENS of the
    held-out text, the base's F16 file, and the log both write to."""
    from transformers import AutoTokenizer

    from quantbench.engines import llamacpp
    from quantbench.sources import data

    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = tokenizer(data.python_docs("evaluation"))["input_ids"][:CHAIN_TOKENS]
    log_path = workdir / AGAINST_BASE_LOG
    return tokenizer.decode(ids, skip_special_tokens=True), llamacpp.base_gguf(base, log_path=log_path), log_path


def against_base(models_: dict[str | None, Resolved], workdir: Path, base: ResolvedModel, tracker: Tracker) -> None:
    """A model made from another step's model (a student quantized) carries its run's quality
    against *that* model; the ledger wants it against the stack's base. A GGUF one is scored here
    through llama.cpp (llama-perplexity's KL divergence against the base's F16 file, on
    CHAIN_TOKENS of the held-out text); any other through transformers, evaluated with the suite
    its run used (`evaluated_against_base`)."""
    from quantbench.engines import llamacpp
    from quantbench.sources.checkpoint import gguf_file

    chained = [r for r in models_.values() if r.base is not None]
    if not chained:
        return
    scoring = None
    for resolved in chained:
        gguf = gguf_file(resolved.path)
        log.info("stack: %s was measured against %s; scoring it against the base through %s",
                 resolved.label, resolved.base, "llama.cpp" if gguf else "transformers")  # fmt: skip
        try:
            if gguf is None:
                # the suite its own run was evaluated with
                suite = tracker.get(resolved.run_id).data.tags.get(TAG + "suite") if resolved.run_id else None
                resolved.metrics = evaluated_against_base(resolved.path, base, tracker, suite)
            else:
                scoring = scoring or _scoring_inputs(models_[None].path, workdir)
                text, base_file, log_path = scoring
                resolved.metrics = llamacpp.engine_quality(
                    base_file, gguf, text, CHAIN_WINDOW, workdir / "kld", log_path
                )
        except UserError as exc:  # the step is measured all the same; its quality stays unknown
            log.warning("stack: %s: no quality against the base: %s", resolved.label, "; ".join(exc.problems))
            continue
        resolved.base = None
        resolved.label += " (quality against the base measured by the stack)"


def evaluated_against_base(
    checkpoint: Path, base: ResolvedModel, tracker: Tracker, suite: str | None = None
) -> dict[str, float]:
    """A checkpoint's metrics against the base model with a suite (default: default), in
    transformers, as its own run's evaluate stage scores it against its source: KL divergence,
    top-1 agreement, perplexity, the suite's tasks and answer flips, with their intervals (the
    base's side from its baseline run, found in or added to `tracker`'s experiment). They go into
    the stack's ledger, never into the checkpoint's own run."""
    from transformers import AutoTokenizer

    from quantbench.core import hardware
    from quantbench.quality import stage
    from quantbench.quality.suite import DEFAULT_SUITE, load_suite
    from quantbench.sources.checkpoint import load_model

    tokenizer = AutoTokenizer.from_pretrained(base.path)
    plan = stage.prepare(load_suite(suite or DEFAULT_SUITE), tokenizer)
    model = load_model(checkpoint, dtype=hardware.compute_dtype_of(checkpoint))
    return stage.evaluate(model, tokenizer, base, plan, tracker).metrics


def kv_cache_scored(config: Config) -> bool:
    """Whether a step's KV-cache type can be served and its quality scored: through llama.cpp, the
    engine whose own tool (llama-perplexity) scores a model with that cache (vLLM's FP8 KV cache is
    measured by bench profiles, not by stacks)."""
    return config.engine == "llamacpp" and config.kv_cache in engines.get(config.engine).kv_cache_types


def kv_cache_quality(
    steps: list[Config], models_: dict[str | None, Resolved], workdir: Path
) -> dict[tuple[str | None, str], dict | None]:
    """A step that keeps its server's KV cache in a smaller type changes what the model computes:
    its model so served, scored against the base through llama.cpp (llama-perplexity's KL divergence
    with that KV-cache type against the base's F16 file with its 16-bit one, on CHAIN_TOKENS of the
    held-out text). {(model key, type): quality figure, or None where it cannot be scored}."""
    from quantbench.engines import llamacpp
    from quantbench.sources.checkpoint import gguf_file

    wanted = sorted({(c.model_key, c.kv_cache) for c in steps if c.kv_cache}, key=str)
    if not wanted:
        return {}
    text, base_file, log_path = _scoring_inputs(models_[None].path, workdir)
    out: dict[tuple[str | None, str], dict | None] = {}
    for key, kv_cache in wanted:
        resolved = models_[key]
        if resolved.base is not None and gguf_file(resolved.path) is None:
            out[(key, kv_cache)] = None  # measured against another model, and no GGUF to score here
            continue
        model_file = gguf_file(resolved.path) or llamacpp.base_gguf(resolved.path, log_path=log_path)
        log.info("stack: scoring %s with a %s KV cache against the base through llama.cpp", resolved.label or "the base",
                 kv_cache)  # fmt: skip
        flags = ["--cache-type-k", kv_cache, "--cache-type-v", kv_cache, "--flash-attn", "on"]
        try:
            metrics = llamacpp.engine_quality(
                base_file, model_file, text, CHAIN_WINDOW, workdir / "kld", log_path, flags
            )
        except UserError as exc:  # the step is measured all the same; its quality stays unknown
            log.warning(
                "stack: %s with a %s KV cache: no quality: %s", resolved.label, kv_cache, "; ".join(exc.problems)
            )
            out[(key, kv_cache)] = None
            continue
        out[(key, kv_cache)] = quality_of(Resolved(resolved.path, metrics=metrics)) | {
            "label": f"KLD (llama.cpp, {kv_cache} KV cache)"
        }
    return out


def check_engines(stack: StackFile, steps: list[Config], models_: dict[str | None, Resolved]) -> None:
    """Every step's model is one its engine serves here, said before anything starts."""
    problems = []
    for i, config in enumerate(steps):
        engine = engines.get(config.engine)
        path = models_[config.model_key].path
        why = engine.unavailable() or engine.unserved(path)
        if why:
            problems.append(f"steps.{i} ({stack.steps[i].name}): {engine.label} cannot serve {path} here: {why}")
    base = models_[None].path
    others = {str(models_[c.model_key].path) for c in steps if c.model is not None} - {str(base)}
    drafts = {str(models_[c.draft].path) for c in steps if c.draft is not None} - {str(base)} - others
    differ = _tokenizers_differ(sorted(others | drafts), base)
    problems += [
        f"model {p}: its tokenizer reads the prompts differently from the base model's ({base}); "
        "a stack compares models on the same tokens"
        for p in sorted(others & differ)
    ]
    problems += [
        f"model {p}: a draft: its tokenizer is not the target's (the base model's) ({base}); "
        "a draft must propose the target's tokens"
        for p in sorted(drafts & differ)
    ]
    if problems:
        raise UserError(problems)


def _tokenizers_differ(paths: list[str], base: Path) -> set[str]:
    """The models that do not read the prompts as the base does (other token ids for a sample)."""
    from transformers import AutoTokenizer

    from quantbench.sources import data

    if not paths:
        return set()
    sample = data.python_docs("evaluation")[:4000]
    want = AutoTokenizer.from_pretrained(base)(sample)["input_ids"]
    return {p for p in paths if AutoTokenizer.from_pretrained(p)(sample)["input_ids"] != want}


# ---------------------------------------------------------------------------------------------
# Measuring


@dataclass
class StepResult:
    name: str
    adds: str
    config: Config
    samples: dict[str, list[float]] = field(default_factory=dict)  # per round
    error: str | None = None

    @property
    def throughputs(self) -> list[float]:
        return self.samples.get(f"{self.config.level}/throughput_tok_s", [])


def _profile(workload: Workload, config: Config):
    from quantbench.speed.measure import Profile

    return Profile(
        prompt_tokens=[workload.prompt_tokens],
        output_tokens=workload.output_tokens,
        concurrency=[config.concurrency] if config.rate is None else [],
        request_rates=[config.rate] if config.rate is not None else [],
        requests_per_level=workload.level_requests(config.concurrency, config.rate),
        repetitions=1,
        warmup=0,
        seed=workload.seed,
        compile=workload.compile,
    )


def shared_prefix_prompts(token_ids: list[int], workload: Workload, count: int) -> list[list[int]]:
    """`count` prompts of the workload's length from the evaluation text; with `prefix_tokens`, each
    starts with the same tokens (from a place of their own) and goes on with its own."""
    from quantbench.speed.measure import prompts

    if not workload.prefix_tokens:
        return prompts(token_ids, workload.prompt_tokens, count, workload.seed)
    [shared] = prompts(token_ids, workload.prefix_tokens, 1, workload.seed + 1)
    own = prompts(token_ids, workload.prompt_tokens - workload.prefix_tokens, count, workload.seed)
    return [shared + tail for tail in own]


def _hf_load(path: Path, dtype: str, is_base: bool):
    import torch
    from transformers import AutoModelForCausalLM

    from quantbench.core import hardware
    from quantbench.sources.checkpoint import load_model

    if is_base:
        return lambda: AutoModelForCausalLM.from_pretrained(
            path, dtype="auto" if dtype == "auto" else getattr(torch, dtype)
        ).eval()
    return lambda: load_model(path, dtype=hardware.compute_dtype_of(path, dtype))


def measure(
    stack: StackFile, steps: list[Config], models_: dict[str | None, Resolved], logs_dir: Path
) -> list[StepResult]:
    """Every step in every round, in order; servers started once each (one after the other) and
    stopped at the end whatever happens. A step that fails is marked and left out of later rounds."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from quantbench.engines import ServerSettings
    from quantbench.engines.server import model_server
    from quantbench.sources import data
    from quantbench.speed.measure import hf_measurer
    from quantbench.speed.serving import openai_measurer

    workload = stack.workload
    tokenizer = AutoTokenizer.from_pretrained(models_[None].path)
    ids = tokenizer(data.python_docs("evaluation"))["input_ids"]
    rounds = workload.warmup + workload.repetitions
    # every round its own prompts, and a server that serves several steps other prompts for each of
    # them (drawn alike): a server never meets a prompt it has seen, so its prefix cache reuses only
    # the workload's shared prefix; steps on different servers (or in-process) share the prompts
    most = max(_profile(workload, c).prompts_per_repetition for c in steps) * rounds
    block = [
        0 if c.engine == "hf" else [x.server_key() for x in steps[:i]].count(c.server_key())
        for i, c in enumerate(steps)
    ]
    drawn = shared_prefix_prompts(ids, workload, most * (max(block) + 1))
    prompt_sets = [{workload.prompt_tokens: drawn[b * most : (b + 1) * most]} for b in block]
    results = [StepResult(s.name, adds(s, i), c) for i, (s, c) in enumerate(zip(stack.steps, steps))]
    with ExitStack() as servers:
        measurers = {}
        started: dict[tuple, tuple] = {}
        for i, config in enumerate(steps):
            resolved = models_[config.model_key]
            profile = _profile(workload, config)
            if config.engine == "hf":
                measurers[i] = hf_measurer(_hf_load(resolved.path, config.dtype, config.model is None), profile)
                continue
            key = config.server_key()
            if key not in started:
                engine = engines.get(config.engine)
                engine.ensure(f"stack step {stack.steps[i].name}")
                slots = max(c.concurrency for c in steps if c.server_key() == key)
                settings = ServerSettings(
                    workload.prompt_tokens + workload.output_tokens + 64,
                    compiled=workload.compile,
                    dtype=config.dtype,
                    slots=slots,
                    draft=models_[config.draft].path if config.draft else None,
                    kv_cache=config.kv_cache,
                    prefix_tokens=workload.prefix_tokens,
                )
                log_path = logs_dir / f"{len(started)}-{config.engine}.log"
                log.info("stack: starting %s for %s", engine.label, resolved.label or resolved.path)
                started[key] = (servers.enter_context(model_server(resolved.path, log_path, engine, settings)), engine)
            (url, model_name, pid), engine = started[key]
            measurers[i] = openai_measurer(
                url, model_name, tokenizer, profile, server_pid=pid, engine=engine, prefix_cache=config.prefix_cache
            )
        with tqdm(total=rounds * len(steps), desc="stack", unit="step", file=terminal()) as bar:
            for rnd in range(rounds):
                for i, result in enumerate(results):
                    bar.update(1)
                    if result.error:
                        continue
                    try:
                        values = measurers[i](prompt_sets[i], rnd)
                    except Exception as exc:  # that step fails; the others are kept
                        result.error = f"{type(exc).__name__}: {exc}"
                        log.error("stack: step %s failed in round %d: %s", result.name, rnd, result.error)
                        continue
                    if rnd >= workload.warmup:
                        for key, value in values.items():
                            result.samples.setdefault(key, []).append(value)
    return results


# ---------------------------------------------------------------------------------------------
# The ledger


def ledger(results: list[StepResult], qualities: list[dict | None], workload: Workload) -> dict:
    """Per step: throughput (median), its multiplier over the step before it and the cumulative one
    over the first, each with the interval of its paired rounds; the product of the step multipliers
    against the cumulative one measured directly."""
    from quantbench.speed.measure import summarize

    rows = []
    start = results[0].throughputs
    previous: StepResult | None = None
    product = 1.0
    for result, quality in zip(results, qualities):
        row: dict = {
            "step": result.name,
            "adds": result.adds,
            "engine": result.config.engine,
            "dtype": result.config.dtype,
            "model": (result.config.model or "base") + (f" of {result.config.source}" if result.config.source else ""),
            "concurrency": result.config.concurrency,
            "rate": result.config.rate,
            "draft": _draft_name(result.config.draft, results),
            "kv_cache": result.config.kv_cache,
            "prefix_cache": result.config.prefix_cache,
            "status": "failed" if result.error else "measured",
            "error": result.error,
            "quality": quality,
        }
        thr = result.throughputs
        if thr and not result.error:
            row["throughput_tok_s"] = statistics.median(thr)
            row["throughputs"] = thr  # per round
            # the streamed single request of each round (p<prompt tokens>/...) and the load level,
            # summarised as bench summarises them (medians; peak memory: the maximum)
            speed = summarize(result.samples, _profile(workload, result.config))
            row |= {k: speed[k] for k in ("decode_tok_s", "ttft_ms_p50", "e2e_ms_p50", "peak_mem_mb") if k in speed}
            level = result.config.level
            if any(result.samples.get(f"{level}/saturated", [])):  # arrivals beyond what the server keeps up with
                row["saturated"] = True
            if result.samples.get(f"{level}/spec_acceptance"):  # a draft: its tokens accepted at the load level
                row["spec_acceptance"] = statistics.median(result.samples[f"{level}/spec_acceptance"])
            for name in ("ttft_ms_p50", "ttft_ms_p95", "e2e_ms_p50", "e2e_ms_p95", "requests_s", "prompt_cached_share"):
                if f"{level}/{name}" in speed:
                    row[f"level_{name}"] = speed[f"{level}/{name}"]
            if previous is not None:
                row["multiplier"], row["multiplier_ci"] = _ratio(thr, previous.throughputs)
                product *= row["multiplier"]
            else:
                row["multiplier"], row["multiplier_ci"] = 1.0, None
            if start and not results[0].error:
                row["cumulative"], row["cumulative_ci"] = _ratio(thr, start)
            row["product"] = product
            previous = result
        rows.append(row)
    measured = [r for r in rows if "cumulative" in r]
    direct = measured[-1]["cumulative"] if measured else None
    last_product = measured[-1]["product"] if measured else None
    return {
        "steps": rows,
        "direct": direct,
        "product": last_product,
        "product_vs_direct": (last_product / direct) if direct and last_product else None,
    }


def _draft_name(key: str | None, results: list[StepResult]) -> str | None:
    """A draft as the ledger shows it: the first step that serves its model, else its reference."""
    if key is None:
        return None
    if key == BASE:
        return "base"
    return next((r.name for r in results if r.config.model_key == key), key)


def _ratio(values: list[float], against: list[float]) -> tuple[float, list[float] | None]:
    """The median of the per-round ratios (round r of one step over round r of the other, measured
    back to back) and their 95 % interval; median over median where the rounds do not pair."""
    pairs = [a / b for a, b in zip(values, against) if b > 0]
    if len(pairs) != len(values) or len(values) != len(against):
        return statistics.median(values) / statistics.median(against), None
    interval = ratio_interval(pairs) if len(pairs) >= 3 else None
    return statistics.median(pairs), list(interval) if interval else None


def policy_checks(policy, quality_metrics: dict[str, float]) -> tuple[bool, list[str]]:
    """The policy's quality checks (not its speed, stage or licence ones) on a model's run."""
    from quantbench.release import gate

    try:
        checks = gate.quality_checks(policy, quality_metrics)
    except gate.MissingInterval as exc:
        return False, [f"{exc} (logged without its interval)"]
    return all(c.passed for c in checks), [c.check for c in checks if not c.passed]


def table(report: dict) -> str:
    """The ledger for a terminal or Markdown: one row per step."""
    from tabulate import tabulate

    def interval(ci) -> str:
        return f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""

    rows = []
    for r in report["steps"]:
        q = r.get("quality")
        quality = (
            "—"
            if q is None
            else f"{q['label']} {q['value']:.4g}" + (f" [{q['ci'][0]:.4g}, {q['ci'][1]:.4g}]" if q.get("ci") else "")
        )
        row = [
            r["step"],
            r["adds"],
            f"{r['engine']} · {r['model']} · "
            + (f"{r['rate']:g}/s (≤ {r['concurrency']} at once)" if r.get("rate") else f"c{r['concurrency']}")
            + (
                " · prefix cache"
                + (f" (reused {r['level_prompt_cached_share']:.0%})" if "level_prompt_cached_share" in r else "")
                if r.get("prefix_cache")
                else ""
            )
            + (
                f" · draft {r['draft']}" + (f" (accepted {r['spec_acceptance']:.0%})" if "spec_acceptance" in r else "")
                if r.get("draft")
                else ""
            )
            + (f" · KV {r['kv_cache']}" if r.get("kv_cache") else ""),
            f"{r['throughput_tok_s']:.1f}" + (" (saturated)" if r.get("saturated") else "")
            if "throughput_tok_s" in r
            else "FAILED",
            f"{r['multiplier']:.2f}×{interval(r.get('multiplier_ci'))}" if "multiplier" in r else "—",
            f"{r['cumulative']:.2f}×{interval(r.get('cumulative_ci'))}" if "cumulative" in r else "—",
            quality,
        ]
        if "policy_passed" in r:
            row.append(
                "pass"
                if r["policy_passed"]
                else "fail: " + ", ".join(r["policy_failed"])
                if r["policy_failed"]
                else "—"
            )
        rows.append(row)
    headers = ["step", "adds", "engine · model · concurrency", "tok/s", "× step", "× cumulative", "quality vs base"]
    if any("policy_passed" in r for r in report["steps"]):
        headers.append(f"policy {report.get('policy')}")
    text = tabulate(rows, headers=headers, tablefmt="github")
    if report.get("direct"):
        text += (
            f"\n\nlast step over the first, measured directly: {report['direct']:.2f}×; "
            f"product of the step multipliers: {report['product']:.2f}× "
            f"({(report['product_vs_direct'] - 1) * 100:+.1f} %)"
        )
    if "best" in report:
        b = report["best"]
        if b is None:
            text += f"\n\n--best: no subset of the steps passes the policy {report.get('policy')}"
        elif "cumulative" in b:
            text += (
                f"\n\nfastest stack passing {report.get('policy')}: {' → '.join(b['steps'])}: "
                f"{b['cumulative']:.2f}×{interval(b.get('cumulative_ci'))} over the start, measured"
                + (f" (step {b['measured_as']})" if b["measured_as"] != "measured now" else " in rounds of its own")
                + f"; predicted from the step multipliers {b['predicted_cumulative']:.2f}×"
            )
        else:
            text += f"\n\nfastest stack passing {report.get('policy')}: {' → '.join(b['steps'])}: not measured ({b.get('error')})"
    if report.get("device"):
        text += f"\nmeasured on: {report['device']}"
    return text


def waterfall(report: dict, path: Path, title: str) -> Path | None:
    """The cumulative multiplier per step (log scale), each bar labelled with its step multiplier
    and the quality cost so far."""
    rows = [r for r in report["steps"] if "cumulative" in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4.5), dpi=110)
    xs = range(len(rows))
    values = [r["cumulative"] for r in rows]
    colors = ["tab:green" if r.get("multiplier", 1) >= 1 else "tab:red" for r in rows]
    ax.bar(xs, values, color=colors)
    for x, r in zip(xs, rows):
        q = r.get("quality")
        note = f"×{r['multiplier']:.2f}" + (f"\n{q['label']} {q['value']:.3g}" if q else "")
        ax.annotate(note, (x, r["cumulative"]), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    ax.set_xticks(list(xs), [r["step"] for r in rows], rotation=20, ha="right")
    ax.set_yscale("log")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("output throughput over the first step (×, log)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# --best: the fastest subset of the steps whose model passes the policy


def compose(stack: StackFile, steps: list[Config], keep: tuple[int, ...]) -> Config:
    """The configuration of the start plus the steps `keep` (in order): each knob as the last kept
    step that sets it leaves it (a model keeps the source it was made from)."""
    config = steps[0]
    for i in keep:
        changes = {k: getattr(steps[i], k) for k in KNOBS if getattr(stack.steps[i], k) is not None}
        if "model" in changes:
            changes["source"] = steps[i].source
        config = _apply(config, changes)
    return config


def best_subset(
    stack: StackFile, steps: list[Config], report: dict, models_: dict[str | None, Resolved]
) -> dict | None:
    """Every subset of the steps after the start (order kept) whose configuration the engines serve
    and whose model passes the policy, predicted as the start's throughput times the kept steps'
    multipliers; the highest prediction wins. Stacks do not simply multiply, so the winner is then
    measured (`run` does it) unless it is one of the steps already measured. None: no subset passes."""
    import itertools

    rows = report["steps"]
    if "throughput_tok_s" not in rows[0]:
        return None
    serves: dict[tuple[str, str | None], bool] = {}
    candidates = []
    later = range(1, len(steps))
    for size in range(len(steps)):
        for keep in itertools.combinations(later, size):
            if any("multiplier" not in rows[i] for i in keep):
                continue  # a failed step: nothing to predict from
            config = compose(stack, steps, keep)
            if any(refusals(config).values()):
                continue
            key = (config.engine, config.model_key)
            if key not in serves:
                engine = engines.get(config.engine)
                serves[key] = not (engine.unavailable() or engine.unserved(models_[config.model_key].path))
            if not serves[key]:
                continue
            # whose quality it has: the last kept step that set the model or the KV cache (a KV cache
            # kept from before a later model's step: that model's quality, without the cache's cost)
            setter = max([0] + [i for i in keep if stack.steps[i].model is not None or stack.steps[i].kv_cache])
            if not rows[setter].get("policy_passed", False):
                continue
            predicted = rows[0]["throughput_tok_s"] * math.prod(rows[i]["multiplier"] for i in keep)
            candidates.append((predicted, keep, config))
    if not candidates:
        return None
    predicted, keep, config = max(candidates, key=lambda c: (c[0], -len(c[1])))
    found = {
        "steps": [stack.steps[i].name for i in (0, *keep)],
        "predicted_tok_s": predicted,
        "predicted_cumulative": predicted / rows[0]["throughput_tok_s"],
    }
    same = [i for i, c in enumerate(steps) if c == config and "cumulative" in rows[i]]
    if same:
        row = rows[same[0]]
        found |= {"measured_as": stack.steps[same[0]].name, "throughput_tok_s": row["throughput_tok_s"],
                  "cumulative": row["cumulative"], "cumulative_ci": row.get("cumulative_ci")}  # fmt: skip
    else:
        found["config"] = dataclasses.asdict(config)
    return found


# ---------------------------------------------------------------------------------------------
# The command


@dataclass
class StackOutcome:
    run_id: str
    report: dict
    failed: list[str]

    def summary(self) -> dict:
        return {"run_id": self.run_id, **self.report}


def run(
    name: str,
    *,
    policy: str | None = None,
    best: bool = False,
    experiment: str | None = None,
    outputs: Path = Path("outputs"),
) -> StackOutcome:
    """Load and check the stack (exit 2 on any problem, before anything runs), run the recipes it
    names that have no run yet, measure every step, log the ledger. `best` (needs a policy): also
    the fastest subset of the steps whose model passes it, measured."""
    import shutil

    from quantbench.core import environment, hardware
    from quantbench.release import gate

    if best and not policy:
        raise UserError("--best: the fastest stack that passes what? Name the policy too (--policy release)")
    tracker = Tracker(experiment)  # the runs the steps name are looked up while the file is checked
    stack, steps = load(name, tracker)
    loaded_policy = gate.load_policy(policy) if policy else None
    base, models_ = resolve_models(stack, steps, tracker, experiment, outputs)
    check_engines(stack, steps, models_)
    stack_name = Path(name).stem
    logs_dir = Path(tempfile.mkdtemp(prefix="qb-stack-"))
    try:  # the servers' and tools' logs, logged as artifacts, then removed
        against_base(models_, logs_dir, base, tracker)
        kv = kv_cache_quality(steps, models_, logs_dir)
        qualities = [
            kv[(c.model_key, c.kv_cache)] if c.kv_cache else quality_of(models_[c.model_key]) if c.model else None
            for c in steps
        ]
        parent = tracker.start_run(
            f"stack {stack_name}",
            {TAG + "role": "stack", TAG + "stack": stack_name, TAG + "base_model": stack.base},
        )
        failed: list[str] = []
        with parent:
            parent.log_params({"workload": stack.workload.model_dump(mode="json"), "steps": len(steps)})
            try:
                results = measure(stack, steps, models_, logs_dir)
            finally:
                for path in sorted(logs_dir.glob("*.log")):  # and llama-perplexity's, scoring a model against the base
                    parent.log_artifact(path, "quality" if path.name == AGAINST_BASE_LOG else "servers")
            report = ledger(results, qualities, stack.workload)
            report |= {
                "stack": stack_name,
                "base": stack.base,
                "workload": stack.workload.model_dump(mode="json"),
                "device": hardware.device_line(),  # the CPU class (or GPU) every figure here holds for
                "hardware": environment.describe(),
            }
            if loaded_policy is not None:
                report["policy"] = loaded_policy.name
                for row, config in zip(report["steps"], steps):
                    resolved = models_[config.model_key]
                    metrics = resolved.metrics if config.model else {}
                    if config.model is None:  # the base model: the reference the quality limits are measured from
                        row["policy_passed"], row["policy_failed"] = True, []
                    elif resolved.base is not None:
                        row["policy_passed"], row["policy_failed"] = (
                            False,
                            [f"quality known against {resolved.base} only"],
                        )
                    elif not metrics:
                        row["policy_passed"], row["policy_failed"] = False, ["no quantbench run: quality unknown"]
                    else:
                        row["policy_passed"], row["policy_failed"] = policy_checks(loaded_policy.policy, metrics)
            if best:
                report["best"] = best_subset(stack, steps, report, models_)
                if report["best"] and "config" in report["best"]:
                    report["best"] |= _measure_best(
                        stack, steps[0], Config(**report["best"]["config"]), models_, logs_dir
                    )
                    for path in sorted((logs_dir / "best").glob("*.log")):
                        parent.log_artifact(path, "servers/best")
            for i, (row, result) in enumerate(zip(report["steps"], results)):
                tags = {
                    TAG + "role": "stack_step",
                    TAG + "stack": stack_name,
                    TAG + "stack_step": f"{i}:{result.name}",
                    TAG + "bench_server": result.config.engine,
                    "mlflow.parentRunId": parent.run_id,
                }
                model_run = models_[result.config.model_key].run_id if result.config.model else None
                if model_run:
                    tags[TAG + "stack_model_run"] = model_run
                child = tracker.start_run(f"{i}. {result.name} · {result.adds}", tags)
                try:
                    with child:
                        child.log_params(dataclasses.asdict(result.config))
                        child.log_metrics(_step_metrics(row))
                        if result.error:
                            raise RuntimeError(result.error)
                except RuntimeError:
                    failed.append(result.name)
                parent.log_metrics(
                    {
                        f"stack/{result.name}/{k}": v
                        for k, v in (("multiplier", row.get("multiplier")), ("cumulative", row.get("cumulative")))
                        if v is not None
                    }
                )
            summary = {"stack/direct": report["direct"], "stack/product": report["product"]}
            if report.get("best") and "cumulative" in report["best"]:
                summary["stack/best_cumulative"] = report["best"]["cumulative"]
            parent.log_metrics({k: v for k, v in summary.items() if v is not None})
            parent.log_dict(report, "stack.json")
            text = table(report)
            parent.log_text(f"# Stack {stack_name}\n\n{stack.description}\n\n{text}\n", "stack.md")
            with tempfile.TemporaryDirectory() as tmp:
                plot = waterfall(report, Path(tmp) / PLOT, f"stack {stack_name} · {stack.base}")
                if plot:
                    parent.log_artifact(plot)
            report["failed"] = failed
        return StackOutcome(parent.run_id, report, failed)
    finally:
        shutil.rmtree(logs_dir, ignore_errors=True)


def _measure_best(
    stack: StackFile, start: Config, config: Config, models_: dict[str | None, Resolved], logs_dir: Path
) -> dict:
    """The best subset measured against the start, in rounds of their own (as the steps were)."""
    log.info("stack --best: measuring %s against the start", config)
    pair = stack.model_copy(update={"steps": [stack.steps[0], Step(name="best")]})
    (logs_dir / "best").mkdir(exist_ok=True)
    start_result, best_result = measure(pair, [start, config], models_, logs_dir / "best")
    if best_result.error or start_result.error or not best_result.throughputs:
        return {"error": best_result.error or start_result.error}
    cumulative, ci = _ratio(best_result.throughputs, start_result.throughputs)
    return {"measured_as": "measured now", "throughput_tok_s": statistics.median(best_result.throughputs),
            "cumulative": cumulative, "cumulative_ci": ci}  # fmt: skip


def _step_metrics(row: dict) -> dict[str, float]:
    out = {}
    for key in ("throughput_tok_s", "decode_tok_s", "ttft_ms_p50", "e2e_ms_p50", "peak_mem_mb", "spec_acceptance"):
        if key in row:
            out[f"speed/{key}"] = row[key]
    for key in ("multiplier", "cumulative"):
        if key in row:
            out[f"stack/{key}"] = row[key]
            if row.get(f"{key}_ci"):
                out[f"stack/{key}{LOW}"], out[f"stack/{key}{HIGH}"] = row[f"{key}_ci"]
    return {k: v for k, v in out.items() if v is not None and math.isfinite(v)}
