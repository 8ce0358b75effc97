"""`quantbench noise <base model>`: the floor under every metric, measured.

The base model is saved again in its own dtype and scored against itself exactly as a candidate is:
the evaluate stage (quality, out-of-domain quality, tasks, flips, recovery, with their intervals)
and the bench stage (speed against the base, interleaved, with the speedups' intervals). Whatever
this run shows is what measuring the same model twice gives: a candidate's difference of that
size is no difference. With `--recipe R` (a calibrated recipe), R is also quantized at its
calibration seed and at the next one, both evaluated with the same suite; the absolute difference
of every quality metric between the two is logged as `noise_seed/<metric>`: how much of a
calibrated recipe's score is the luck of its calibration sample.

The result is a run tagged `quantbench.role=noise` with the base model's fingerprint and the
suite's, like the baseline run; `compare` shows the newest one as a row and a band in its plot.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from quantbench.core import environment
from quantbench.core.errors import UserError
from quantbench.jobs import pipeline
from quantbench.quality import stage as evaluate_stage
from quantbench.quality.suite import DEFAULT_SUITE, load_suite
from quantbench.quantize import make_quantizer
from quantbench.recipe import load_recipe, resolve_recipe_path
from quantbench.sources import models
from quantbench.sources.checkpoint import read_info
from quantbench.speed import stage as bench_stage
from quantbench.speed.measure import DEFAULT_PROFILE
from quantbench.tracking import ENV_TAGS, TAG, Tracker

log = logging.getLogger(__name__)

# quality metrics whose seed-to-seed spread is logged (not counts, not the p-value, not intervals)
SPREAD = ("quality/", "quality_ood/", "task/", "recovery/")
NOT_SPREAD = ("quality/positions", "quality_ood/positions", "quality/flips_items", "quality/flips_p_value")


@dataclass
class NoiseResult:
    run_id: str
    metrics: dict[str, float]
    baseline_metrics: dict[str, float]
    notes: list[str]
    recipe_runs: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        return {"run_id": self.run_id, "recipe_runs": self.recipe_runs, "metrics": self.metrics}


def run(
    source: str,
    *,
    suite: str | None = None,
    profile: str | None = None,
    bench: bool = True,
    engine: str = "auto",
    recipe: str | None = None,
    experiment: str | None = None,
    outputs: Path = Path("outputs"),
) -> NoiseResult:
    from transformers import AutoTokenizer

    # prepare: every input checked, nothing written
    loaded_suite = load_suite(suite or DEFAULT_SUITE)
    base = models.resolve(source, field="model", experiment=experiment)
    tokenizer = AutoTokenizer.from_pretrained(base.path)
    plan = evaluate_stage.prepare(loaded_suite, tokenizer)
    seeds = _check_recipe(recipe, base, experiment) if recipe else None
    # the copy is the base re-saved: what serves the one serves the other
    bench_plan = (
        bench_stage.prepare(
            profile or DEFAULT_PROFILE,
            tokenizer,
            engine=engine,
            checkpoint=base.path,
            base_path=base.path,
            field="--profile",
        )
        if bench
        else None
    )

    tracker = Tracker(experiment)
    tags = {
        TAG + "role": "noise",
        TAG + "base_model": source,
        TAG + "base_fingerprint": base.fingerprint,
        TAG + "license": base.license,
        TAG + "suite": loaded_suite.name,
        TAG + "suite_sha": plan.fingerprint,
        **({TAG + "noise_recipe": recipe} if recipe else {}),
        **{TAG + k: v for k, v in environment.describe().items()},
        "mlflow.note.content": f"Noise floor of `{source}`: the base model re-saved in its own dtype, scored and "
        f"benched against itself with suite `{loaded_suite.name}`"
        + (f"; recipe `{recipe}` at two calibration seeds" if recipe else "")
        + ".",
    }
    with tracker.start_run(f"noise · {models.short_name(source)} · {loaded_suite.name}", tags) as noise_run:
        copy = outputs / "noise" / noise_run.run_id / "self"
        try:
            metrics, baseline_metrics, notes = _self(base, copy, plan, bench_plan, tracker, noise_run)
        finally:
            shutil.rmtree(copy.parent, ignore_errors=True)  # the same weights as the base: nothing to keep
        recipe_runs: list[dict] = []
        if recipe:
            spread, recipe_runs = _seeds(recipe, seeds, loaded_suite.name, noise_run.run_id, experiment, outputs)
            noise_run.log_metrics(spread)
            metrics.update(spread)
        noise_run.log_dict(
            {
                "base_model": source,
                "base_fingerprint": base.fingerprint,
                "suite": loaded_suite.name,
                "compared": "the base model against itself, re-saved in its own dtype",
                "recipe": recipe,
                "recipe_runs": recipe_runs,
                "metrics": metrics,
                "not_computed": notes,
            },
            "noise.json",
        )
    return NoiseResult(noise_run.run_id, metrics, baseline_metrics, notes, recipe_runs)


def _self(base: models.ResolvedModel, copy: Path, plan, bench_plan, tracker: Tracker, noise_run):
    """The base model re-saved, reloaded from disk, evaluated and benched against the base."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("noise: saving %s again in its own dtype into %s", base.name, copy)
    model = AutoModelForCausalLM.from_pretrained(base.path, dtype="auto")
    model.save_pretrained(copy)
    AutoTokenizer.from_pretrained(base.path).save_pretrained(copy)
    del model
    model = AutoModelForCausalLM.from_pretrained(copy, dtype="auto")
    evaluation = evaluate_stage.evaluate(model, AutoTokenizer.from_pretrained(copy), base, plan, tracker)
    del model
    noise_run.record(
        evaluation.metrics, {TAG + "baseline_run": evaluation.baseline_run}, {"evaluation.json": evaluation.report}
    )
    metrics = dict(evaluation.metrics)
    if bench_plan is not None:
        result = bench_stage.bench(copy, base, bench_plan)
        noise_run.record(result.metrics, result.tags, {"bench.json": result.report})
        metrics.update(result.metrics)
    return metrics, evaluation.baseline_metrics, evaluation.notes


def _check_recipe(recipe: str, base: models.ResolvedModel, experiment: str | None) -> tuple[int, int]:
    """A calibrated recipe on this base model: the two calibration seeds it will be run at."""
    loaded = load_recipe(resolve_recipe_path(recipe))
    if not make_quantizer(loaded.recipe.quantize).calibrates:
        raise UserError(
            f"--recipe {recipe}: {loaded.recipe.quantize.method} {loaded.recipe.quantize.scheme} does not "
            "calibrate, so its calibration seed changes nothing; name a calibrated recipe (gptq, awq, ...)"
        )
    theirs = models.resolve(loaded.recipe.model.source, experiment=experiment)
    if theirs.fingerprint != base.fingerprint:
        raise UserError(
            f"--recipe {recipe}: its model ({loaded.recipe.model.source}) is not the base model measured "
            "here; name the recipe's own model"
        )
    seed = loaded.recipe.calibration.seed
    return seed, seed + 1


def _seeds(
    recipe: str, seeds: tuple[int, int], suite: str, noise_run_id: str, experiment: str | None, outputs: Path
) -> tuple[dict[str, float], list[dict]]:
    """The recipe quantized and evaluated at two calibration seeds; |difference| of each quality metric."""
    found = []
    with _child_tags({TAG + "noise_run": noise_run_id}):
        for seed in seeds:
            log.info("noise: %s at calibration seed %d", recipe, seed)
            result = pipeline.quantize(
                recipe,
                overrides=(f"calibration.seed={seed}", f"evaluate={{suite: {suite}}}", "bench=null"),
                outputs=outputs,
                experiment=experiment,
            )
            weights = read_info(result.checkpoint).get("weights_sha")
            found.append({"seed": seed, "run_id": result.run_id, "weights_sha": weights, "metrics": result.metrics})
    a, b = found[0]["metrics"], found[1]["metrics"]
    spread = {
        f"noise_seed/{k}": abs(a[k] - b[k])
        for k in sorted(a.keys() & b.keys())
        if k.startswith(SPREAD) and k not in NOT_SPREAD and ".ci_" not in k
    }
    return spread, found


@contextmanager
def _child_tags(tags: dict[str, str]):
    """Runs started meanwhile carry `tags` (tracking.inherited_tags); the environment is restored after."""
    before = os.environ.get(ENV_TAGS)
    os.environ[ENV_TAGS] = json.dumps({**json.loads(before or "{}"), **tags})
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_TAGS, None)
        else:
            os.environ[ENV_TAGS] = before
