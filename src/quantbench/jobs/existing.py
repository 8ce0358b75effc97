"""Stages on a checkpoint that exists already: `quantbench evaluate` (quality against the base
model), `quantbench bench` (speed through a serving engine) and `quantbench bench --draft`
(speculative decoding). Each runs in the checkpoint's own MLflow run, reopened (a new candidate run
for a checkpoint made elsewhere), appends to that run's log file, and returns a `StageOutcome` that
the CLI prints. The quantize job runs the same stages on the checkpoint it writes (jobs/pipeline.py)."""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantbench.core import hardware, paths
from quantbench.core.errors import UserError
from quantbench.core.logs import log_file
from quantbench.jobs import footprint
from quantbench.jobs.pipeline import bench_into_run, engine_quality_metrics, log_metrics_to_file, settle
from quantbench.jobs.prepare import base_tags
from quantbench.quality import stage as evaluate_stage
from quantbench.quality.suite import DEFAULT_SUITE, load_suite
from quantbench.release.verdict import Verdict
from quantbench.sources import models
from quantbench.sources.checkpoint import (
    Target,
    check_loadable,
    load_model,
    quant_method,
    resolve_target,
    weights_size_mb,
)
from quantbench.sources.shapes import Shape
from quantbench.speed import speculative as spec_stage
from quantbench.speed import stage as bench_stage
from quantbench.speed.measure import DEFAULT_PROFILE, load_profile
from quantbench.tracking import TAG, Tracker

log = logging.getLogger(__name__)


@dataclass
class StageOutcome:
    run_id: str
    checkpoint: Path
    metrics: dict[str, float]
    evaluation: evaluate_stage.Evaluation | None = None
    bench: bench_stage.BenchResult | None = None
    extra: dict = field(default_factory=dict)
    engine_tasks: evaluate_stage.EngineTasks | None = None
    verdict: Verdict | None = None

    def summary(self) -> dict:
        out = {"run_id": self.run_id, "checkpoint": str(self.checkpoint), **self.extra, "metrics": self.metrics}
        if self.evaluation is not None:
            out.update(baseline_run=self.evaluation.baseline_run, baseline_reused=self.evaluation.baseline_reused)
        return out


def target_run(tracker: Tracker, tgt: Target, base: models.ResolvedModel, stage: str):
    """The checkpoint's own MLflow run, reopened; or a new candidate run for a foreign checkpoint."""
    if tgt.run_id:
        return tracker.resume_run(tgt.run_id)
    method = quant_method(tgt.checkpoint)  # what its config says it is (compare's format column)
    return tracker.start_run(
        f"{stage} {tgt.checkpoint.name} · {models.short_name(tgt.base_source)}",
        {
            TAG + "role": "candidate",
            TAG + "checkpoint": tgt.checkpoint.resolve(),
            TAG + "base_model": tgt.base_source,
            TAG + "base_fingerprint": base.fingerprint,
            **({TAG + "format": method} if method else {}),
            **base_tags(base),
        },
    )


def _together(*checks: Callable[[], Any]) -> list[Any]:
    """Each check's result; when any is bad input, every one's problems at once (a bad profile said
    beside a bad target, not only after the target is fixed)."""
    results, problems = [], []
    for check in checks:
        try:
            results.append(check())
        except UserError as exc:
            problems += exc.problems
    if problems:
        raise UserError(problems)
    return results


def _open_target(target: str, base: str | None, experiment: str | None) -> tuple[Tracker, Target, models.ResolvedModel]:
    tracker = Tracker(experiment)
    tgt = resolve_target(target, tracker, base)
    check_loadable(tgt.checkpoint)
    base_model = models.resolve(tgt.base_source, field="--base", experiment=experiment)
    if note := base_model.quantized_note():
        log.warning("%s", note)
    return tracker, tgt, base_model


def evaluate(
    target: str,
    *,
    suite: str | None = None,
    base: str | None = None,
    experiment: str | None = None,
    engine: str | None = None,
) -> StageOutcome:
    """Quality against the base model through transformers; with `engine` ("vllm") also the suite's
    tasks scored on the checkpoint served by that engine, in the same run."""
    from transformers import AutoTokenizer

    loaded_suite, (tracker, tgt, base_model) = _together(
        lambda: load_suite(suite or DEFAULT_SUITE), lambda: _open_target(target, base, experiment)
    )
    tokenizer = AutoTokenizer.from_pretrained(tgt.checkpoint)
    plan = evaluate_stage.prepare(loaded_suite, tokenizer)
    engine_plan = evaluate_stage.prepare_engine(engine, tgt.checkpoint, plan) if engine else None
    engine_result = None
    with target_run(tracker, tgt, base_model, "evaluate") as run, _run_log(run, tgt.checkpoint):
        baseline = evaluate_stage.get_baseline(tracker, base_model, plan)  # before the candidate is loaded
        model = load_model(tgt.checkpoint, dtype=hardware.compute_dtype_of(tgt.checkpoint))
        evaluation = evaluate_stage.evaluate(model, tokenizer, base_model, plan, tracker, baseline=baseline)
        run.record(evaluation.metrics, evaluation.tags, {"evaluation.json": evaluation.report})
        metrics = dict(evaluation.metrics)
        engine_quality = engine_quality_metrics(tgt.checkpoint, base_model, plan, tokenizer, None)
        run.log_metrics(engine_quality)
        metrics |= engine_quality
        if engine_plan is not None:
            del model
            correct = {t: {int(k): v for k, v in items.items()} for t, items in evaluation.report["samples"].items()}
            logs: list[Path] = []
            try:
                engine_result = evaluate_stage.engine_tasks(engine_plan, plan, correct, logs)
                run.record(engine_result.metrics, engine_result.tags, {"evaluation_engine.json": engine_result.report})
                metrics |= engine_result.metrics
            finally:
                for path in logs:
                    if path.exists():
                        run.log_artifact(path, "servers")
                    shutil.rmtree(path.parent, ignore_errors=True)
        log_metrics_to_file(metrics)
    outcome = StageOutcome(run.run_id, tgt.checkpoint, metrics, evaluation=evaluation, engine_tasks=engine_result)
    outcome.verdict = settle(run.run_id, experiment)
    return outcome


def bench(
    target: str,
    *,
    profile: str | None = None,
    engine: str = "auto",
    server: str = "auto",
    base: str | None = None,
    experiment: str | None = None,
    endpoints: tuple[str, str] | None = None,
) -> StageOutcome:
    from transformers import AutoTokenizer

    _, (tracker, tgt, base_model) = _together(
        lambda: load_profile(profile or DEFAULT_PROFILE), lambda: _open_target(target, base, experiment)
    )
    plan = bench_stage.prepare(
        profile or DEFAULT_PROFILE,
        AutoTokenizer.from_pretrained(tgt.checkpoint),
        engine=engine,
        server=server,
        endpoints=endpoints,
        checkpoint=tgt.checkpoint,
        base_path=base_model.path,
    )
    _plan_bench(plan, tgt.checkpoint, base_model)
    with target_run(tracker, tgt, base_model, "bench") as run, _run_log(run, tgt.checkpoint):
        result = bench_into_run(run, tgt.checkpoint, base_model, plan)
        log_metrics_to_file(result.metrics)
    engine = {
        "engine": result.report["engine"],
        "engine_description": result.report["engine_description"],
        "why": result.report["why"],
    }
    outcome = StageOutcome(run.run_id, tgt.checkpoint, result.metrics, bench=result, extra=engine)
    outcome.verdict = settle(run.run_id, experiment)
    return outcome


@contextmanager
def _run_log(run, checkpoint: Path):
    """The run's log file for a later stage (evaluate, bench), appended: the quantize job's own
    beside the checkpoint it wrote, else one kept in the cache (begun from the run's `<run id>.log`
    artifact when it has one, so that re-logging it loses nothing); logged as that artifact."""
    name = f"{run.run_id}.log"
    path = checkpoint.parent / name
    if not path.is_file():
        path = paths.cache_dir() / "logs" / name
        if not path.exists() and run.has_artifact(name):
            run.download(name, path.parent)
    try:
        with log_file(path):
            yield path
    finally:
        if path.exists():
            run.log_artifact(path)


def _plan_bench(plan: bench_stage.Plan, checkpoint: Path, base: models.ResolvedModel) -> None:
    """The bench's memory, planned from the base's shapes and the checkpoint's size: servers that do
    not fit together are measured one after the other; refused (exit 2) when one alone does not fit."""
    from transformers import AutoConfig

    shape = Shape.from_config(AutoConfig.from_pretrained(base.path))
    size = int(weights_size_mb(checkpoint) * 2**20)
    stage = footprint.bench_stage(
        shape, plan, size, "bfloat16", footprint.available_ram(), gpu_total=hardware.cuda_memory()
    )
    log.info("bench memory plan: %.2f GiB (%s)", stage.ram / 2**30, "; ".join(stage.held))
    if stage.ram > footprint.available_ram():
        raise UserError(
            f"the bench needs about {stage.ram / 2**30:.1f} GiB ({'; '.join(stage.held)}) and this machine has "
            f"{footprint.available_ram() / 2**30:.1f} GiB available. {'; '.join(stage.fits_with)}"
        )
    if stage.gpu > stage.gpu_limit:
        raise UserError(footprint.gpu_refusal(stage))


def speculative(
    draft: str, target: str | None = None, *, profile: str | None = None, experiment: str | None = None
) -> StageOutcome:
    """`bench --draft`: the target model (default the draft's base) with and without the draft."""
    tracker = Tracker(experiment)
    drafted = resolve_target(draft, tracker, target)
    check_loadable(drafted.checkpoint)
    source = target or drafted.base_source
    if re.fullmatch(r"[0-9a-f]{32}", source):
        source = "run:" + source
    tgt = models.resolve(source, field="target" if target else "the draft's base model", experiment=experiment)
    check_loadable(tgt.path)
    plan = spec_stage.prepare(drafted.checkpoint, tgt, profile or DEFAULT_PROFILE, f"--draft {draft}")
    with target_run(tracker, drafted, tgt, "bench") as run:
        result = spec_stage.run(plan)
        run.record(result.metrics, result.tags, {"bench_spec.json": result.report})
    return StageOutcome(
        run.run_id, drafted.checkpoint, result.metrics, extra={"target": tgt.source, "draft": str(drafted.checkpoint)}
    )
