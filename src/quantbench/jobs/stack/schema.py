"""The stack file (stacks/NAME.yaml), checked, and each step's full configuration.

A stack file names a base model, a workload (prompt and output lengths, requests, repetitions) and
an ordered list of steps. The first step is the naive start; every later step changes one or more
of `engine`, `dtype`, `model`, `concurrency` (or an open-loop `rate`), `draft`, `kv_cache` and
`prefix_cache` and keeps everything else from the steps before it, so each step adds its
techniques on top of all the earlier ones:

    steps:
      - {name: naive, engine: hf, dtype: float32}      # in-process transformers generate
      - {name: llama.cpp, engine: llamacpp}           # a serving engine (the base as an F16 GGUF)
      - {name: int4, model: recipe:gguf-q4_0}         # a quantized checkpoint (run first if never run)
      - {name: batching, concurrency: 8}              # 8 requests in flight (continuous batching)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, field_validator, model_validator

from quantbench import engines
from quantbench.core.errors import UserError, did_you_mean
from quantbench.recipe import DEFAULT_MODEL, CheckedFile, check_file, named_path, resolve_recipe_path
from quantbench.recipe.common import Strict
from quantbench.sources.checkpoint import RUN_ID
from quantbench.speed.serving import level_name
from quantbench.tracking import Tracker, tracking_uri

# what a step can change
KNOBS = ("engine", "dtype", "model", "concurrency", "rate", "draft", "kv_cache", "prefix_cache")
BASE = "<base>"  # a draft that is the base model (a step serving the base named as the draft)


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
        if value is not None and value not in engines.local():
            raise ValueError(f"unknown engine '{value}'. Available: {', '.join(engines.local())}")
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


@dataclass
class _Said:
    """The problems found in a stack file's steps, each said with where it is."""

    stack: StackFile
    checked: CheckedFile
    skip: set[int]  # steps with a schema problem: at their defaults here, so nothing more is said of them
    problems: list[str] = field(default_factory=list)

    def at(self, i: int, knob: str | None = None) -> str:
        """`stacks/x.yaml: steps.2 (int4, line 7)`: a step, and the line of the knob said (or of the step)."""
        line = (knob and self.checked.line("steps", i, knob)) or self.checked.line("steps", i)
        return f"{self.checked.path}: steps.{i} ({self.stack.steps[i].name}" + (f", line {line})" if line else ")")

    def say(self, i: int, problem: str | None) -> None:
        if problem is not None and i not in self.skip:
            self.problems.append(problem)


def configs(stack: StackFile, checked: CheckedFile, tracker: Tracker | None = None) -> tuple[list[Config], list[str]]:
    """Each step's configuration (its changes over the steps before it) and the step list's problems."""
    # steps and sections with a schema problem are at their defaults here: what would be said of them is of the
    # defaults, not of what the file says
    skip = {loc[1] for loc in checked.invalid if len(loc) > 1 and loc[0] == "steps" and isinstance(loc[1], int)}
    workload_given = not any(loc[:1] == ("workload",) for loc in checked.invalid)
    said = _Said(stack, checked, skip)
    current = _first_config(said, tracker)
    out = [current]
    seen = {stack.steps[0].name: 0}
    for i, step in enumerate(stack.steps[1:], start=1):
        if step.name in seen:
            line = checked.line("steps", i, "name")
            said.say(i, f"{checked.path}: steps.{i}.name{f' (line {line})' if line else ''}: '{step.name}' is also "
                        f"step {seen[step.name]}'s name")  # fmt: skip
        seen.setdefault(step.name, i)
        current = _step_config(said, i, current, out, seen, tracker)
        out.append(current)
    for i, config in enumerate(out):
        _refusals(said, i, config, out[i - 1] if i else None, workload_given)
    return out, said.problems


def _first_config(said: _Said, tracker: Tracker | None) -> Config:
    """The naive start: the first step names its engine and nothing earlier."""
    first = said.stack.steps[0]
    if first.engine is None:
        said.say(0, f"{said.at(0)}: the first step is the naive start: name its engine (e.g. hf)")
    for knob in ("source", "draft"):
        if getattr(first, knob) is not None:
            said.say(
                0,
                f"{said.at(0, knob)}: {knob}: the first step is the naive start; it names no earlier step's model "
                "(make it a step of its own)",
            )
    if first.model is not None:
        said.say(0, _model_problem(said.at(0, "model"), "model", first.model, tracker))
    return Config(
        first.engine or engines.in_process(),
        first.dtype or "auto",
        first.model,
        first.concurrency or 1,
        rate=first.rate,
        prefix_cache=bool(first.prefix_cache),
    )


def _step_config(
    said: _Said, i: int, current: Config, out: list[Config], seen: dict[str, int], tracker: Tracker | None
) -> Config:
    """Step i's configuration: the one before it with the step's changes (an earlier step's name for
    a model's source or a draft stands for that step's model)."""
    step = said.stack.steps[i]
    names = [s.name for s in said.stack.steps]
    earlier = [n for n, j in seen.items() if j < i]
    source = _source(said, i, out, seen, earlier)
    if step.model is not None:
        said.say(i, _model_problem(said.at(i, "model"), "model", step.model, tracker))
    changes = {k: getattr(step, k) for k in KNOBS if getattr(step, k) is not None}
    if step.draft is not None:  # an earlier step's name stands for its model
        if seen.get(step.draft, i) < i:
            changes["draft"] = out[seen[step.draft]].model_key or BASE
        elif step.draft in names:
            said.say(i, f"{said.at(i, 'draft')}: draft: '{step.draft}' is step {names.index(step.draft)}, not an "
                        "earlier one: a draft is a model served before it")  # fmt: skip
        else:
            said.say(i, _model_problem(said.at(i, "draft"), "draft", step.draft, tracker, earlier))
    key = f"{step.model}@{source}" if source else step.model
    same = [k for k, v in changes.items() if (current.model_key == key if k == "model" else getattr(current, k) == v)]
    if not changes:
        said.say(i, f"{said.at(i)}: changes nothing; set one of {', '.join(KNOBS)}")
    elif len(same) == len(changes):
        said.say(
            i,
            f"{said.at(i, same[0])}: {', '.join(f'{k}: {changes[k]}' for k in same)} is what the steps before it "
            "already use; a step must add something",
        )
    if "model" in changes:
        changes["source"] = source
    return _apply(current, changes)


def _source(said: _Said, i: int, out: list[Config], seen: dict[str, int], earlier: list[str]) -> str | None:
    """The model key of the earlier step whose model step i's recipe starts from (`source:`), if any."""
    step = said.stack.steps[i]
    if step.source is None:
        return None
    if not (step.model or "").startswith("recipe:"):
        said.say(
            i,
            f"{said.at(i, 'source')}: source: names the model a recipe starts from; it needs model: recipe:NAME "
            "in the same step",
        )
    elif step.source not in seen or seen[step.source] == i:
        said.say(
            i,
            f"{said.at(i, 'source')}: source: '{step.source}' is not an earlier step."
            + did_you_mean(step.source, earlier),
        )
    elif out[seen[step.source]].model is None:
        said.say(
            i,
            f"{said.at(i, 'source')}: source: step '{step.source}' serves the base model, which a recipe starts "
            "from anyway; leave source out",
        )
    else:
        return out[seen[step.source]].model_key
    return None


def _refusals(said: _Said, i: int, config: Config, before: Config | None, workload_given: bool) -> None:
    """What step i's engine cannot apply, each said once: where the knob meets an engine that cannot
    apply it (not again for each later step)."""
    engine = engines.get(config.engine)
    refused = {k for k, no in refusals(config).items() if no and not (before and refusals(before)[k])}
    at = said.at
    if "draft" in refused:
        said.say(
            i,
            f"{at(i, 'draft')}: draft: speculative decoding through {engine.label}: {engine.drafts}; a draft step "
            "needs engine " + " or ".join(n for n in engines.local() if engines.get(n).drafts is None),
        )
    if "kv_cache" in refused:
        offered = engine.kv_cache_types
        said.say(
            i,
            f"{at(i, 'kv_cache')}: kv_cache {config.kv_cache}: {engine.label} "
            + (f"takes {', '.join(offered)}" if offered else "takes no KV-cache type through quantbench")
            + "; a kv_cache step needs engine "
            + " or ".join(
                f"{e.name} ({_largest_and_smallest(e.kv_cache_types)}, ...: its quality is scored with "
                f"{e.label}'s tools)"
                for e in engines.every()
                if e.scores_kv_cache
            ),
        )
    if "rate" in refused:
        said.say(
            i,
            f"{at(i, 'rate')}: rate {config.rate:g}: requests arriving at a rate need a server; {engine.label} "
            "runs in-process (one batched generate)",
        )
    if "prefix_cache" in refused:
        said.say(
            i,
            f"{at(i, 'prefix_cache')}: prefix_cache: {engine.label} {engine.prefix_cache}; a prefix_cache step "
            "needs engine " + " or ".join(n for n in engines.local() if engines.get(n).prefix_cache is None),
        )
    if said.stack.steps[i].prefix_cache and not said.stack.workload.prefix_tokens and workload_given:
        said.say(
            i,
            f"{at(i, 'prefix_cache')}: prefix_cache: the workload's prompts share no prefix, so there is nothing "
            "to reuse; set workload.prefix_tokens (e.g. 96 of 128: a system prompt)",
        )
    if "dtype" in refused:
        said.say(
            i,
            f"{at(i, 'dtype')}: dtype {config.dtype}: llama.cpp serves a model's own GGUF file, the base model as "
            "an F16 file; dtype applies to hf, transformers and vllm",
        )


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
        "dtype": engine.dtypes is not None and config.dtype not in engine.dtypes,
    }


def _largest_and_smallest(types: tuple[str, ...]) -> str:
    """An engine's smaller KV-cache types, the largest and the smallest (its list runs largest first)."""
    smaller = [t for t in types if t not in ("f16", "bf16", "float16", "bfloat16")]
    return ", ".join(dict.fromkeys([smaller[0], smaller[-1]])) if smaller else "none"


def kv_cache_scored(config: Config) -> bool:
    """Whether a step's KV-cache type can be served and its quality scored: through llama.cpp, the
    engine whose own tool (llama-perplexity) scores a model with that cache (vLLM's FP8 KV cache is
    measured by bench profiles, not by stacks)."""
    engine = engines.get(config.engine)
    return engine.scores_kv_cache and config.kv_cache in engine.kv_cache_types


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
