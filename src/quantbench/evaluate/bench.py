"""`quantbench bench <run id | checkpoint dir> [--profile NAME]`: speed against the base model.

Backend `hf` (in-process transformers generate) is what exists today; see evaluate/speed.py for
what is measured and how. The candidate and its base model are measured in the same run with
the same profile, interleaved, and logged into the checkpoint's MLflow run.
"""

from __future__ import annotations

import logging
from pathlib import Path

from quantbench import data, environment, models
from quantbench.evaluate.job import check_loadable, resolve_target
from quantbench.evaluate.speed import DEFAULT_PROFILE, Profile, bench_pair, load_profile, prompts
from quantbench.tracking import TAG, Tracker

log = logging.getLogger(__name__)
BACKENDS = ("hf",)


def prepare(profile: Profile, tokenizer) -> list[int]:
    """The evaluation text's tokens, checked against the profile's prompt lengths."""
    ids = tokenizer(data.python_docs("evaluation"))["input_ids"]
    for length in profile.prompt_tokens:
        prompts(ids, length, 1, profile.seed)
    return ids


def run(target: str, *, profile: str | None = None, backend: str = "hf", base: str | None = None,
        experiment: str | None = None) -> dict:
    from transformers import AutoTokenizer

    name = profile or DEFAULT_PROFILE
    loaded_profile = load_profile(name)
    tracker = Tracker(experiment)
    tgt = resolve_target(target, tracker, base)
    check_loadable(tgt.checkpoint)
    base_model = models.resolve(tgt.base_source, field="--base")
    ids = prepare(loaded_profile, AutoTokenizer.from_pretrained(tgt.checkpoint))
    if tgt.run_id:
        context = tracker.resume_run(tgt.run_id)
    else:
        context = tracker.start_run(
            f"bench {tgt.checkpoint.name}",
            {TAG + "role": "candidate", TAG + "checkpoint": tgt.checkpoint.resolve(), TAG + "base_model": tgt.base_source,
             TAG + "base_fingerprint": base_model.fingerprint},
        )
    with context as run_:
        metrics = bench_loaded(tgt.checkpoint, base_model, ids, name, loaded_profile, run_, backend)
    return {"run_id": run_.run_id, "checkpoint": str(tgt.checkpoint), "metrics": metrics}


def bench_loaded(checkpoint: Path, base: models.ResolvedModel, ids: list[int], profile_name: str, profile: Profile,
                 run, backend: str = "hf") -> dict[str, float]:
    """Measure `checkpoint` against `base` and log into `run` (the quantize stage calls this)."""
    import torch
    from transformers import AutoModelForCausalLM

    base_dtype = "auto" if profile.base_dtype == "auto" else getattr(torch, profile.base_dtype)
    log.info("bench: %s vs base %s, profile %s, backend %s", checkpoint, base.name, profile_name, backend)
    result = bench_pair(
        lambda: AutoModelForCausalLM.from_pretrained(checkpoint),
        lambda: AutoModelForCausalLM.from_pretrained(base.path, dtype=base_dtype),
        ids,
        profile,
    )
    metrics = {**result.metrics, "model/size_mb": models.weights_size_mb(checkpoint)}
    run.log_metrics(metrics)
    run.set_tags({TAG + "bench_backend": backend, TAG + "bench_profile": profile_name,
                  TAG + "bench_base_dtype": profile.base_dtype})
    spread = {
        model: {key: {"median": sorted(v)[len(v) // 2], "min": min(v), "max": max(v), "values": v} for key, v in rows.items()}
        for model, rows in result.samples.items()
    }
    run.log_dict({"backend": backend, "profile": profile_name, "profile_settings": profile.model_dump(mode="json"),
                  "hardware": environment.describe(), "metrics": metrics, "samples": spread}, "bench.json")
    print(table(metrics))
    return metrics


def table(metrics: dict[str, float]) -> str:
    rows = [f"{'metric':28s} {'base':>10s} {'candidate':>10s} {'speedup':>8s}"]
    for key in sorted(k for k in metrics if k.startswith("speed/")):
        short = key.removeprefix("speed/")
        rows.append(f"{short:28s} {metrics['base_' + key]:10.4g} {metrics[key]:10.4g} {metrics['speedup/' + short]:8.3f}")
    return "\n".join(rows)
