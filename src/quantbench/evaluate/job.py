"""`quantbench evaluate <run id | checkpoint dir>`: quality against the base model.

One quality pass over held-out text (perplexity, KL divergence to the base model, top-1
agreement), task evals through lm-eval, answer flips against the base model's per-item results,
and recovery (the share of the base model's score kept; above 1 is better). The base model is scored once per (model fingerprint,
suite fingerprint) in its own MLflow run tagged `quantbench.role=baseline`, with its top-k
next-token distributions stored as an artifact; every later candidate reuses that run.
"""

from __future__ import annotations

import json
import logging
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from quantbench import data, models
from quantbench.errors import UserError
from quantbench.evaluate.suite import DEFAULT_SUITE, LoadedSuite, load_suite
from quantbench.evaluate.tasks import check_tasks, flips, run_tasks, write_offline_suite
from quantbench.metrics import RECOVERABLE, direction
from quantbench.tracking import TAG, Tracker, tracking_uri

log = logging.getLogger(__name__)

CHECKPOINT_INFO = "quantbench.json"  # written by the quantize stage into every checkpoint
REFERENCE = "baseline/reference.safetensors"
SAMPLES = "baseline/task_samples.json"
# Package each checkpoint format needs to load (quantization_config.quant_method -> package)
FORMAT_PACKAGES = {"compressed-tensors": "compressed_tensors", "bitsandbytes": "bitsandbytes", "gptq": "gptqmodel", "awq": "gptqmodel"}


@dataclass
class Prepared:
    suite: LoadedSuite
    token_ids: list[int]
    text_sha: str
    tasks_dir: Path
    task_counts: dict[str, int]

    @property
    def fingerprint(self) -> str:
        return self.suite.fingerprint(self.text_sha)


@dataclass
class Baseline:
    run_id: str
    metrics: dict[str, float]
    reference: object
    correct: dict[str, dict[int, bool]]
    reused: bool


@dataclass
class Target:
    checkpoint: Path
    run_id: str | None
    base_source: str
    info: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# prepare: every input check before anything runs


def prepare(suite: LoadedSuite, tokenizer) -> Prepared:
    spec = suite.suite
    where = f"suites/{suite.name}.yaml"
    try:
        text = data.load_text(spec.text, field="text", split="evaluation")
    except UserError as exc:
        raise UserError([f"{where}: {p}" for p in exc.problems]) from None
    ids = tokenizer(text)["input_ids"][: spec.tokens]
    if len(ids) < spec.window:
        raise UserError(
            f"{where}: text: the evaluation text has {len(ids)} tokens, shorter than one window "
            f"(window={spec.window}); give a longer text or a smaller window"
        )
    docs = data.python_docs("evaluation")
    tasks_dir = models.cache_dir() / "tasks" / data.text_sha(docs)[:16]
    counts = write_offline_suite(docs, tasks_dir)
    check_tasks(spec.tasks, tasks_dir)
    return Prepared(suite, ids, data.text_sha(text), tasks_dir, counts)


def resolve_target(target: str, tracker: Tracker, base: str | None) -> Target:
    path = Path(target)
    if path.exists():
        if not (path.is_dir() and (path / "config.json").is_file()):
            raise UserError(f"'{target}' is not a model directory (no config.json)")
        info_file = path / CHECKPOINT_INFO
        info = json.loads(info_file.read_text()) if info_file.is_file() else {}
        run_id = info.get("run_id")
        if run_id and tracker.existing(run_id) is None:
            run_id = None  # made against another tracking store: evaluate into a new run
        source = base or info.get("base_model", {}).get("source")
        if not source:
            raise UserError(f"'{target}' was not written by quantbench: name its base model with --base SOURCE")
        return Target(path, run_id, source, info)
    if not re.fullmatch(r"[0-9a-f]{32}", target):
        raise UserError(f"'{target}' is neither a checkpoint directory nor an MLflow run id")
    run = tracker.existing(target)
    if run is None:
        raise UserError(f"MLflow run '{target}' does not exist at the tracking store ({tracking_uri()})")
    tags = run.data.tags
    checkpoint = tags.get(TAG + "checkpoint")
    if not checkpoint or not (Path(checkpoint) / "config.json").is_file():
        raise UserError(f"MLflow run '{target}' has no checkpoint on this machine (tag {TAG}checkpoint: {checkpoint or 'none'})")
    return Target(Path(checkpoint), target, base or tags[TAG + "base_model"])


def target_run(tracker: Tracker, tgt: Target, base: models.ResolvedModel, stage: str):
    """The checkpoint's own MLflow run, reopened; or a new candidate run for a foreign checkpoint."""
    if tgt.run_id:
        return tracker.resume_run(tgt.run_id)
    return tracker.start_run(
        f"{stage} {tgt.checkpoint.name} · {models.short_name(tgt.base_source)}",
        {TAG + "role": "candidate", TAG + "checkpoint": tgt.checkpoint.resolve(), TAG + "base_model": tgt.base_source,
         TAG + "base_fingerprint": base.fingerprint},
    )


def check_loadable(checkpoint: Path) -> None:
    """A checkpoint whose format needs a package that is missing: say which."""
    import importlib.util

    config = json.loads((checkpoint / "config.json").read_text())
    method = (config.get("quantization_config") or {}).get("quant_method")
    package = FORMAT_PACKAGES.get(method)
    if package and importlib.util.find_spec(package) is None:
        raise UserError(f"'{checkpoint}' is a {method} checkpoint; loading it needs the package '{package}', which is not installed")


# ---------------------------------------------------------------------------------------------
# The verb


def run(target: str, *, suite: str | None = None, base: str | None = None, experiment: str | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded_suite = load_suite(suite or DEFAULT_SUITE)
    tracker = Tracker(experiment)
    tgt = resolve_target(target, tracker, base)
    check_loadable(tgt.checkpoint)
    base_model = models.resolve(tgt.base_source, field="--base")
    tokenizer = AutoTokenizer.from_pretrained(tgt.checkpoint)
    prepared = prepare(loaded_suite, tokenizer)

    with target_run(tracker, tgt, base_model, "evaluate") as run:
        model = AutoModelForCausalLM.from_pretrained(tgt.checkpoint)
        result = evaluate_loaded(model, tokenizer, base_model, prepared, run, tracker)
    return {"run_id": run.run_id, "checkpoint": str(tgt.checkpoint), **result}


def evaluate_loaded(model, tokenizer, base: models.ResolvedModel, p: Prepared, run, tracker: Tracker) -> dict:
    """Score an already-loaded candidate into `run` (the quantize stage calls this too)."""
    from quantbench.evaluate.quality import compare

    spec = p.suite.suite
    baseline = get_baseline(tracker, base, p)
    log.info("evaluate: quality pass over %d held-out tokens", len(p.token_ids))
    comparison = compare(model, p.token_ids, spec.window, baseline.reference, spec.batch_size)
    metrics = comparison.metrics()
    log.info("evaluate: tasks %s", ", ".join(spec.tasks))
    tasks = run_tasks(model, tokenizer, spec.tasks, p.tasks_dir, limit=spec.task_limit, batch_size=spec.task_batch_size)
    metrics.update(tasks.metrics)
    metrics.update(flips(baseline.correct, tasks.correct))
    metrics.update(recovery(metrics, baseline.metrics))
    run.log_metrics(metrics)
    run.set_tags({TAG + "baseline_run": baseline.run_id, TAG + "suite": p.suite.name, TAG + "suite_sha": p.fingerprint})
    report = {
        "suite": p.suite.name,
        "suite_sha": p.fingerprint,
        "suite_settings": spec.model_dump(mode="json"),
        "task_items_available": p.task_counts,
        "task_items_scored": tasks.counts,
        "baseline_run": baseline.run_id,
        "baseline_reused": baseline.reused,
        "metrics": metrics,
        "baseline_metrics": baseline.metrics,
        "lm_eval_results": tasks.raw,
        "samples": {task: {str(k): v for k, v in items.items()} for task, items in tasks.correct.items()},
        "kld_per_position": [round(x, 6) for x in comparison.kld.tolist()],
    }
    run.log_dict(report, "evaluation.json")
    print(table(metrics, baseline.metrics))
    return {"baseline_run": baseline.run_id, "baseline_reused": baseline.reused, "metrics": metrics}


def get_baseline(tracker: Tracker, base: models.ResolvedModel, p: Prepared) -> Baseline:
    """The base model's scores for this suite: reused when a baseline run exists, else made."""
    from quantbench.evaluate.quality import Reference

    keys = {TAG + "role": "baseline", TAG + "base_fingerprint": base.fingerprint, TAG + "suite_sha": p.fingerprint}
    found = tracker.find_runs(keys)
    if found:
        run = tracker.existing(found[0])
        log.info("evaluate: reusing baseline run %s", run.run_id)
        with tempfile.TemporaryDirectory() as tmp:
            reference = Reference.load(run.download(REFERENCE, Path(tmp)))
            samples = json.loads(run.download(SAMPLES, Path(tmp)).read_text())
        correct = {task: {int(k): v for k, v in items.items()} for task, items in samples.items()}
        return Baseline(run.run_id, dict(run.data.metrics), reference, correct, reused=True)
    return _score_baseline(tracker, base, p, keys)


def _score_baseline(tracker: Tracker, base: models.ResolvedModel, p: Prepared, keys: dict) -> Baseline:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantbench import environment
    from quantbench.evaluate.quality import reference

    spec = p.suite.suite
    tags = {**keys, TAG + "base_model": base.source, TAG + "license": base.license, TAG + "suite": p.suite.name,
            **{TAG + k: v for k, v in environment.describe().items()}}
    log.info("evaluate: scoring the base model %s once for suite %s (baseline run)", base.name, p.suite.name)
    tags["mlflow.note.content"] = f"The base model `{base.source}` scored with suite `{p.suite.name}`; candidates reuse it."
    with tracker.start_run(f"baseline · {models.short_name(base.source)} · {p.suite.name}", tags) as run:
        run.log_params({"suite": spec.model_dump(mode="json")})
        model = AutoModelForCausalLM.from_pretrained(base.path, dtype="auto")
        tokenizer = AutoTokenizer.from_pretrained(base.path)
        ref = reference(model, p.token_ids, spec.window, spec.batch_size)
        tasks = run_tasks(model, tokenizer, spec.tasks, p.tasks_dir, limit=spec.task_limit, batch_size=spec.task_batch_size)
        metrics = {"quality/ppl": math.exp(ref.nll.double().mean().item()), "quality/positions": float(len(ref.nll)), **tasks.metrics}
        with tempfile.TemporaryDirectory() as tmp:
            ref_path, samples_path = Path(tmp) / "reference.safetensors", Path(tmp) / "task_samples.json"
            ref.save(ref_path)
            samples_path.write_text(json.dumps({t: {str(k): v for k, v in items.items()} for t, items in tasks.correct.items()}))
            run.log_artifact(ref_path, "baseline")
            run.log_artifact(samples_path, "baseline")
        run.log_metrics(metrics)
        run.log_dict({"metrics": metrics, "lm_eval_results": tasks.raw, "task_items_scored": tasks.counts}, "evaluation.json")
    return Baseline(run.run_id, metrics, ref, tasks.correct, reused=False)


def recovery(metrics: dict[str, float], baseline: dict[str, float]) -> dict[str, float]:
    """recovery/<m> for quality/ppl and task/*: the share of the base model's score kept, above 1
    better, so for a lower-is-better metric (perplexity) it is baseline / candidate."""
    out = {}
    for key, value in metrics.items():
        base = baseline.get(key)
        if base and value and RECOVERABLE.fullmatch(key):
            out[f"recovery/{key}"] = base / value if direction(key) == "lower" else value / base
    return out


def table(metrics: dict[str, float], baseline: dict[str, float]) -> str:
    rows = [f"{'metric':42s} {'baseline':>10s} {'candidate':>10s} {'recovery':>9s}  better"]
    for key in sorted(k for k in metrics if not k.startswith("recovery/")):
        base = baseline.get(key)
        rec = metrics.get(f"recovery/{key}")
        better = direction(key) or ""
        rows.append(f"{key:42s} {_fmt(base):>10s} {_fmt(metrics[key]):>10s} {_fmt(rec):>9s}  {better}")
    return "\n".join(rows)


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"
