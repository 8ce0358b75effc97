"""The verdict: what a reviewer reads at the end of every command that scores a checkpoint
(quantize, evaluate, bench, tune, stack, gate), in the terminal and as the run's description in
MLflow. One table: the headline quality figures against the base model with their 95 % intervals,
the size, the speed where it was measured (through which engine, on which CPU class), and what a
release policy would say about each, failing rows named. What was not measured is a row too, with
the command that measures it. The full metric list stays in the run's log file and `--json`.

The verdict reads the run as MLflow has it (tags, latest metrics, status), so every command shows
the same thing for the same run, and it holds the run to the policy with the gate's own checks
(gate.evaluate_policy) without registering anything or moving an alias. Like lm-eval's make_table,
it formats; verdict_page.py draws the report artifact.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

from quantbench.core import intervals, tables
from quantbench.core.errors import UserError
from quantbench.release import gate, verdict_page
from quantbench.release.gate import Check, LoadedPolicy
from quantbench.sources.checkpoint import ARTIFACT
from quantbench.tracking import TAG, Tracker

log = logging.getLogger(__name__)

DEFAULT_POLICY = "release"
DESCRIPTION = "mlflow.note.content"  # the run's description on its MLflow page (markdown)
# The figures the verdict leads with, in this order: (metric, label, format). Task recoveries follow.
QUALITY = (
    ("quality/kld_mean", "KLD vs base, mean", ".4g"),
    ("quality/top1_agreement", "top-1 agreement", ".4g"),
    ("quality/flips_pct", "answer flips %", ".3g"),
)
SPEED = (
    ("speedup/decode_tok_s", "decode speed ×", ".3g"),
    ("speedup/ttft_ms_p50", "time to first token ×", ".3g"),
)
PPL_RECOVERY = "recovery/quality/ppl"  # base / candidate perplexity: shown as candidate / base
INVERTED_END = {"ci_low": "ci_high", "ci_high": "ci_low", "value": "value"}
WIDTH = 120  # the terminal's lines: notes and the summary are wrapped to it


@dataclass
class Row:
    """One line of the verdict: a figure, its value and 95 % interval, the policy's limit on it and
    what the policy says (pass, FAIL, UNMEASURABLE, NO INTERVAL, or nothing when it holds none)."""

    figure: str
    value: str
    interval: str = ""
    limit: str = ""
    result: str = ""


@dataclass
class Verdict:
    run_id: str
    title: str  # what the run is: recipe, method and scheme, base model
    policy: str | None  # the policy's name; None when there was none to hold the run to
    outcome: str  # PASS | FAIL | UNDECIDED (a limit on an interval the run has not got) | "" (no policy)
    failing: list[str]
    rows: list[Row]
    notes: list[str] = field(default_factory=list)  # what was not measured and the command that measures it
    checks: list[Check] = field(default_factory=list)
    measured: dict[str, bool] = field(default_factory=dict)  # quality, speed

    def text(self, gated: bool = False) -> str:
        """The terminal's last screen, in lines of at most WIDTH. `gated`: printed by `gate`, which
        says itself what moved."""
        head = f"verdict: {self.title} · run {self.run_id}"
        body = tables.table(
            ["figure", "value", "95% interval", self.policy or "policy", "result"],
            [[r.figure, r.value, r.interval, r.limit, r.result] for r in self.rows],
            "lllll",
        )
        notes = [_wrap(n, "  · ", "    ") for n in self.notes]
        return "\n".join([head, body, *notes, _wrap(self.summary(gated), "", "  ")])

    def summary(self, gated: bool = False) -> str:
        if self.policy is None:
            return "no release policy to hold it to (policies/release.yaml is not here; `quantbench gate RUN --policy PATH`)"
        said = f"{self.policy}: {self.outcome}"
        if self.failing:
            said += f" on {len(self.failing)} check{'s' * (len(self.failing) > 1)}: {', '.join(self.failing)}"
        if not gated:
            said += (
                f" — a verdict only: nothing registered, no alias moved (`make gate RUN={self.run_id} "
                f"POLICY={self.policy}` gates it)"
            )
        return said

    def markdown(self) -> str:
        """The run's description in MLflow: the same table, rendered on the run page."""
        lines = [
            f"**Verdict** · {self.title} · {self.summary(gated=True) if self.policy else 'no policy'}",
            "",
            f"| figure | value | 95% interval | {self.policy or 'policy'} | result |",
            "|---|---|---|---|---|",
        ]
        for r in self.rows:
            result = f"**{r.result}**" if r.result and r.result != "pass" else r.result
            lines.append(f"| {r.figure} | {r.value} | {r.interval} | {r.limit} | {result} |")
        lines += [""] + [f"- {n}" for n in self.notes] if self.notes else []
        lines += [
            "",
            f"Every metric: the run's Metrics and its log file; the report with the KLD distribution and the "
            f"speed curve: `verdict.html` under Artifacts. Written {time.strftime('%Y-%m-%d %H:%M')}.",
        ]
        return "\n".join(lines) + "\n"

    def as_json(self) -> dict:
        return {
            "policy": self.policy,
            "outcome": self.outcome,
            "failing": self.failing,
            "rows": [r.__dict__ for r in self.rows],
            "notes": self.notes,
        }


# ---------------------------------------------------------------------------------------------
# Building it from a run's tags and metrics


def _wrap(text: str, first: str, rest: str) -> str:
    return textwrap.fill(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)


def _g(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _interval(low: float | None, high: float | None) -> str:
    return "" if low is None or high is None else f"[{low:.4g}, {high:.4g}]"


def _result(check: Check | None) -> str:
    if check is None:
        return ""
    if check.passed:
        return "pass"
    if check.note.startswith(gate.NO_INTERVAL):
        return "NO INTERVAL"
    return "UNMEASURABLE" if check.unmeasurable else "FAIL"


def _metric_row(key: str, label: str, fmt: str, metrics: dict, checks: dict[str, Check]) -> Row:
    low, high = intervals.interval_of(metrics, key) or (None, None)
    check = checks.pop(key, None)
    return Row(label, _g(metrics.get(key), fmt), _interval(low, high), check.threshold if check else "", _result(check))


def _ppl_row(metrics: dict, checks: dict[str, Check]) -> Row | None:
    """Perplexity as candidate / base (what a reader expects of a ratio); the policy holds its
    inverse, the recovery, so the limit is shown inverted too (ci_low >= 0.9 reads ci_high <= 1.111)."""
    check = checks.pop(PPL_RECOVERY, None)
    recovery = metrics.get(PPL_RECOVERY)
    if recovery:
        low, high = intervals.interval_of(metrics, PPL_RECOVERY) or (None, None)
        limit = ""
        if check is not None and isinstance(check.threshold, str):
            end, _, bound = check.threshold.rpartition(">= ")
            end = end.strip()
            limit = (f"{INVERTED_END[end]} <= " if end else "<= ") + f"{1 / float(bound):.4g}"
        shown = _interval(1 / high, 1 / low) if low and high else ""
        return Row("perplexity ratio (cand/base)", f"{1 / recovery:.4g}", shown, limit, _result(check))
    if "check/ppl_ratio" in metrics:  # no evaluation: the reload check's figure, on its own text
        return Row("perplexity ratio (reload check)", f"{metrics['check/ppl_ratio']:.4g}")
    return None


def _size_row(metrics: dict, checks: dict[str, Check]) -> Row | None:
    if "model/size_mb" not in metrics:
        return None
    parts = [f"{metrics['model/size_mb']:.1f} MiB"]
    if "model/bits_per_weight" in metrics:
        parts.append(f"{metrics['model/bits_per_weight']:.2f} bits/w")
    if "model/compression_ratio" in metrics:
        parts.append(f"{metrics['model/compression_ratio']:.2f}× smaller")
    check = checks.pop("model/size_mb", None)
    return Row("size", ", ".join(parts), "", check.threshold if check else "", _result(check))


def unbenched_note(run_id: str, tags: dict[str, str]) -> str:
    """How speed gets measured for a run with no bench, or, for a floating-point format that no
    engine here runs as stored (NVFP4 on a CPU), why it cannot be here."""
    if why := gate.unmeasurable_here(tags):
        return f"speed: {why}"
    return f"speed: `make bench RUN={run_id}` measures decode and TTFT through its serving engine"


def _engine(tags: dict[str, str]) -> str:
    """The engine speed was measured through and the device it ran on (the class decides the
    kernels); the engine in full, with its version, is the run's tag bench_engine."""
    where = tags.get(TAG + "bench_device") or tags.get(TAG + "device", "")
    return tags.get(TAG + "bench_server", "?") + (f" · {where}" if where else "")


def build(
    run_id: str,
    status: str,
    tags: dict[str, str],
    metrics: dict[str, float],
    policy: LoadedPolicy | None,
    *,
    stored: bool = False,
    policy_problem: str = "",
    gated: bool = False,
) -> Verdict:
    """The verdict of one run. `gated`: every check of the policy gets a row (the gate's report);
    otherwise the checks outside the headline rows show only when they fail. `policy_problem`: why
    there is no policy (a note)."""
    checks: list[Check] = []
    if policy is not None:
        checks = gate.evaluate_policy(
            policy.policy, status, tags, metrics, stored=stored, run_id=run_id, missing_interval="fail"
        )
    by_name = {c.check: c for c in checks}
    rows: list[Row] = []
    notes: list[str] = []
    evaluated = "quality/kld_mean" in metrics
    benched = "speedup/decode_tok_s" in metrics and tags.get(TAG + "bench_partial") != "true"
    _quality_rows(run_id, metrics, by_name, evaluated, rows, notes)
    _speed_rows(run_id, tags, metrics, by_name, checks, benched, rows, notes)
    _base_rows(tags, rows, notes)
    for name, check in by_name.items():  # the policy's other checks: all of them at a gate, else the failing ones
        if check.value is None and not (benched if name.startswith(gate.SPEED_FAMILIES) else evaluated):
            continue  # a figure of a stage that did not run: its "not measured" row says it
        if gated or not check.passed:
            value = f"{check.value:.4g}" if isinstance(check.value, float) else str(check.value or "—")
            rows.append(
                Row(check.check, value, _interval(check.ci_low, check.ci_high), str(check.threshold), _result(check))
            )
    for check in checks:  # why a check failed, where the gate says more than the row (not "not measured" again)
        if not check.passed and check.note and not check.note.startswith(("no ", "not logged", gate.NO_INTERVAL)):
            notes.append(f"{check.check}: {check.note}")
    if policy_problem:
        notes.append(policy_problem)

    undecided = [c.check for c in checks if c.note.startswith(gate.NO_INTERVAL)]
    failing = [c.check for c in checks if not c.passed and c.check not in undecided]
    outcome = "" if policy is None else "FAIL" if failing else "UNDECIDED" if undecided else "PASS"
    if undecided:  # the gate refuses such a run as bad input (exit 2) rather than guess
        notes.append(
            f"no 95 % interval to hold to the policy's limit: {', '.join(undecided)} (too few windows, items or "
            "bench repetitions for one; the gate refuses to decide on it)"
        )
    return Verdict(
        run_id,
        _title(tags),
        policy.name if policy is not None else None,
        outcome,
        failing,
        rows,
        notes,
        checks,
        {"quality": evaluated, "speed": benched},
    )


def _quality_rows(run_id: str, metrics: dict, by_name: dict, evaluated: bool, rows: list, notes: list) -> None:
    """The quality rows (or "not measured"), perplexity, each task's recovery and the size; the
    checks they show are taken out of `by_name`."""
    if evaluated:
        rows += [_metric_row(key, label, fmt, metrics, by_name) for key, label, fmt in QUALITY]
    else:
        stage = by_name.pop("stage evaluate", None)
        rows.append(Row("quality vs base", "not measured", "", "stage evaluate" if stage else "", _result(stage)))
        notes.append(f"quality: `make evaluate RUN={run_id}` scores it against its base (KLD, top-1, flips, tasks)")
    ppl = _ppl_row(metrics, by_name)
    if ppl is not None:
        rows.append(ppl)
    for key in sorted(k for k in metrics if k.startswith("recovery/task/") and ".ci_" not in k):
        task, metric = key.removeprefix("recovery/task/").split("/", 1)
        if metric == "acc" or key in by_name:
            rows.append(_metric_row(key, f"{task} {metric} recovery", ".3f", metrics, by_name))
    size = _size_row(metrics, by_name)
    if size is not None:
        rows.append(size)


def _speed_rows(
    run_id: str, tags: dict, metrics: dict, by_name: dict, checks: list, benched: bool, rows: list, notes: list
) -> None:
    """The speed rows and the engine they were measured through (or "not measured" / "partial")."""
    if benched:
        rows += [_metric_row(key, label, fmt, metrics, by_name) for key, label, fmt in SPEED if key in metrics]
        busy = tags.get(TAG + "bench_busy") == "true"
        rows.append(Row("speed measured through", _engine(tags), "", "", "busy" if busy else ""))
        if busy and not any(c.unmeasurable for c in checks):  # an unmeasurable check says it in its own note
            notes.append(
                f"speed: the machine was busy during the bench ({tags.get(TAG + 'bench_busy_why', '?')}); "
                f"`make bench RUN={run_id}` on a quiet machine measures it"
            )
        by_name.pop("stage bench", None)
        return
    stage = by_name.pop("stage bench", None)
    partial = tags.get(TAG + "bench_partial") == "true"
    rows.append(
        Row(
            "speed vs base",
            "partial: the bench stopped" if partial else "not measured",
            "",
            "stage bench" if stage else "",
            _result(stage),
        )
    )
    notes.append(unbenched_note(run_id, tags))


def _base_rows(tags: dict, rows: list, notes: list) -> None:
    """What the base itself is, where that changes what the figures mean."""
    if tags.get(TAG + "base_quantized", "none") != "none":
        rows.append(Row("base model", f"{tags[TAG + 'base_quantized']}, de-quantized"))
        notes.append(
            f"the base is itself {tags[TAG + 'base_quantized']} (de-quantized): figures compare against it, not "
            "the original 16-bit model"
        )
    if tags.get(TAG + "same_type_as_base") == "true":
        rows.append(Row("same type as base", "yes"))
        notes.append(
            "quantized into its base's own type: it reproduces the base's grid, so its quality against that base "
            "says little about its loss against the original model"
        )


def _title(tags: dict[str, str]) -> str:
    what = tags.get(TAG + "recipe") or Path(tags.get(TAG + "checkpoint", "checkpoint")).name
    method = " ".join(x for x in (tags.get(TAG + "method"), tags.get(TAG + "scheme")) if x)
    base = tags.get(TAG + "base_model", "?")
    return f"{what} ({method} of {base})" if method else f"{what} (against {base})"


# ---------------------------------------------------------------------------------------------
# From the store, and back into it


def load_policy(name: str | None) -> tuple[LoadedPolicy | None, str]:
    """The policy to hold runs to, or None with why (a missing or broken policy file is no reason
    to fail the command that scored)."""
    try:
        return gate.load_policy(name or DEFAULT_POLICY), ""
    except UserError as exc:
        if name is None and not (gate.policies_dir() / f"{DEFAULT_POLICY}.yaml").is_file():
            return None, ""
        return None, f"policy: {'; '.join(exc.problems)}"


def of_run(run_id: str, *, policy: str | None = None, experiment: str | None = None, gated: bool = False) -> Verdict:
    """The verdict of a run as the store has it now."""
    loaded, problem = load_policy(policy)
    tracker = Tracker(experiment, reap=False)
    run = tracker.get(run_id)
    stored = False
    if loaded is not None and (TAG + "checkpoint") in run.data.tags:
        on_disk = (Path(run.data.tags[TAG + "checkpoint"]) / "config.json").is_file()
        stored = not on_disk and tracker.existing(run_id).has_artifact(f"{ARTIFACT}/config.json")
    return build(
        run_id,
        run.info.status,
        dict(run.data.tags),
        dict(run.data.metrics),
        loaded,
        stored=stored,
        policy_problem=problem,
        gated=gated,
    )


def stack_model_run(parent_run: str, *, experiment: str | None = None) -> str | None:
    """The model run of a stack's last measured step that has one (the model the stack ends with)."""
    steps = Tracker(experiment, reap=False).search({"mlflow.parentRunId": parent_run, TAG + "role": "stack_step"})
    ordered = sorted(steps, key=lambda r: int(r.data.tags.get(TAG + "stack_step", "0:").split(":")[0]))
    found = [r.data.tags[TAG + "stack_model_run"] for r in ordered if TAG + "stack_model_run" in r.data.tags]
    return found[-1] if found else None


def publish(verdict: Verdict, *, experiment: str | None = None) -> None:
    """Write the verdict into its run: the description MLflow renders on the run page, and the
    report (verdict.html, with verdict.png: the KLD distribution, quality by position, the speed
    curve) under Artifacts."""
    run = Tracker(experiment, reap=False).existing(verdict.run_id)
    if run is None:
        return
    run.set_tags({DESCRIPTION: verdict.markdown()})
    work = Path(tempfile.mkdtemp(prefix="qb-verdict-"))
    try:
        page = verdict_page.write(run, verdict, work)
        run.log_artifact(page)
        png = work / verdict_page.PNG
        if png.exists():
            run.log_artifact(png)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def settle(run_id: str, *, policy: str | None = None, experiment: str | None = None, gated: bool = False) -> Verdict:
    """The verdict of a run that has just been scored, written into it (description and report) and
    returned for the terminal."""
    found = of_run(run_id, policy=policy, experiment=experiment, gated=gated)
    publish(found, experiment=experiment)
    return found
