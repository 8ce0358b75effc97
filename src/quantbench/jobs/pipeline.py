"""A quantize job, stage by stage. `quantbench quantize RECIPE` runs

    prepare -> produce the checkpoint -> reload check -> evaluate -> bench -> model card

`prepare` (jobs/prepare.py) checks every input (recipe, model source, shapes, texts, suite, profile)
and writes nothing: bad input leaves no output directory and no MLflow run. The stages know nothing
of each other; each gets what it needs and returns a typed result, which the pipeline logs into the
run (through tracking.py) and the CLI prints. `quantbench evaluate | bench <run id | checkpoint>`
run one later stage on a checkpoint that exists (jobs/existing.py), logged as here.

The checkpoint is written into a hidden staging directory and renamed into place only when every
stage of the job has finished: a job that fails or is interrupted at any stage (its run ends
FAILED or KILLED) leaves no checkpoint behind. When the tracking store is a server with an
artifact store, the checkpoint is also logged as the run's `checkpoint/` artifact (with its content
hash) before that rename, so a later stage on another machine finds it. Tuning and sweeps run
this same pipeline.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from quantbench.core import environment, hardware
from quantbench.core.files import hand_back_now, pages_handed_back
from quantbench.core.logs import DETAIL, log_file, one_line
from quantbench.core.processes import raise_if_signalled
from quantbench.core.resources import StageCost, StageMeter, release_freed_memory
from quantbench.engines import llamacpp
from quantbench.jobs.prepare import Job, base_tags, candidate_type, prepare
from quantbench.quality import stage as evaluate_stage
from quantbench.quality.check import reload_check
from quantbench.quantize import Inputs, Produced
from quantbench.quantize.stage import produce
from quantbench.release import card
from quantbench.release.verdict import Verdict
from quantbench.release.verdict import settle as settle_verdict
from quantbench.sources import data, models
from quantbench.sources.checkpoint import (
    bits_per_weight,
    gguf_file,
    skeleton,
    weights_sha,
    weights_size_mb,
    write_info,
)
from quantbench.sources.checkpoint import upload as upload_checkpoint
from quantbench.speed import stage as bench_stage
from quantbench.tracking import STAGING, TAG, Tracker, inherited_tags

log = logging.getLogger(__name__)
detail = logging.getLogger(DETAIL)  # the run's log file only: the terminal ends with the verdict


@dataclass
class JobResult:
    run_id: str
    checkpoint: Path
    log: Path
    metrics: dict[str, float]
    sample: str
    evaluation: evaluate_stage.Evaluation | None = None
    bench: bench_stage.BenchResult | None = None
    verdict: Verdict | None = None

    def summary(self) -> dict:
        """The JSON summary `quantbench quantize --json` prints."""
        return {
            "run_id": self.run_id,
            "checkpoint": str(self.checkpoint),
            "log": str(self.log),
            "metrics": self.metrics,
        }


def quantize(
    recipe: str,
    *,
    overrides: tuple[str, ...] = (),
    outputs: Path = Path("outputs"),
    experiment: str | None = None,
    strict_budget: bool = False,
) -> JobResult:
    with StageMeter("prepare") as meter:
        job = prepare(recipe, overrides, experiment=experiment, outputs=outputs, strict_budget=strict_budget)
    job.prepare_cost = meter.cost
    result = execute(job, outputs=outputs, experiment=experiment)
    result.verdict = settle(result.run_id, experiment)
    return result


def settle(run_id: str, experiment: str | None, **kwargs) -> Verdict | None:
    """The run's verdict (release/verdict.py; `kwargs`: its policy, gated), written into the run once
    it has ended: its description in MLflow and its report artifact. A command that did its work is
    not failed for it: None, with a warning."""
    try:
        return settle_verdict(run_id, experiment=experiment, **kwargs)
    except Exception as exc:
        log.warning("the verdict was not written into run %s: %s", run_id, one_line(exc))
        return None


def log_metrics_to_file(metrics: dict[str, float]) -> None:
    """Every metric, into the run's log file (the terminal shows the verdict; --json has them too)."""
    detail.info("metrics:\n%s", "\n".join(f"  {k:48s} {v:.6g}" for k, v in sorted(metrics.items())))


# ---------------------------------------------------------------------------------------------
# execute: one MLflow run, the stages in order, the checkpoint renamed into place at the end


def execute(job: Job, *, outputs: Path, experiment: str | None) -> JobResult:
    """The job's run: the base scored (its baseline, when the suite has none yet), produce, reload
    check, evaluate, bench, each measured (`stage/<name>/...`) beside the plan (`plan/<name>/...`);
    one copy of the model at a time. The checkpoint is renamed into place only at the end."""
    spec, loaded = job.loaded.recipe, job.loaded
    tracker = Tracker(experiment)
    with tracker.start_run(f"{loaded.name} · {models.short_name(spec.model.source)}", _candidate_tags(job)) as run:
        where = _Where(outputs / loaded.name, run.run_id, f".{spec.quantize.method}-{loaded.sha[:16]}")
        costs = _Costs(run, [job.prepare_cost] if job.prepare_cost else [])
        try:
            with log_file(where.log):
                result = _stages(job, run, tracker, where, costs)
                log_metrics_to_file(result.metrics | costs.metrics())
        except BaseException:
            shutil.rmtree(where.staging, ignore_errors=True)
            raise
        finally:
            run.log_metrics(costs.metrics())
            if where.log.exists():
                run.log_artifact(where.log)
    result.metrics |= costs.metrics()
    return result


@dataclass
class _Where:
    """Where a job writes: the recipe's directory under outputs/, its run's checkpoint, staging
    directory and log, and the method's work directory (state an interrupted job resumes from)."""

    directory: Path
    run_id: str
    work: str

    @property
    def final(self) -> Path:
        return self.directory / self.run_id

    @property
    def staging(self) -> Path:
        return self.directory / f".{self.run_id}.partial"

    @property
    def log(self) -> Path:
        return self.directory / f"{self.run_id}.log"

    @property
    def workdir(self) -> Path:
        return self.directory / self.work


class _Costs:
    """Each stage's measured cost, logged into the run at the end (also when the job failed: what it
    cost up to there)."""

    def __init__(self, run, costs: list[StageCost]):
        self.run, self.costs = run, costs

    @contextmanager
    def stage(self, name: str, directories: tuple[Path, ...] = ()):
        release_freed_memory()  # what the stage before let go is gone before this one is measured
        raise_if_signalled()  # a signal whose KeyboardInterrupt a finalizer run by the collection swallowed
        meter = StageMeter(name, directories)
        try:
            with meter:
                yield
        finally:
            if meter.cost is not None:
                self.costs.append(meter.cost)
                log.info(
                    "%s: %.1f s, peak memory %.2f GiB%s",
                    name,
                    meter.cost.wall_s,
                    meter.cost.peak_rss_mb / 1024,
                    f", {meter.cost.disk_mb / 1024:.2f} GiB written" if meter.cost.disk_mb >= 1 else "",
                )

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for cost in self.costs:
            out |= cost.metrics()
        return out


def _stages(job: Job, run, tracker: Tracker, where: _Where, costs: _Costs) -> JobResult:
    """The run's steps in order: the record of what runs, the base's baseline, produce, the reload
    check, evaluate, bench, and the checkpoint put in place."""
    names = ["produce", "reload check"] + ["evaluate"] * bool(job.evaluation) + ["bench"] * bool(job.bench)
    step = _Steps(names)
    _record_start(job, run, where)
    baseline = _baseline(job, tracker, costs)
    # the base check's pass read every page of the base prepare hands produce (moe-8x: produce
    # 2.59 GiB with them against 1.78 planned): back before produce, which reads each once
    held = _read_once(job) if job.model is not None else []
    if held:
        hand_back_now(held)

    step("produce")
    with costs.stage("produce", (where.staging, where.workdir)):
        produced, base_size_mb = _produce(job, run, where)

    step("reload check")
    check, metrics, info = _check(job, run, where, costs, produced, base_size_mb)

    evaluation = bench = None
    if job.evaluation is not None:
        step("evaluate")
        evaluation = _evaluate(job, run, tracker, where, costs, check, baseline, metrics)
    sample = check.sample
    del check  # the bench loads one model at a time
    if job.bench is not None:
        step("bench")
        with costs.stage("bench"):
            bench = bench_into_run(run, where.staging, job.base, job.bench)
        metrics.update(bench.metrics)
    if evaluation is not None or bench is not None:
        card.write(where.staging, where.final, info, metrics, sample)  # now with quality and speed

    _put_in_place(run, where)
    return JobResult(run.run_id, where.final, where.log, metrics, sample, evaluation, bench)


def _record_start(job: Job, run, where: _Where) -> None:
    """What the run is: its staging directory, the resolved recipe (the first artifact), its
    parameters, the memory plan and the dtype it computes in."""
    spec, loaded, q = job.loaded.recipe, job.loaded, job.loaded.recipe.quantize
    run.set_tags({STAGING: where.staging.resolve()})
    run.log_dict(_resolved_record(job), "resolved_recipe.json")  # the first artifact
    run.log_params(loaded.resolved)
    if job.footprint is not None:
        run.log_metrics(job.footprint.metrics())
        for line in job.footprint.lines():  # planned in prepare, before this log file existed
            detail.info("%s", line)
    detail.info("run %s: recipe %s (%s %s), base %s", run.run_id, loaded.name, q.method, q.scheme, job.base.path)
    # on the terminal when the device makes the job compute in another dtype than it saves (bf16 emulated here)
    (log if job.produce_dtype != spec.model.dtype else detail).info(
        "computing in %s, saving in %s (%s)", job.produce_dtype, spec.model.dtype, hardware.device_line()
    )


def _baseline(job: Job, tracker: Tracker, costs: _Costs):
    """The base scored with the suite, before anything is quantized, so that the base and a
    candidate are never loaded together (None without an evaluate: section)."""
    if job.evaluation is None:
        return None
    if not evaluate_stage.baseline_exists(tracker, job.base, job.evaluation):
        job.model = None  # prepare's copy in the compute dtype: the baseline loads the base as stored
    with costs.stage("baseline"):
        return evaluate_stage.get_baseline(tracker, job.base, job.evaluation)


def _check(job: Job, run, where: _Where, costs: _Costs, produced: Produced, base_size_mb: float):
    """The reload check of the staged checkpoint, its hash and quantbench.json, the run's size and
    check metrics, and the model card. Returns (the check, the metrics so far, the card's facts)."""
    spec, quantizer = job.loaded.recipe, job.quantizer
    with costs.stage("check"):
        # hashed before the reload: read after it, the files were mapped a second time beside the
        # loaded model's own mapping of them (the 3B fp8 check's peak counted 5.7 GiB of file pages
        # for a 2.9 GiB checkpoint)
        sha = weights_sha(where.staging)  # same recipe, same seed, same engine versions -> same hash
        detail.info("reloading the saved checkpoint from disk and checking it")
        check = reload_check(
            where.staging,
            spec.check,
            job.check_ids,
            job.base_ppl,
            produced.reference_ppl,
            dtype=hardware.compute_dtype_of(where.staging, job.compute_dtype),
        )
    detail.info("weights sha256 %s (%s)", sha, produced.pinned)
    run.set_tags({TAG + "weights_sha": sha or "none", TAG + "deterministic": produced.pinned})
    write_info(where.staging, {**_checkpoint_info(job, run.run_id), "weights_sha": sha})
    size_mb = weights_size_mb(where.staging)
    if job.produce_estimate is not None:
        produced.metrics["quantize/estimate_s"] = job.produce_estimate.seconds
    metrics = {
        **(job.footprint.metrics() if job.footprint is not None else {}),
        **produced.metrics,
        "model/size_mb": size_mb,
        "model/base_size_mb": base_size_mb,
        "model/compression_ratio": base_size_mb / size_mb,
        **check.metrics,
    }
    bits = bits_per_weight(where.staging)
    if bits is not None:
        metrics["model/bits_per_weight"] = bits
    run.log_metrics(metrics)
    info = card.CardInfo(
        job.loaded, job.base, quantizer.format, quantizer.loaders(), produced.card, len(job.check_ids), run.run_id
    )
    card.write(where.staging, where.final, info, metrics, check.sample)
    return check, metrics, info


def _evaluate(job: Job, run, tracker: Tracker, where: _Where, costs: _Costs, check, baseline, metrics: dict):
    """The candidate (the reload check's model) scored against the base with the suite, then, once
    it is let go, through the serving engine's own quality pass where there is one."""
    assert job.evaluation is not None
    with costs.stage("evaluate"):
        evaluation = evaluate_stage.evaluate(
            check.model, check.tokenizer, job.base, job.evaluation, tracker, baseline=baseline
        )
        run.record(evaluation.metrics, evaluation.tags, {"evaluation.json": evaluation.report})
        metrics.update(evaluation.metrics)
        # llama.cpp's own pass maps the base's F16 file: the de-quantized candidate goes first
        # (at 8B both together held 23.3 GiB of a 23.4 GiB machine)
        check.model = None
        release_freed_memory()
        engine_quality = engine_quality_metrics(where.staging, job.base, job.evaluation, job.tokenizer, where.log)
        run.log_metrics(engine_quality)
        metrics.update(engine_quality)
    return evaluation


def _put_in_place(run, where: _Where) -> None:
    """The staged checkpoint renamed into place (uploaded first where the store is a server's)."""
    if run.shares_artifacts:  # a tracking server's artifact store: other machines fetch it from there
        upload_checkpoint(run, where.staging)
    raise_if_signalled()  # not in place for a run that a lost KeyboardInterrupt would end FINISHED
    where.staging.rename(where.final)
    run.set_tags({TAG + "checkpoint": where.final.resolve()})
    shutil.rmtree(where.workdir, ignore_errors=True)  # done: nothing to resume
    run.log_artifact(where.final / "README.md")
    detail.info("checkpoint: %s", where.final)  # the command says it last


def _produce(job: Job, run, where: _Where) -> tuple[Produced, float]:
    """The quantizer writes the checkpoint into the staging directory, from the base model loaded in
    the compute dtype when it computes on it (prepare's copy, else loaded now), else from files.
    Returns what it reported and the base's size in its saved dtype (MiB)."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = job.loaded.recipe
    where.staging.mkdir(parents=True)
    model = job.take_model() if job.quantizer.takes_model else None
    job.model = None
    if job.quantizer.takes_model and model is None:
        model = AutoModelForCausalLM.from_pretrained(job.base.path, dtype=getattr(torch, job.compute_dtype))
    base_size_mb = base_bytes(job.base.path, spec.model.dtype) / 2**20
    inputs = Inputs(
        job.loaded,
        job.base,
        job.tokenizer,
        job.calibration,
        where.staging,
        where.log,
        where.workdir,
        (job.check_ids, spec.check.window),
        run,
        model=model,
    )
    del model  # the engine takes it (or lets it go)
    with pages_handed_back(_read_once(job)):
        return produce(job.quantizer, inputs), base_size_mb


def _read_once(job: Job) -> list[Path]:
    """The base's files whose pages produce reads once, for a method that writes no weight: handed
    back as read, not kept beside its compressed tensors (8B FP8: 21.0 GiB -> 7.7); [] otherwise."""
    read_once = job.footprint is not None and job.footprint.reads_base_once
    return sorted(job.base.path.glob("*.safetensors")) if read_once else []


def base_bytes(path: Path, dtype: str) -> int:
    """The base model's size in the recipe's dtype (not the one this CPU computes in), from its
    config without loading it: its unique tensors (tied embeddings once), floating ones at that
    dtype's width."""
    import torch
    from transformers import AutoConfig

    model = skeleton(AutoConfig.from_pretrained(path))
    width = getattr(torch, dtype).itemsize
    unique = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * (width if t.is_floating_point() else t.element_size()) for t in unique.values())


def engine_quality_metrics(
    checkpoint: Path, base: models.ResolvedModel, plan, tokenizer, log_path: Path | None
) -> dict:
    """`quality_engine/*` for a GGUF checkpoint: the suite's text scored through llama.cpp itself
    (llama-perplexity against the base's F16 file), beside the suite's own figures (transformers,
    the file de-quantized). {} for other formats."""
    gguf = gguf_file(checkpoint)
    if gguf is None:
        return {}
    work = Path(tempfile.mkdtemp(prefix="qb-engine-quality-"))
    try:
        log_path = log_path or work / "llama.log"
        text = tokenizer.decode(plan.token_ids, skip_special_tokens=True)
        base_file = llamacpp.base_gguf(base.path, log_path=log_path)
        return llamacpp.engine_quality(base_file, gguf, text, plan.suite.suite.window, work, log_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)


class _Steps:
    """`[2/4] reload check` progress lines."""

    def __init__(self, names: list[str]):
        self.names = names

    def __call__(self, name: str) -> None:
        log.info("[%d/%d] %s", self.names.index(name) + 1, len(self.names), name)


def _candidate_tags(job: Job) -> dict[str, str]:
    spec, q = job.loaded.recipe, job.loaded.recipe.quantize
    tags = {
        TAG + "role": "candidate",
        TAG + "recipe": job.loaded.name,
        TAG + "recipe_sha": job.loaded.sha,
        TAG + "method": q.method,
        TAG + "scheme": q.scheme,
        TAG + "engine": job.quantizer.library,
        TAG + "base_model": spec.model.source,
        TAG + "base_fingerprint": job.base.fingerprint,
        TAG + "format": job.quantizer.format,
        TAG + "loaders": job.quantizer.loaders(),
        TAG + "kv_cache": getattr(q, "kv_cache", None) or "none",
        TAG + "compute_dtype": job.produce_dtype,
        TAG + "device": hardware.device_class(),  # the class its times hold for (bench/results_table.py)
        TAG + "license": job.base.license,
        TAG + "bos": data.bos_tag(job.tokenizer, data.bos_id(job.tokenizer)),  # what every window starts with
        **{TAG + k: v for k, v in environment.describe().items()},
        **({TAG + "parent_run": job.base.parent_run} if job.base.parent_run else {}),
        **base_tags(job.base, candidate_type(q)),
        **inherited_tags(),
    }
    what = "distillation (student in bf16) of" if q.method == "distill" else f"{q.method} {q.scheme} of"
    tags["mlflow.note.content"] = (  # the run's description in the MLflow UI
        f"{what} `{spec.model.source}` by recipe `{job.loaded.path}` (sha {job.loaded.sha[:12]}); "
        f"format {job.quantizer.format}. {spec.description}".strip()
    )
    return tags


def _resolved_record(job: Job) -> dict:
    """resolved_recipe.json: the recipe as run, with versions, hardware and git sha."""
    return {
        "recipe": job.loaded.resolved,
        "recipe_file": str(job.loaded.path),
        "overrides": list(job.loaded.overrides),
        "recipe_sha": job.loaded.sha,
        "base_model": {
            "source": job.base.source,
            "path": str(job.base.path),
            "license": job.base.license,
            "fingerprint": job.base.fingerprint,
        },
        "text_sha256": job.text_shas,
        "compute_dtype": job.produce_dtype,
        "environment": environment.describe(),
    }


def _checkpoint_info(job: Job, run_id: str) -> dict:
    """quantbench.json: how this checkpoint was made, for `quantbench evaluate <dir>` and later stages."""
    q = job.loaded.recipe.quantize
    return {
        "run_id": run_id,
        "recipe": job.loaded.name,
        "recipe_sha": job.loaded.sha,
        "method": q.method,
        "scheme": q.scheme,
        "format": job.quantizer.format,
        "loaders": job.quantizer.loaders(),
        "kv_cache": getattr(q, "kv_cache", None),
        "base_model": {
            "source": job.base.source,
            "name": job.base.name,
            "fingerprint": job.base.fingerprint,
            "license": job.base.license,
        },
        "parent_run": job.base.parent_run,
    }


def bench_into_run(
    run, checkpoint: Path, base: models.ResolvedModel, plan: bench_stage.Plan
) -> bench_stage.BenchResult:
    """The bench stage, its result (or what a failed bench measured) logged into `run`."""
    try:
        result = bench_stage.bench(checkpoint, base, plan)
    except bench_stage.BenchFailed as exc:
        _log_bench(run, exc.partial)
        raise
    _log_bench(run, result)
    return result


def _log_bench(run, result: bench_stage.BenchResult) -> None:
    run.record(result.metrics, result.tags, {"bench.json": result.report})
    for path in result.logs:
        run.log_artifact(path, "servers")
    for path in result.plots:
        run.log_artifact(path)
    for path in result.logs[:1] + result.plots[:1]:
        shutil.rmtree(path.parent, ignore_errors=True)
