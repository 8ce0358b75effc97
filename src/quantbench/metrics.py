"""The metric catalogue: every name the stages log, which direction is better for each, and close
matches for a misspelled name. compare, gate and the tables read it; docs/metrics.md documents
every name here (a test keeps the two in step).

Orientation of the ratios: `recovery/<m>` and `speedup/<m>` are both "above 1 is better" (for a
lower-is-better metric they are baseline / candidate), so a policy thresholds them with a minimum.
"""

from __future__ import annotations

import difflib
import re
from typing import Literal

Direction = Literal["higher", "lower"]

# Exact names and their direction (None: a count or a context value, not a score).
FIXED: dict[str, Direction | None] = {
    "quantize/wall_s": "lower",
    "quantize/peak_rss_mb": "lower",
    "model/size_mb": "lower",
    "model/base_size_mb": None,
    "model/compression_ratio": "higher",
    "check/base_ppl": None,
    "check/reload_ppl": "lower",
    "check/ppl_ratio": "lower",
    "check/trained_ppl": None,
    "distill/loss": "lower",
    "distill/kd_loss": "lower",
    "distill/lm_loss": "lower",
    "distill/final_loss": "lower",
    "distill/learning_rate": None,
    "distill/grad_norm": None,
    "distill/step_tokens_per_s": "higher",
    "distill/tokens_per_s": "higher",
    "distill/wall_s": "lower",
    "distill/steps": None,
    "distill/tokens": None,
    "distill/student_params": "lower",
    "distill/kld_before": None,
    "distill/kld_after": "lower",
    "distill/ppl_before": None,
    "distill/ppl_after": "lower",
    "distill/teacher_params": None,
    "quality/ppl": "lower",
    "quality/kld_mean": "lower",
    "quality/kld_p90": "lower",
    "quality/kld_p99": "lower",
    "quality/kld_max": "lower",
    "quality/top1_agreement": "higher",
    "quality/flips_pct": "lower",
    "quality/flips_right_to_wrong_pct": "lower",
    "quality/flips_wrong_to_right_pct": None,
    "quality/flips_items": None,
    "quality/positions": None,
    "compare/candidates": None,  # a compare summary run
    "compare/frontier": None,
    "sweep/finished": None,  # a sweep's parent run
    "sweep/skipped": None,
    "sweep/failed": None,
}
# speed/<name> (also base_speed/<name>); c<N>/... per concurrency level.
SPEED: dict[str, Direction] = {
    "ttft_ms_p50": "lower",
    "ttft_ms_p95": "lower",
    "e2e_ms_p50": "lower",
    "e2e_ms_p95": "lower",
    "itl_ms_p50": "lower",
    "decode_tok_s": "higher",
    "prefill_tok_s": "higher",
    "peak_mem_mb": "lower",
    "spec_acceptance": "higher",  # speculative decoding with a draft model (bench --draft)
    "spec_decode_tok_s": "higher",
    "spec_tokens_per_target_step": "higher",
}
CONCURRENT: dict[str, Direction] = {"throughput_tok_s": "higher", "requests_s": "higher"}
# task/<task>/<metric>: lm-eval's metric names; these are lower-is-better, the rest higher.
TASK_LOWER = ("perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte")
# Metrics that have a recovery/<m> against the baseline.
RECOVERABLE = re.compile(r"quality/ppl|task/.+")


# The metric families whose names are built from another name (docs/metrics.md spells them so).
PATTERNS = ("base_speed/<metric>", "speedup/<metric>", "recovery/<metric>", "task/<task>/<metric>")

# Every tag quantbench sets (prefix quantbench.), with its meaning. `<...>` stands for a part
# that varies: environment keys, policies.
TAGS: dict[str, str] = {
    "quantbench.role": "candidate | baseline | summary | sweep: what the run is",
    "quantbench.recipe": "the recipe's name (its file name without .yaml)",
    "quantbench.recipe_sha": "sha256 of the resolved recipe (defaults filled in, overrides applied)",
    "quantbench.method": "quantize.method of the recipe (gptq, awq, fp8, smoothquant, bnb, distill)",
    "quantbench.scheme": "quantize.scheme (W4A16, FP8_DYNAMIC, NF4, ...)",
    "quantbench.engine": "the engine that wrote the checkpoint (llm-compressor, bitsandbytes, GPTQModel, ...)",
    "quantbench.format": "the checkpoint format (compressed-tensors, bitsandbytes, gptq, awq, safetensors-bf16)",
    "quantbench.loaders": "which runtimes load the format, with the writer's version",
    "quantbench.kv_cache": "fp8 when the checkpoint carries FP8 KV-cache scales, else none",
    "quantbench.base_model": "the base model's source as the recipe named it",
    "quantbench.base_fingerprint": "sha256 over the base model's config and weights",
    "quantbench.license": "the base model's licence",
    "quantbench.parent_run": "the run whose checkpoint was this run's base model (run: / recipe: sources)",
    "quantbench.checkpoint": "absolute path of the checkpoint directory (set when the job finished)",
    "quantbench.checkpoint_sha": "sha256 over every file of the checkpoint (its sha256sum lines, sorted by path), set when "
                                 "it is logged as the run's checkpoint/ artifact; a download is verified against it",
    "quantbench.staging": "the staging directory a running job writes (removed if it does not finish)",
    "quantbench.owner": "host, pid and start time of the process holding the run open (to reap dead ones)",
    "quantbench.error": "why a run FAILED or was KILLED",
    "quantbench.baseline_run": "the baseline run a candidate was scored against",
    "quantbench.suite": "the evaluation suite's name",
    "quantbench.suite_sha": "fingerprint of the suite (settings, text, task data, lm-eval version)",
    "quantbench.bench_backend": "hf | openai | serve: how speed was measured",
    "quantbench.bench_server": "vllm | transformers: the server the serve backend started",
    "quantbench.bench_profile": "the speed profile's name",
    "quantbench.bench_base_dtype": "the dtype the base model was measured in",
    "quantbench.bench_partial": "true when the last bench stopped part-way (its server died)",
    "quantbench.spec_target": "bench --draft: the target model's source",
    "quantbench.spec_draft": "bench --draft: the draft checkpoint",
    "quantbench.resumed_from_step": "distillation: the training step an interrupted job resumed from",
    "quantbench.sweep": "the sweep that ran the job (on its runs and on the sweep's parent run)",
    "quantbench.sweep_job": "the job's id within its sweep",
    "quantbench.attempt": "a unique id of the sweep attempt that ran the job (finds its run when the attempt's node is lost)",
    "quantbench.ray_node": "sweep --ray: the id of the Ray node the job ran on",
    "quantbench.sweep_runs": "on a sweep's parent run: the runs of its jobs",
    "quantbench.compared_runs": "on a compare summary run: the runs it compared",
    "quantbench.quality_metric": "on a compare summary run: the quality axis",
    "quantbench.speed_metric": "on a compare summary run: the speed axis",
    "quantbench.gate.<policy>": "pass | fail: the last verdict of that policy (on the run and on the registered version)",
    "quantbench.gate.<policy>.at": "when that verdict was given (on the run)",
    "quantbench.gate.policy_sha": "on a registered version: sha256 of the policy that promoted it",
    "quantbench.gate.at": "on a registered version: when it was promoted",
    "quantbench.run": "on a registered version: the run it came from",
    "quantbench.<environment>": "what a number was measured on: python, platform, cpu, cpu_count, memory_gb, gpu, "
                                "git_sha, git_dirty, version.<library>",
}

# Artifacts of a run (paths inside the run's artifact store).
ARTIFACTS: dict[str, str] = {
    "resolved_recipe.json": "the recipe as run, with versions, hardware, git sha and the sha of every text read",
    "README.md": "the model card",
    "<run id>.log": "the run's log file (quantbench's lines and the engine's)",
    "error.txt": "the traceback of a FAILED run",
    "evaluation.json": "the evaluate stage: settings, metrics, the baseline's, per-item results, per-position KLD",
    "baseline/reference.safetensors": "on a baseline run: the base model's final hidden states and output head",
    "baseline/task_samples.json": "on a baseline run: the base model's per-item task results",
    "bench.json": "the bench stage: settings, hardware, every sample (median, min, max), partial or not",
    "bench_spec.json": "bench --draft: speculative decoding samples",
    "servers/<name>.log": "the logs of the servers the serve backend started",
    "gate/<policy>-<time>.json": "a gate report: every check, value, threshold, result",
    "gate/<policy>-<time>.md": "the same report as a table",
    "checkpoint/": "the checkpoint: logged at the end of the job when the tracking store is a server with an artifact "
                   "store, else by a passing gate (the registered version's source)",
    "compare/compare.{md,html,png,json}": "on a compare summary run: the table and the plot",
    "sweep.json": "on a sweep's parent run: every job, attempt and result",
    "sweep.txt": "on a sweep's parent run: the summary table",
}


def documented_metrics() -> set[str]:
    """Every metric name, as docs/metrics.md spells it (`speed/c<N>/...` and the PATTERNS)."""
    return set(FIXED) | {f"speed/{k}" for k in SPEED} | {f"speed/c<N>/{k}" for k in CONCURRENT} | set(PATTERNS)


def direction(name: str) -> Direction | None:
    """Which way is better for a metric name; None for context values and unknown names."""
    if name in FIXED:
        return FIXED[name]
    if name.startswith(("recovery/", "speedup/")):
        return "higher"
    if name.startswith("task/"):
        return "lower" if name.rsplit("/", 1)[-1] in TASK_LOWER else "higher"
    for prefix in ("speed/", "base_speed/"):
        if name.startswith(prefix):
            rest = name.removeprefix(prefix)
            concurrent = re.fullmatch(r"c\d+/(.+)", rest)
            return CONCURRENT.get(concurrent.group(1)) if concurrent else SPEED.get(rest)
    return None


def is_better(name: str, a: float, b: float) -> bool:
    """a strictly better than b for metric `name`."""
    return a < b if direction(name) == "lower" else a > b


def known_tasks() -> set[str]:
    """The offline tasks plus every task named in the suites directory's files."""
    import yaml

    from quantbench.evaluate.suite import suites_dir
    from quantbench.evaluate.tasks import OFFLINE_TASKS

    tasks = set(OFFLINE_TASKS)
    for path in suites_dir().glob("*.yaml"):
        try:
            tasks.update((yaml.safe_load(path.read_text()) or {}).get("tasks") or [])
        except (yaml.YAMLError, AttributeError, TypeError):
            continue  # a broken suite is reported where it is used
    return tasks


def catalogue() -> list[str]:
    """Every concrete metric name (concurrency shown as c1, c4, ...), for suggestions."""
    names = list(FIXED)
    speed = [f"speed/{k}" for k in SPEED] + [f"speed/c{n}/{k}" for n in (1, 4) for k in CONCURRENT]
    tasks = [f"task/{t}/{m}" for t in sorted(known_tasks()) for m in ("acc", "acc_norm", "perplexity")]
    names += speed + tasks
    names += [f"speedup/{s.removeprefix('speed/')}" for s in speed]
    names += ["recovery/quality/ppl"] + [f"recovery/{t}" for t in tasks]
    return names


def check_name(name: str) -> str | None:
    """None if `name` is a metric the stages log; else the problem, with close matches."""
    base = name.removeprefix("recovery/")
    if name.startswith("recovery/") and not RECOVERABLE.fullmatch(base):
        return f"unknown metric '{name}' (recovery/ exists for quality/ppl and task/*)." + _close(name)
    if base.startswith("task/"):
        parts = base.split("/")
        if len(parts) == 3 and parts[1] in known_tasks() and parts[2]:
            return None
        return f"unknown metric '{name}'." + _close(name)
    probe = "speed/" + name.removeprefix("speedup/") if name.startswith("speedup/") else base
    if direction(probe) is None and probe not in FIXED:
        return f"unknown metric '{name}'." + _close(name)
    return None


def _close(name: str) -> str:
    close = difflib.get_close_matches(name, catalogue(), n=3, cutoff=0.6)
    return f" Close matches: {', '.join(close)}." if close else " See docs/metrics.md for every metric name."
