"""`quantbench bench <run id | checkpoint dir> [--profile NAME] [--backend hf|openai|serve]`.

Speed against the base model: the candidate and its base are measured in the same run with the
same profile, interleaved, and logged into the checkpoint's MLflow run. evaluate/speed.py says
what is measured; evaluate/serving.py holds the `openai` and `serve` backends.
"""

from __future__ import annotations

import logging
import tempfile
from contextlib import contextmanager
from pathlib import Path

from quantbench import data, environment, models
from quantbench.evaluate.job import check_loadable, resolve_target, target_run
from quantbench.errors import UserError
from quantbench.evaluate.speed import DEFAULT_PROFILE, PartialBench, Profile, bench_pair, hf_measurer, load_profile, prompts
from quantbench.tracking import TAG, Tracker

log = logging.getLogger(__name__)
BACKENDS = ("hf", "openai", "serve")


def prepare(profile: Profile, tokenizer) -> list[int]:
    """The evaluation text's tokens, checked against the profile's prompt lengths."""
    ids = tokenizer(data.python_docs("evaluation"))["input_ids"]
    for length in profile.prompt_tokens:
        prompts(ids, length, 1, profile.seed)
    return ids


def run(target: str, *, profile: str | None = None, backend: str = "hf", base: str | None = None,
        experiment: str | None = None, endpoint: str | None = None, base_endpoint: str | None = None,
        server: str = "auto") -> dict:
    from transformers import AutoTokenizer

    from quantbench.evaluate.serving import pick_server

    name = profile or DEFAULT_PROFILE
    loaded_profile = load_profile(name)
    endpoints = None
    if backend == "openai":
        if not (endpoint and base_endpoint):
            raise UserError("--backend openai needs --endpoint URL (the checkpoint) and --base-endpoint URL (its base model)")
        from quantbench.evaluate.serving import check_endpoint

        check_endpoint(endpoint, "--endpoint")
        check_endpoint(base_endpoint, "--base-endpoint")
        endpoints = (endpoint, base_endpoint)
    engine = pick_server(server) if backend == "serve" else None
    tracker = Tracker(experiment)
    tgt = resolve_target(target, tracker, base)
    check_loadable(tgt.checkpoint)
    base_model = models.resolve(tgt.base_source, field="--base")
    ids = prepare(loaded_profile, AutoTokenizer.from_pretrained(tgt.checkpoint))
    with target_run(tracker, tgt, base_model, "bench") as run_:
        metrics = bench_loaded(tgt.checkpoint, base_model, ids, name, loaded_profile, run_, backend, endpoints, engine)
    return {"run_id": run_.run_id, "checkpoint": str(tgt.checkpoint), "metrics": metrics}


def bench_loaded(checkpoint: Path, base: models.ResolvedModel, ids: list[int], profile_name: str, profile: Profile,
                 run, backend: str = "hf", endpoints: tuple[str, str] | None = None,
                 server: str | None = None) -> dict[str, float]:
    """Measure `checkpoint` against `base` and log into `run` (the quantize stage calls this).
    If the backend fails part-way, what was measured is logged as a partial bench.json first."""
    if backend == "serve" and server is None:
        from quantbench.evaluate.serving import pick_server

        server = pick_server("auto")
    log.info("bench: %s vs base %s, profile %s, backend %s%s", checkpoint, base.name, profile_name, backend,
             f" ({server})" if backend == "serve" else "")
    report = {"backend": backend, "server": server, "profile": profile_name,
              "profile_settings": profile.model_dump(mode="json"), "hardware": environment.describe()}
    run.set_tags({TAG + "bench_backend": backend, TAG + "bench_profile": profile_name,
                  TAG + "bench_base_dtype": profile.base_dtype, **({TAG + "bench_server": server} if server else {})})
    try:
        with _measurers(backend, checkpoint, base, profile, endpoints, run, server) as measurers:
            result = bench_pair(measurers, ids, profile)
    except PartialBench as exc:
        run.log_dict({**report, "partial": True, "error": str(exc), "samples": _spread(exc.samples)}, "bench.json")
        run.set_tags({TAG + "bench_partial": "true"})
        raise
    metrics = {**result.metrics, "model/size_mb": models.weights_size_mb(checkpoint)}
    run.log_metrics(metrics)
    run.log_dict({**report, "partial": False, "metrics": metrics, "samples": _spread(result.samples)}, "bench.json")
    print(table(metrics))
    return metrics


def _spread(samples: dict[str, dict[str, list[float]]]) -> dict:
    return {
        model: {key: {"median": sorted(v)[len(v) // 2], "min": min(v), "max": max(v), "values": v} for key, v in rows.items()}
        for model, rows in samples.items()
    }


@contextmanager
def _measurers(backend: str, checkpoint: Path, base: models.ResolvedModel, profile: Profile, endpoints, run,
               server: str = "transformers"):
    """{"candidate": measure(prompt_sets, rep), "base": ...} for the backend; servers stopped on exit."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if backend == "hf":
        base_dtype = "auto" if profile.base_dtype == "auto" else getattr(torch, profile.base_dtype)
        yield {
            "candidate": hf_measurer(lambda: AutoModelForCausalLM.from_pretrained(checkpoint), profile),
            "base": hf_measurer(lambda: AutoModelForCausalLM.from_pretrained(base.path, dtype=base_dtype), profile),
        }
        return
    from quantbench.evaluate.serving import model_server, openai_measurer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if backend == "openai":
        yield {
            "candidate": openai_measurer(endpoints[0], str(checkpoint), tokenizer, profile),
            "base": openai_measurer(endpoints[1], str(base.path), tokenizer, profile),
        }
        return
    logs = Path(tempfile.mkdtemp(prefix="qb-serve-"))
    try:
        length = max(profile.prompt_tokens) + profile.output_tokens + 64
        with model_server(checkpoint, logs / "candidate.log", server, length) as cand, \
                model_server(base.path, logs / "base.log", server, length) as ref:
            yield {
                "candidate": openai_measurer(cand[0], cand[1], tokenizer, profile, server_pid=cand[2]),
                "base": openai_measurer(ref[0], ref[1], tokenizer, profile, server_pid=ref[2]),
            }
    finally:
        for log_file in logs.glob("*.log"):
            run.log_artifact(log_file, "servers")


def table(metrics: dict[str, float]) -> str:
    rows = [f"{'metric':28s} {'base':>10s} {'candidate':>10s} {'speedup':>8s}"]
    for key in sorted(k for k in metrics if k.startswith("speed/") and "base_" + k in metrics):
        short = key.removeprefix("speed/")
        rows.append(f"{short:28s} {metrics['base_' + key]:10.4g} {metrics[key]:10.4g} {metrics['speedup/' + short]:8.3f}")
    return "\n".join(rows)
