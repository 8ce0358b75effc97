"""The evaluate stage: a loaded checkpoint's quality against its base model.

One quality pass over held-out text (perplexity, KL divergence to the base model, top-1
agreement), the same over out-of-domain text (`quality_ood/*`), task evals through lm-eval,
answer flips against the base model's per-item results, and recovery (the share of the base
model's score kept; above 1 is better); each with a paired 95 % interval where the suite has
units enough (intervals.py, docs/intervals.md). The base model is scored once per (model
fingerprint, suite fingerprint) in its own MLflow run tagged `quantbench.role=baseline`, with what
its next-token distributions are computed from and its per-item task values stored as artifacts;
every later candidate reuses that run.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from quantbench import engines
from quantbench.core import environment, hardware, intervals, paths
from quantbench.core.errors import UserError
from quantbench.core.logs import DETAIL
from quantbench.core.measures import Reference, compare
from quantbench.core.measures import reference as reference_of  # `reference` is a loop variable below
from quantbench.core.upcast import float32_compute
from quantbench.engines import ServerSettings
from quantbench.engines.server import model_server
from quantbench.metrics import RECOVERABLE, direction
from quantbench.quality.suite import BASELINE_FORMAT, LoadedSuite, suites_dir
from quantbench.quality.tasks import (
    Items,
    check_tasks,
    correct,
    flips,
    item_intervals,
    run_tasks,
    score,
    served_lm,
    write_offline_suite,
)
from quantbench.sources import data, models
from quantbench.tracking import TAG, Tracker

if TYPE_CHECKING:
    from quantbench.engines import ServingEngine

log = logging.getLogger(__name__)
detail = logging.getLogger(DETAIL)  # the run's log file only: its bars show the progress

REFERENCE = "baseline/reference.safetensors"
REFERENCE_OOD = "baseline/reference_ood.safetensors"
SAMPLES = "baseline/task_samples.json"


@dataclass
class Plan:
    """The suite and its data, checked and tokenized before any run starts."""

    suite: LoadedSuite
    token_ids: list[int]
    text_sha: str
    tasks_dir: Path
    task_counts: dict[str, int]
    ood_ids: list[int] | None = None  # the out-of-domain text's tokens, when the suite has one
    ood_sha: str | None = None
    bos: int | None = None  # the BOS id every window starts with (data.bos_id); None: the text's own tokens
    bos_tag: str = "none"  # the same as the run's quantbench.bos tag says it (data.bos_tag)

    @property
    def fingerprint(self) -> str:
        """The texts and the very token ids scored: a tokenizer that splits the same text otherwise
        (another conversion of the same weights) must not reuse a baseline scored on other ids, nor
        one scored with a BOS at the start of every window reuse one scored without (the ids are
        laid out as their windows, BOS included: data.framed)."""
        ood = self.ood_sha and self.ood_sha + ":" + data.text_sha(str(self.ood_ids))
        return self.suite.fingerprint(self.text_sha + ":" + data.text_sha(str(self.token_ids)), ood)

    @property
    def bootstrap(self) -> intervals.Bootstrap:
        spec = self.suite.suite.intervals
        return intervals.Bootstrap(spec.resamples, spec.seed)


@dataclass
class Baseline:
    run_id: str
    metrics: dict[str, float]
    reference: Reference
    items: Items  # the base model's per-item task values
    reused: bool
    reference_ood: Reference | None = None

    @property
    def correct(self) -> dict[str, dict[int, bool]]:
        return correct(self.items)


@dataclass
class Evaluation:
    """The evaluate stage's result: what the pipeline logs into the candidate's run."""

    metrics: dict[str, float]
    baseline_metrics: dict[str, float]
    baseline_run: str
    baseline_reused: bool
    tags: dict[str, str]
    report: dict  # evaluation.json
    notes: list[str] = field(default_factory=list)  # metrics left without an interval, and why


# ---------------------------------------------------------------------------------------------
# prepare: every input check before anything runs


def prepare(suite: LoadedSuite, tokenizer) -> Plan:
    spec = suite.suite
    where = str(suites_dir() / f"{suite.name}.yaml")
    try:
        text = data.load_text(spec.text, field="text", split="evaluation")
    except UserError as exc:
        raise UserError([f"{where}: {p}" for p in exc.problems]) from None
    bos = data.bos_id(tokenizer)
    text_ids = data.text_ids(tokenizer, text)
    ids = data.framed(text_ids, spec.window, bos)[: spec.tokens]
    if len(ids) < spec.window:
        raise UserError(
            f"{where}: text: the evaluation text has {len(text_ids[: spec.tokens])} tokens, shorter than one window "
            f"(window={spec.window}); give a longer text or a smaller window"
        )
    ood_ids = ood_sha = None
    if spec.ood_text is not None:
        try:
            ood = data.load_text(spec.ood_text, field="ood_text", split="evaluation")
        except UserError as exc:
            raise UserError([f"{where}: {p}" for p in exc.problems]) from None
        ood_text_ids, ood_sha = data.text_ids(tokenizer, ood), data.text_sha(ood)
        ood_ids = data.framed(ood_text_ids, spec.window, bos)[: spec.tokens]
        if len(ood_ids) < spec.window:
            raise UserError(
                f"{where}: ood_text: the out-of-domain text has {len(ood_text_ids[: spec.tokens])} tokens, "
                f"shorter than one window (window={spec.window}); give a longer text, a smaller window, or ood_text: null"
            )
    docs = data.python_docs("evaluation")
    tasks_dir = paths.cache_dir() / "tasks" / data.text_sha(docs)[:16]
    counts = write_offline_suite(docs, tasks_dir)
    check_tasks(spec.tasks, tasks_dir)
    return Plan(suite, ids, data.text_sha(text), tasks_dir, counts, ood_ids, ood_sha, bos, data.bos_tag(tokenizer, bos))


def evaluate(
    model, tokenizer, base: models.ResolvedModel, p: Plan, tracker: Tracker, baseline: Baseline | None = None
) -> Evaluation:
    """Score an already-loaded candidate against its base model (`baseline`, or the baseline run
    found in, or added to, `tracker`'s experiment: then the base is loaded beside the candidate; a
    job scores it before it loads a candidate)."""
    spec = p.suite.suite
    started = time.perf_counter()
    baseline = baseline or get_baseline(tracker, base, p)
    baseline_s = time.perf_counter() - started
    detail.info("evaluate: quality pass over %d held-out tokens", len(p.token_ids))
    comparison = compare(model, p.token_ids, spec.window, baseline.reference, spec.batch_size)
    metrics = comparison.metrics()
    if spec.position_buckets:
        metrics.update(comparison.by_position(spec.position_buckets))
    ood = None
    if p.ood_ids is not None:
        detail.info("evaluate: quality pass over %d out-of-domain tokens (%s)", len(p.ood_ids), spec.ood_text)
        ood = compare(model, p.ood_ids, spec.window, baseline.reference_ood, spec.batch_size)
        metrics.update(ood.metrics("quality_ood/"))
        if spec.position_buckets:
            metrics.update(ood.by_position(spec.position_buckets, "quality_ood/"))
    detail.info("evaluate: tasks %s", ", ".join(spec.tasks))
    tasks = run_tasks(model, tokenizer, spec.tasks, p.tasks_dir, limit=spec.task_limit, batch_size=spec.task_batch_size)
    metrics.update(tasks.metrics)
    metrics.update(flips(baseline.correct, tasks.correct))
    metrics.update(recovery(metrics, baseline.metrics))
    before = time.perf_counter()
    bounds, notes = _intervals(p, baseline, comparison, ood, tasks.items, metrics)
    interval_s = time.perf_counter() - before
    metrics.update(bounds)
    for note in notes:
        detail.info("evaluate: no interval for %s", note)  # the verdict says it where a policy needs one
    tags = {
        TAG + "baseline_run": baseline.run_id,
        TAG + "suite": p.suite.name,
        TAG + "suite_sha": p.fingerprint,
        TAG + "bos": p.bos_tag,
    }
    report = {
        "suite": p.suite.name,
        "suite_sha": p.fingerprint,
        "suite_settings": spec.model_dump(mode="json"),
        # what every window of the quality pass starts with: the tokenizer's BOS, or none (the text itself)
        "bos": p.bos_tag,
        "bos_id": p.bos,
        "task_items_available": p.task_counts,
        "task_items_scored": tasks.counts,
        "baseline_run": baseline.run_id,
        "baseline_reused": baseline.reused,
        "metrics": metrics,
        "baseline_metrics": baseline.metrics,
        "lm_eval_results": tasks.raw,
        "samples": {task: {str(k): v for k, v in items.items()} for task, items in tasks.correct.items()},
        "item_values": {task: {str(k): v for k, v in items.items()} for task, items in tasks.items.items()},
        "kld_per_position": [round(x, 6) for x in comparison.kld.tolist()],
        "intervals": {
            "confidence": intervals.CONFIDENCE,
            "resamples": spec.intervals.resamples,
            "seed": spec.intervals.seed,
            "method": "paired percentile bootstrap: whole windows (quality pass), items (tasks, flips)",
            "windows": comparison.windows,
            "ood_windows": ood.windows if ood else None,
            "min_units": intervals.MIN_UNITS,
            "seconds": interval_s,
            "not_computed": notes,
        },
        # wall time of this stage: all of it, the part spent finding (or scoring) the baseline, the intervals
        "seconds": {"evaluate": time.perf_counter() - started, "baseline": baseline_s, "intervals": interval_s},
    }
    return Evaluation(metrics, baseline.metrics, baseline.run_id, baseline.reused, tags, report, notes)


def _intervals(
    p: Plan, baseline: Baseline, comparison, ood, items: Items, metrics: dict[str, float]
) -> tuple[dict, list[str]]:
    """Every interval the suite has units for, and a note for each family left without one."""
    boot = p.bootstrap
    if boot.resamples == 0:
        return {}, ["every metric: the suite sets intervals.resamples: 0"]
    out, notes = {}, []
    for prefix, result, reference in (
        ("quality/", comparison, baseline.reference),
        ("quality_ood/", ood, baseline.reference_ood),
    ):
        if result is None:
            continue
        if intervals.enough(result.windows):
            out.update(result.intervals(reference.nll, boot, prefix))
            if p.suite.suite.position_buckets:
                out.update(result.position_intervals(p.suite.suite.position_buckets, boot, prefix))
        else:
            notes.append(
                f"{prefix}* and recovery/{prefix}ppl: {result.windows} windows, too few for an interval "
                f"(at least {intervals.MIN_UNITS}: raise tokens or lower window)"
            )
    task_bounds, task_notes = item_intervals(baseline.items, items, metrics, boot)
    return {**out, **task_bounds}, notes + task_notes


def _baseline_keys(base: models.ResolvedModel, p: Plan) -> dict[str, str]:
    return {TAG + "role": "baseline", TAG + "base_fingerprint": base.fingerprint, TAG + "suite_sha": p.fingerprint}


def baseline_exists(tracker: Tracker, base: models.ResolvedModel, p: Plan) -> bool:
    """Whether the base model was scored with this suite already (its baseline run is reused)."""
    return bool(tracker.find_runs(_baseline_keys(base, p)))


def get_baseline(tracker: Tracker, base: models.ResolvedModel, p: Plan) -> Baseline:
    """The base model's scores for this suite: reused when a baseline run exists, else made (the
    base loaded as stored and computed in float32 one module at a time: one copy of the model)."""
    keys = _baseline_keys(base, p)
    found = tracker.find_runs(keys)
    if found:
        run = tracker.existing(found[0])
        log.info("evaluate: reusing baseline run %s", run.run_id)
        # the reference stays mapped, read only by the evaluation, after its directory is gone: on
        # disk, not in a /tmp that may be memory (tmpfs), where it would take RAM from produce on
        scratch = paths.cache_dir() / "tmp"
        scratch.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=scratch) as tmp:
            reference = Reference.load(run.download(REFERENCE, Path(tmp)))
            reference_ood = Reference.load(run.download(REFERENCE_OOD, Path(tmp))) if p.ood_ids is not None else None
            samples = json.loads(run.download(SAMPLES, Path(tmp)).read_text())
        items = {task: {int(k): v for k, v in docs.items()} for task, docs in samples["tasks"].items()}
        return Baseline(run.run_id, dict(run.data.metrics), reference, items, reused=True, reference_ood=reference_ood)
    return _score_baseline(tracker, base, p, keys)


def _score_baseline(tracker: Tracker, base: models.ResolvedModel, p: Plan, keys: dict) -> Baseline:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = p.suite.suite
    tags = {
        **keys,
        TAG + "base_model": base.source,
        TAG + "license": base.license,
        TAG + "suite": p.suite.name,
        TAG + "bos": p.bos_tag,
        **{TAG + k: v for k, v in environment.describe().items()},
    }
    log.info("evaluate: scoring the base model %s once for suite %s (baseline run)", base.name, p.suite.name)
    tags["mlflow.note.content"] = (
        f"The base model `{base.source}` scored with suite `{p.suite.name}`; candidates reuse it."
    )
    with tracker.start_run(f"baseline · {models.short_name(base.source)} · {p.suite.name}", tags) as run:
        run.log_params({"suite": spec.model_dump(mode="json")})
        # the reference distributions in float32, whatever the base is saved in: a bfloat16-saved
        # base (a distilled student, quantized further) computed in bfloat16 gave bfloat16 logits
        # that its float32 head could not rebuild (reference() refused it), and is emulated on
        # AVX2-only CPUs. Loaded as saved and computed in float32 a module at a time (the same
        # results as a float32 copy, half its memory for a 16-bit base).
        model = AutoModelForCausalLM.from_pretrained(base.path, dtype="auto").eval()
        tokenizer = AutoTokenizer.from_pretrained(base.path)
        with float32_compute(model):
            ref, ref_ood, tasks = _score_base(model, tokenizer, p)
        metrics = {"quality/ppl": math.exp(ref.nll.double().mean().item()), "quality/positions": float(len(ref.nll))}
        del model
        if ref_ood is not None:
            metrics.update(
                {
                    "quality_ood/ppl": math.exp(ref_ood.nll.double().mean().item()),
                    "quality_ood/positions": float(len(ref_ood.nll)),
                }
            )
        metrics.update(tasks.metrics)
        with tempfile.TemporaryDirectory() as tmp:
            samples_path = Path(tmp) / "task_samples.json"
            for name, kept in (("reference.safetensors", ref), ("reference_ood.safetensors", ref_ood)):
                if kept is not None:
                    kept.save(Path(tmp) / name)
                    run.log_artifact(Path(tmp) / name, "baseline")
            samples_path.write_text(
                json.dumps(
                    {
                        "format": BASELINE_FORMAT,
                        "tasks": {t: {str(k): v for k, v in docs.items()} for t, docs in tasks.items.items()},
                    }
                )
            )
            run.log_artifact(samples_path, "baseline")
        run.log_metrics(metrics)
        run.log_dict(
            {"metrics": metrics, "lm_eval_results": tasks.raw, "task_items_scored": tasks.counts}, "evaluation.json"
        )
    return Baseline(run.run_id, metrics, ref, tasks.items, reused=False, reference_ood=ref_ood)


def _score_base(model, tokenizer, p: Plan):
    """The base model's reference over the suite's texts and its task values."""
    spec = p.suite.suite
    ref = reference_of(model, p.token_ids, spec.window, spec.batch_size)
    ref_ood = reference_of(model, p.ood_ids, spec.window, spec.batch_size) if p.ood_ids is not None else None
    tasks = run_tasks(model, tokenizer, spec.tasks, p.tasks_dir, limit=spec.task_limit, batch_size=spec.task_batch_size)
    return ref, ref_ood, tasks


def recovery(metrics: dict[str, float], baseline: dict[str, float]) -> dict[str, float]:
    """recovery/<m> for quality/ppl, quality_ood/ppl and task/*: the share of the base model's score
    kept, above 1 better, so for a lower-is-better metric (perplexity) it is baseline / candidate."""
    out = {}
    for key, value in metrics.items():
        base = baseline.get(key)
        if base and value and RECOVERABLE.fullmatch(key):
            out[f"recovery/{key}"] = base / value if direction(key) == "lower" else value / base
    return out


# ---------------------------------------------------------------------------------------------
# Quality through the serving engine (`evaluate --engine vllm`)


@dataclass
class EnginePlan:
    engine: ServingEngine
    checkpoint: Path
    dtype: str  # --dtype: the dtype transformers loads the checkpoint in, so that only the engine differs
    max_len: int


@dataclass
class EngineTasks:
    """The suite's tasks scored on the served checkpoint: task_engine/<task>/<metric> and
    quality/engine_flips_* against transformers on the same checkpoint."""

    metrics: dict[str, float]
    tags: dict[str, str]
    report: dict  # evaluation_engine.json
    logs: list[Path]


def prepare_engine(name: str, checkpoint: Path, p: Plan) -> EnginePlan:
    """Every check before the run: tasks to score, an engine that scores through its API, a format
    it serves here, its environment (created if missing). UserError otherwise."""
    engine = engines.get(name, "--engine")
    if name not in engines.scoring():
        raise UserError(
            f"--engine {name}: {engine.label} gives no prompt log-probabilities to score tasks with. "
            f"Engines that do: {', '.join(engines.scoring())}"
        )
    if not p.suite.suite.tasks:
        raise UserError(f"--engine {name}: suite '{p.suite.name}' has no lm-eval tasks to score through the engine")
    problem = engine.unavailable() or engine.unserved(checkpoint)
    if problem:
        raise UserError(f"--engine {name}: {engine.label} does not serve {checkpoint} here: {problem}")
    engine.ensure(f"--engine {name}")
    dtype = hardware.saved_dtype(json.loads((checkpoint / "config.json").read_text())) or "auto"
    limit = engine.max_model_len(checkpoint) or 2048
    return EnginePlan(engine, checkpoint, dtype, min(limit, 4096))


def engine_tasks(
    ep: EnginePlan, p: Plan, transformers_correct: dict[str, dict[int, bool]], logs: list[Path]
) -> EngineTasks:
    """Serve the checkpoint with the engine (eager: start-up time matters here, not decode speed) and score
    the suite's tasks through lm-eval's local-completions model against it. The server's log is
    appended to `logs` before it starts (the caller keeps it whatever happens)."""
    spec = p.suite.suite
    directory = Path(tempfile.mkdtemp(prefix="qb-engine-"))
    logs.append(directory / "engine.log")
    described = ep.engine.describe(compiled=False)
    log.info(
        "evaluate --engine %s: serving %s with %s (%s) and scoring %s",
        ep.engine.name,
        ep.checkpoint,
        described,
        ep.dtype,
        ", ".join(spec.tasks),
    )
    settings = ServerSettings(ep.max_len, compiled=False, dtype=ep.dtype)
    with model_server(ep.checkpoint, logs[-1], ep.engine, settings) as (url, name, _):
        # max_tokens 1 is generated after the echoed prompt: the prompt gets one token less
        lm = served_lm(url, name, str(ep.checkpoint), max_length=ep.max_len - 1, batch_size=spec.task_batch_size)
        tasks = score(lm, spec.tasks, p.tasks_dir, limit=spec.task_limit)
    metrics = {"task_engine/" + k.removeprefix("task/"): v for k, v in tasks.metrics.items()}
    metrics |= flips(transformers_correct, tasks.correct, prefix="quality/engine_flips")
    tags = {TAG + "task_engine": f"{described} ({ep.dtype})"}
    report = {
        "engine": described,
        "dtype": ep.dtype,
        "max_model_len": ep.max_len,
        "metrics": metrics,
        "task_items_scored": tasks.counts,
        "lm_eval_results": tasks.raw,
        "samples": {t: {str(k): v for k, v in items.items()} for t, items in tasks.correct.items()},
    }
    return EngineTasks(metrics, tags, report, list(logs))
