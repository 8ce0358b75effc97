"""`quantbench stack NAME`: load and check the stack file, find the steps' models, measure every
step, log the ledger.

MLflow: a parent run (`quantbench.role=stack`) with the ledger (`stack.json`, `stack.md`, the
waterfall plot `stack_waterfall.png`, the servers' logs) and `stack/<step>/multiplier|cumulative`;
one child run per step (`quantbench.role=stack_step`) with its speed and its multipliers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from quantbench.core import environment, hardware
from quantbench.core.errors import UserError
from quantbench.core.intervals import HIGH, LOW
from quantbench.jobs.stack.best import best_subset
from quantbench.jobs.stack.ledger import _ratio, ledger, policy_checks, table, waterfall
from quantbench.jobs.stack.measure import measure
from quantbench.jobs.stack.models import (
    AGAINST_BASE_LOG,
    against_base,
    check_engines,
    kv_cache_quality,
    quality_of,
    resolve_models,
)
from quantbench.jobs.stack.schema import Config, Resolved, StackFile, Step, load
from quantbench.release import gate
from quantbench.tracking import TAG, Tracker

log = logging.getLogger(__name__)

PLOT = "stack_waterfall.png"


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
                _policy_rows(report, steps, models_, loaded_policy)
            if best:
                report["best"] = best_subset(stack, steps, report, models_)
                if report["best"] and "config" in report["best"]:
                    report["best"] |= _measure_best(
                        stack, steps[0], Config(**report["best"]["config"]), models_, logs_dir
                    )
                    for path in sorted((logs_dir / "best").glob("*.log")):
                        parent.log_artifact(path, "servers/best")
            failed = _step_runs(tracker, parent, stack_name, report, results, models_)
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


def _policy_rows(report: dict, steps: list[Config], models_: dict[str | None, Resolved], loaded_policy) -> None:
    """Each step's row: whether its model passes the policy's quality checks, and which fail."""
    for row, config in zip(report["steps"], steps):
        resolved = models_[config.model_key]
        metrics = resolved.metrics if config.model else {}
        if config.model is None:  # the base model: the reference the quality limits are measured from
            row["policy_passed"], row["policy_failed"] = True, []
        elif resolved.base is not None:
            row["policy_passed"], row["policy_failed"] = False, [f"quality known against {resolved.base} only"]
        elif not metrics:
            row["policy_passed"], row["policy_failed"] = False, ["no quantbench run: quality unknown"]
        else:
            row["policy_passed"], row["policy_failed"] = policy_checks(loaded_policy.policy, metrics)


def _step_runs(tracker: Tracker, parent, stack_name: str, report: dict, results: list, models_) -> list[str]:
    """A child run per step under the stack's run (FAILED where its measuring failed), and its
    multipliers on the parent; the names of the steps that failed."""
    failed: list[str] = []
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
    return failed


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
