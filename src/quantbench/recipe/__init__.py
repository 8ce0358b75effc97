"""Recipe files: the pydantic schema, loading with every error at once, and a content hash. The
`quantize:` section's classes, one per method, are in recipe/methods.py.

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

import copy
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import (
    Any,
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
    Field,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from quantbench import engines
from quantbench.core import hardware
from quantbench.core.errors import UserError, did_you_mean
from quantbench.core.files import canonical_sha
from quantbench.core.settings import parse_yaml, read_settings
from quantbench.recipe.common import DEFAULT_TEXT, Strict
from quantbench.recipe.methods import METHODS, QuantizeSpec

DEFAULT_MODEL = "builtin:smollm2-135m-instruct"
log = logging.getLogger(__name__)
QUOTE_CHARS = 80  # an error message quotes at most this much of a value


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
    # engine); serve: a server, the first that serves the format. One of engines.engine_choices()
    # less openai (a recipe starts its own servers). `backend:`, its old name, is still read.
    engine: str = "auto"

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "backend" in data:
            if "engine" in data:
                raise ValueError("backend is the old name of engine: give engine alone")
            log.warning("bench.backend is deprecated; it is now called bench.engine")
            data = {("engine" if k == "backend" else k): v for k, v in data.items()}
        return data

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        choices = [b for b in engines.engine_choices() if b != "openai"]
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
        if resolved.get("bench"):  # hashed under bench.engine's old name: a recipe's sha is what it was
            resolved["bench"] = {("backend" if k == "engine" else k): v for k, v in resolved["bench"].items()}
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
    applied: Sequence[tuple[tuple[str, ...], str]] = (),
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


def _message(err: Mapping[str, Any], loc: tuple, data: dict, schema: type[BaseModel]) -> str:
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
                cls = METHODS.get(method) if isinstance(method, str) else None
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return []
    return list(cls.model_fields)
