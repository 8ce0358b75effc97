"""`quantbench gate <run id> --policy release`: pass or fail a candidate against a policy, and on
pass promote its checkpoint in the MLflow Model Registry.

Every check is computed on the raw logged values (rounding only for display) with the direction
each metric has in the catalogue (`metrics.py`), and every check is reported, passed or not, in one
table. On pass: the checkpoint is logged as the run's `checkpoint/` artifact (unless the job did so
already, as it does against a tracking server; then the checkpoint need not be on this machine),
registered as a new version of the policy's registered model, and the policy's alias (`champion`)
moved to it; the version it replaces keeps a second alias (`previous`). On fail nothing in the
registry moves.
Either way the report is an artifact of the run (`gate/<policy>-<time>.json` and `.md`) and the
outcome a run tag (`quantbench.gate.<policy>`).

A check may hold a bound of the metric's 95 % interval to the limit instead of its value
(`max: {quality/kld_mean: {value: 0.10, on: ci_high}}`: the upper end must be under 0.10), so a
verdict does not flip on noise (docs/intervals.md). Naming an interval a metric cannot have, or
one the run did not log, is bad input (exit 2).
"""

from __future__ import annotations

import logging
import string
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from quantbench import metrics as catalogue
from quantbench.core import intervals, tables
from quantbench.core.errors import UserError
from quantbench.core.files import canonical_sha
from quantbench.engines import formats, vllm_env
from quantbench.recipe import load_named
from quantbench.recipe.common import Strict
from quantbench.release import names
from quantbench.sources import models
from quantbench.sources.checkpoint import ARTIFACT, RUN_ID, upload
from quantbench.tracking import TAG, Registry, Tracker, tracking_uri

log = logging.getLogger(__name__)

Stage = Literal["quantize", "evaluate", "bench"]
# What shows that a stage ran to the end in a run: a metric it always logs.
STAGE_EVIDENCE = {"quantize": "quantize/wall_s", "evaluate": "quality/kld_mean", "bench": "speedup/decode_tok_s"}
NAME_FIELDS = ("base_model", "recipe", "method", "scheme")
SPEED_FAMILIES = ("speedup/", "speed/", "base_speed/")
# The note of a check whose limit holds an end of an interval the run did not log (missing_interval="fail")
NO_INTERVAL = "logged without its 95 % interval"


class Register(Strict):
    """Where a passing checkpoint goes in the MLflow Model Registry."""

    model: str = Field(
        "{base_model}", description="registered model name; may use {base_model} {recipe} {method} {scheme}"
    )
    alias: str = "champion"
    previous_alias: str | None = Field("previous", description="alias kept on the version the new one replaces")


class Bound(Strict):
    """A limit held against the metric's value (the plain form) or against one end of its 95 %
    interval: `{value: 0.10, on: ci_high}` under max: the upper end must be at most 0.10."""

    value: float
    on: Literal["value", "ci_low", "ci_high"] = "value"

    @model_validator(mode="before")
    @classmethod
    def _yaml_on(cls, data):
        """YAML 1.1 reads the bare key `on` as the boolean true: take it back as the name it is."""
        if isinstance(data, dict) and True in data:
            data = {("on" if key is True else key): value for key, value in data.items()}
        return data


Limit = float | Bound


def _limit(limit: Limit) -> Bound:
    return limit if isinstance(limit, Bound) else Bound(value=limit)


class Policy(Strict):
    """A release policy (policies/NAME.yaml). Example:

    stages: [quantize, evaluate, bench]
    recovery: {quality/ppl: 0.85}            # at least 85% of the base's score kept
    max: {quality/kld_mean: {value: 0.2, on: ci_high}, quality/flips_pct: 15}
    min: {speedup/decode_tok_s: {value: 1.0, on: ci_low}}
    speed_engine: serving                    # speed measured through a serving engine only
    licenses: [apache-2.0, mit]
    registry: {model: "{base_model}", alias: champion}
    """

    description: str = ""
    stages: list[Stage] = ["quantize", "evaluate"]
    recovery: dict[str, Limit] = Field(
        default_factory=dict, description="minimum recovery/<metric> (1 = as good as the base)"
    )
    min: dict[str, Limit] = Field(default_factory=dict, description="absolute lower limits (higher-is-better metrics)")
    max: dict[str, Limit] = Field(default_factory=dict, description="absolute upper limits (lower-is-better metrics)")
    licenses: list[str] | None = Field(None, description="allowed licences of the base model; null allows any")
    # serving: a speed check (speedup/*, speed/*, base_speed/*) passes only on numbers measured
    # through a serving engine (vLLM, transformers serve, an endpoint); any: in-process hf too
    speed_engine: Literal["serving", "any"] = "serving"
    registry: Register = Register()


@dataclass
class LoadedPolicy:
    name: str
    path: Path
    policy: Policy
    sha: str


@dataclass
class Check:
    check: str
    value: float | str | None
    threshold: float | str | None
    passed: bool
    note: str = ""
    ci_low: float | None = None  # the metric's 95 % interval, when the run logged one
    ci_high: float | None = None
    on: str = "value"  # what the threshold was held against: value, ci_low or ci_high
    unmeasurable: bool = False  # failed because the figure could not be measured here (a busy machine)


def policies_dir() -> Path:
    return Path("policies")


def load_policy(name_or_path: str) -> LoadedPolicy:
    """policies/NAME.yaml or a path; UserError listing every problem with the file and field."""
    path = Path(name_or_path) if name_or_path.endswith((".yaml", ".yml")) else policies_dir() / f"{name_or_path}.yaml"
    if name_or_path.endswith((".yaml", ".yml")) and not path.is_file():
        raise UserError(f"{path}: policy file does not exist")
    if path.parent != policies_dir() and not name_or_path.endswith((".yaml", ".yml")):
        # a name with a directory in it (../../etc/passwd) would be looked for as NAME.yaml in that directory
        available = ", ".join(sorted(p.stem for p in policies_dir().glob("*.yaml"))) or "none here"
        raise UserError(
            f"--policy: '{name_or_path}' is neither a policy's name (a file in {policies_dir()}/: {available}) nor "
            "a path to a .yaml file"
        )
    policy = load_named(path.parent, path.stem, Policy, "--policy", "policy")
    problems = []
    for key, threshold in policy.recovery.items():
        problem = names.check_name(f"recovery/{key}")
        if problem:
            problems.append(f"{path}: recovery.{key}: {problem}")
        elif not 0 < _limit(threshold).value:
            problems.append(
                f"{path}: recovery.{key}: {_limit(threshold).value} is not a share of the base's score (e.g. 0.95)"
            )
        else:
            problems += _interval_problems(path, "recovery", key, f"recovery/{key}", threshold)
    for bound, wrong in (("min", "lower"), ("max", "higher")):
        for key, threshold in getattr(policy, bound).items():
            problem = names.check_name(key)
            if problem:
                problems.append(f"{path}: {bound}.{key}: {problem}")
            elif found := _interval_problems(path, bound, key, key, threshold):
                problems += found
            elif catalogue.direction(key) == wrong:
                right = "max" if bound == "min" else "min"
                problems.append(
                    f"{path}: {bound}.{key}: {wrong} is better for this metric, so its limit belongs under {right}:"
                )
            elif catalogue.direction(key) is None:
                problems.append(f"{path}: {bound}.{key}: a context value, not a score; it cannot be gated")
    fields = {f for _, f, _, _ in string.Formatter().parse(policy.registry.model) if f is not None}
    if fields - set(NAME_FIELDS):
        problems.append(
            f"{path}: registry.model: unknown placeholder(s) {sorted(fields - set(NAME_FIELDS))}; "
            f"available: {', '.join('{' + f + '}' for f in NAME_FIELDS)}"
        )
    if problems:
        raise UserError(problems)
    sha = canonical_sha(policy.model_dump(mode="json"))
    return LoadedPolicy(path.stem, path, policy, sha)


def _interval_problems(path: Path, section: str, key: str, name: str, limit: Limit) -> list[str]:
    """An interval's end written into the metric's name, or an interval asked of a metric that
    never has one (`name` is the metric `key` stands for in `section`)."""
    bare = catalogue.without_interval_suffix(key)
    if bare != key:
        return [
            f"{path}: {section}.{key}: name the metric and the interval's end with on:, e.g. "
            f"{bare}: {{value: {_limit(limit).value}, on: {key.removeprefix(bare + '.')}}}"
        ]
    if _limit(limit).on != "value" and not catalogue.has_interval(name):
        return [
            f"{path}: {section}.{key}: on: {_limit(limit).on}, but {name} has no interval (intervals exist for "
            "quality/* and quality_ood/* but maxima, counts and p-values; task/*, recovery/*, speedup/*; "
            "docs/intervals.md)"
        ]
    return []


# ---------------------------------------------------------------------------------------------
# The checks


def evaluate_policy(
    policy: Policy,
    status: str,
    tags: dict[str, str],
    metrics: dict[str, float],
    stored: bool = False,
    run_id: str = "<run id>",
    missing_interval: Literal["raise", "fail"] = "raise",
) -> list[Check]:
    """Every check of the policy on one run's raw values; none is skipped when an earlier fails.
    `stored`: the run has its checkpoint as an artifact (so it need not be on this machine). A speed
    check that fails on figures a busy machine measured is unmeasurable, not slower. A limit on an
    interval the run did not log raises MissingInterval (the gate: bad input), or with
    `missing_interval="fail"` is a failed check that says so (the verdict)."""
    checks = [Check("run status", status, "FINISHED", status == "FINISHED")]
    for stage in policy.stages:
        evidence = STAGE_EVIDENCE[stage]
        present = evidence in metrics
        note = (
            ""
            if present
            else f"no {evidence}: run `make {stage} RUN=<run id>`"
            if stage != "quantize"
            else "not a quantize run"
        )
        if stage == "bench" and tags.get(TAG + "bench_partial") == "true":
            present, note = False, "the last bench was partial (its server died)"
        elif stage == "bench" and not present and (why := unmeasurable_here(tags)):
            note = why  # a floating-point format no engine here runs as stored: `make bench` would refuse
        checks.append(Check(f"stage {stage}", "present" if present else "missing", "present", present, note))
    if policy.licenses is not None:
        license_ = tags.get(TAG + "license", "unknown")
        allowed = [x.lower() for x in policy.licenses]
        checks.append(Check("licence", license_, " | ".join(policy.licenses), license_.lower() in allowed))
    limits = _metric_checks(policy, metrics, missing_interval=missing_interval)  # recovery first, then min, then max
    served = catalogue.serving(tags)
    for check in limits:
        speed = check.check.startswith(SPEED_FAMILIES) and check.value is not None
        if speed and policy.speed_engine == "serving" and served is False:
            engine = tags.get(TAG + "bench_server", "hf")
            check.passed = False
            check.note = (
                f"measured through {engine}: not a serving engine (policy speed_engine: serving); "
                "`make bench RUN=<run id>` measures through vLLM or transformers serve"
            )
        elif speed and not check.passed and tags.get(TAG + "bench_busy") == "true":
            check.unmeasurable = True
            check.note = (
                f"speed unmeasurable here (the machine was busy: {tags.get(TAG + 'bench_busy_why', '?')}); "
                f"re-run `make bench RUN={run_id}` on a quiet machine"
            )
    checks += limits
    checkpoint = tags.get(TAG + "checkpoint")
    on_disk = bool(checkpoint) and (Path(checkpoint) / "config.json").is_file()
    found = on_disk or stored
    note = (
        checkpoint
        if on_disk
        else "the run's checkpoint/ artifact"
        if stored
        else f"{checkpoint or 'no checkpoint tag'}: not on this machine nor in the run's artifacts; needed to register it"
    )
    checks.append(Check("checkpoint", "present" if found else "missing", "present", found, note))
    return checks


def unmeasurable_here(tags: dict[str, str]) -> str | None:
    """Why no engine on this machine can time a run's checkpoint as stored (a floating-point format
    such as NVFP4 on a CPU: engines/formats.py), or None (its checkpoint is elsewhere, or it can)."""
    checkpoint = Path(tags.get(TAG + "checkpoint", ""))
    if (checkpoint / "config.json").is_file() and formats.stored_float_format(checkpoint):
        return vllm_env.unserved(checkpoint)
    return None


def _metric_checks(
    policy: Policy, metrics: dict[str, float], skip: tuple[str, ...] = (), missing_interval: str = "raise"
) -> list[Check]:
    """The policy's recovery, min and max limits held against a run's metrics, leaving out the
    metrics whose names start with one of `skip`."""
    checks = [_bound(f"recovery/{k}", metrics, _limit(t), ">=", missing_interval) for k, t in policy.recovery.items()]
    for op, limits in ((">=", policy.min), ("<=", policy.max)):
        checks += [
            _bound(k, metrics, _limit(t), op, missing_interval) for k, t in limits.items() if not k.startswith(skip)
        ]
    return checks


def quality_checks(policy: Policy, metrics: dict[str, float]) -> list[Check]:
    """The policy's limits on quality (recovery, and min / max outside the speed families) held
    against one run's metrics: what `quantbench stack --policy` asks of each step's model."""
    return _metric_checks(policy, metrics, skip=SPEED_FAMILIES)


class MissingInterval(Exception):
    """A check holds an interval's end to its limit, and the run logged the metric without one."""


def _bound(key: str, metrics: dict[str, float], limit: Bound, op: str, missing_interval: str = "raise") -> Check:
    value = metrics.get(key)
    low, high = intervals.interval_of(metrics, key) or (None, None)
    shown = f"{op} {limit.value}" if limit.on == "value" else f"{limit.on} {op} {limit.value}"
    if value is None:
        return Check(key, None, shown, False, "not logged in this run", on=limit.on)
    held = value if limit.on == "value" else {"ci_low": low, "ci_high": high}[limit.on]
    if held is None:
        if missing_interval == "fail":
            return Check(key, value, shown, False, f"{NO_INTERVAL}: the policy holds its {limit.on}", on=limit.on)
        raise MissingInterval(key)
    passed = held >= limit.value if op == ">=" else held <= limit.value
    return Check(key, value, shown, passed, ci_low=low, ci_high=high, on=limit.on)


def _interval_text(c: Check) -> str:
    return "—" if c.ci_low is None else f"[{c.ci_low:.4g}, {c.ci_high:.4g}]"


def table(checks: list[Check]) -> str:
    rows = []
    for c in checks:
        value = f"{c.value:.4g}" if isinstance(c.value, float) else str(c.value if c.value is not None else "—")
        result = ("pass" if c.passed else "UNMEASURABLE" if c.unmeasurable else "FAIL") + (
            f"  ({c.note})" if c.note else ""
        )
        rows.append([c.check, value, _interval_text(c), str(c.threshold), result])
    return tables.table(["check", "value", "95% interval", "threshold", "result"], rows, "lrrrl")


def text(report: dict, body: str | None = None) -> str:
    """What `quantbench gate` prints: the verdict, every check (`body`: the run's verdict table,
    which holds them all; else the checks' own table), what moved in the registry."""
    checks = [Check(**c) for c in report["checks"]]
    lines = [
        f"gate {report['policy']} on run {report['run_id']} ({report['run_name']}): {'PASS' if report['passed'] else 'FAIL'}",
        body if body is not None else table(checks),
    ]
    registered = report["registered"]
    if registered:
        lines.append(
            f"registered: {registered['model']} version {registered['version']} -> alias '{registered['alias']}'"
            + (
                f"; version {registered['previous']} keeps alias '{registered['previous_alias']}'"
                if registered["previous"]
                else ""
            )
        )
    else:
        lines.append("nothing registered, no alias moved")
    return "\n".join(lines)


def markdown(checks: list[Check], header: str) -> str:
    rows = [header, "", "| check | value | 95% interval | threshold | result |", "|---|---|---|---|---|"]
    for c in checks:
        value = repr(c.value) if isinstance(c.value, float) else str(c.value if c.value is not None else "—")
        interval = "—" if c.ci_low is None else f"[{c.ci_low!r}, {c.ci_high!r}]"
        rows.append(
            f"| `{c.check}` | {value} | {interval} | {c.threshold} | "
            f"{'pass' if c.passed else '**UNMEASURABLE**' if c.unmeasurable else '**FAIL**'} {c.note} |"
        )
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------------------------------------
# The verb


def run(run_id: str, policy_name: str, *, experiment: str | None = None) -> dict:
    loaded = load_policy(policy_name)
    tracker = Tracker(experiment)
    if not RUN_ID.fullmatch(run_id):
        raise UserError(f"'{run_id}' is not an MLflow run id (32 hex digits)")
    run_ = tracker.existing(run_id)
    if run_ is None:
        raise UserError(f"MLflow run '{run_id}' does not exist at the tracking store ({tracking_uri()})")
    info, data = run_.info, run_.data
    tags, metrics = dict(data.tags), dict(data.metrics)
    if tags.get(TAG + "role") != "candidate":
        raise UserError(
            f"MLflow run '{run_id}' is a {tags.get(TAG + 'role', 'non-quantbench')} run; gate a candidate run"
        )

    try:
        checks = evaluate_policy(
            loaded.policy,
            info.status,
            tags,
            metrics,
            stored=run_.has_artifact(f"{ARTIFACT}/config.json"),
            run_id=run_id,
        )
    except MissingInterval as exc:
        why = (
            "fewer than 3 paired repetitions in its bench"
            if str(exc).startswith("speedup/")
            else "too few windows or items in its suite, or intervals off; evaluation.json lists why"
        )
        raise UserError(
            f"{loaded.path}: {exc}: the policy holds an end of its interval to the limit, but run {run_id} "
            f"logged {exc} without an interval ({why}); nothing gated"
        ) from None
    passed = all(c.passed for c in checks)
    verdict = "PASS" if passed else "FAIL"
    stamp = time.strftime("%Y%m%dT%H%M%S")
    registered = _promote(loaded, run_, tags) if passed else None
    report = {
        "run_id": run_id,
        "run_name": info.run_name,
        "policy": loaded.name,
        "policy_file": str(loaded.path),
        "policy_sha": loaded.sha,
        "policy_settings": loaded.policy.model_dump(mode="json"),
        "passed": passed,
        "checks": [asdict(c) for c in checks],
        "registered": registered,
        "at": stamp,
    }
    run_.log_dict(report, f"gate/{loaded.name}-{stamp}.json")
    run_.log_text(
        markdown(
            checks, f"# Gate `{loaded.name}`: {verdict}\n\nrun `{run_id}` · policy sha `{loaded.sha[:12]}` · {stamp}"
        ),
        f"gate/{loaded.name}-{stamp}.md",
    )
    run_.set_tags({f"{TAG}gate.{loaded.name}": "pass" if passed else "fail", f"{TAG}gate.{loaded.name}.at": stamp})
    return report


def _promote(loaded: LoadedPolicy, run_, tags: dict[str, str]) -> dict:
    spec = loaded.policy.registry
    fields = {
        "base_model": models.short_name(tags.get(TAG + "base_model", "model")),
        "recipe": tags.get(TAG + "recipe", ""),
        "method": tags.get(TAG + "method", ""),
        "scheme": tags.get(TAG + "scheme", ""),
    }
    name = spec.model.format(**fields)
    registry = Registry()
    version = registry.version_for_run(name, run_.run_id)
    if version is None:
        if not run_.has_artifact(f"{ARTIFACT}/config.json"):
            upload(run_, Path(tags[TAG + "checkpoint"]))
        version = registry.register(
            name,
            run_,
            ARTIFACT,
            description=f"{tags.get(TAG + 'recipe', '?')} ({tags.get(TAG + 'method')} {tags.get(TAG + 'scheme')}) of "
            f"{tags.get(TAG + 'base_model')}, passed policy {loaded.name}",
            tags={
                TAG + "recipe": tags.get(TAG + "recipe", ""),
                TAG + "run": run_.run_id,
                TAG + "format": tags.get(TAG + "format", ""),
            },
        )
    previous = registry.alias_version(name, spec.alias)
    if previous is not None and previous != version.version and spec.previous_alias:
        registry.set_alias(name, spec.previous_alias, previous)
    registry.set_alias(name, spec.alias, version.version)
    registry.set_version_tags(
        name,
        version.version,
        {
            f"{TAG}gate.{loaded.name}": "pass",
            f"{TAG}gate.policy_sha": loaded.sha,
            f"{TAG}gate.at": time.strftime("%Y%m%dT%H%M%S"),
        },
    )
    return {
        "model": name,
        "version": version.version,
        "alias": spec.alias,
        "previous": previous if previous != version.version else None,
        "previous_alias": spec.previous_alias,
    }
