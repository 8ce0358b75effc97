"""The bench stage: a checkpoint's speed against its base model, measured in the same run with
the same profile, interleaved, through one engine. speed/measure.py says what is measured;
speed/serving.py holds the client, the load levels and the servers.

Which engine (`engine`, one of quantbench.engines' registry or a way of choosing one):
- `auto` (the default): the first engine in `engines.AUTO` (vLLM, transformers serve, in-process
  hf) that serves the checkpoint's format and the base model's on this device and can run here;
  the choice and why go into the output, the run's tags and bench.json.
- an engine's name (`vllm`, `transformers`, ...): that engine, or a clear error before any run
  when it cannot serve.
- `hf`: in-process transformers `generate` (not a serving engine: INT4 runs without the kernels
  that make it fast).
- `openai`: two running endpoints (`--endpoint`, `--base-endpoint`).
- `serve` (as before): a server, `--server auto` or a server engine's name.
"""

from __future__ import annotations

import logging
import re
import statistics
import tempfile
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from quantbench import engines
from quantbench.core import environment, hardware, intervals
from quantbench.core.busy import Busy, BusyWatch
from quantbench.core.errors import UserError
from quantbench.engines import GPU_SHARE_ALONE, GPU_SHARE_PAIR, ServerSettings, ServingEngine
from quantbench.engines.server import EndpointError, model_server
from quantbench.sources import data, models
from quantbench.sources.checkpoint import load_model, weights_size_mb
from quantbench.speed.measure import (
    PartialBench,
    Profile,
    SweepRates,
    bench_pair,
    hf_measurer,
    load_profile,
    prefix_prompts,
    prompts,
)
from quantbench.speed.serving import check_endpoint, long_context_quality, openai_measurer
from quantbench.tracking import TAG

log = logging.getLogger(__name__)
PLOT = "bench_load.png"
SLO_PLOT = "bench_slo.png"


@dataclass
class Plan:
    """A profile, its prompts' text and the engine, checked before any run starts."""

    profile_name: str
    profile: Profile
    token_ids: list[int]
    engine: ServingEngine
    endpoints: tuple[str, str] | None = None  # engine openai: (checkpoint's, base model's)
    requested: str = "hf"  # what the user asked for: auto, serve or an engine's name
    why: str = ""  # why this engine
    # servers that do not fit in memory together (the job's memory plan): the candidate's measured
    # and stopped, then the base's (bench_pair's one_at_a_time)
    one_at_a_time: bool = False

    @property
    def how(self) -> str:
        """How it is measured (tag bench_backend): hf (in-process), openai (endpoints) or serve."""
        return {"in-process": "hf", "endpoint": "openai", "server": "serve"}[self.engine.kind]

    @property
    def server(self) -> str | None:
        """The server engine quantbench starts, if any."""
        return self.engine.name if self.engine.kind == "server" else None

    def describe(self) -> str:
        return self.engine.describe(self.profile.compile)


@dataclass
class BenchResult:
    """What the pipeline logs into the candidate's run: metrics, tags, bench.json, and files:
    `logs` (the servers' logs, logged under servers/) and `plots` (logged at the top)."""

    metrics: dict[str, float]
    tags: dict[str, str]
    report: dict  # bench.json
    logs: list[Path] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)


class BenchFailed(RuntimeError):
    """The bench stopped part-way (e.g. a server died): `partial` holds what was measured."""

    def __init__(self, cause: BaseException, partial: BenchResult):
        super().__init__(str(cause))
        self.partial = partial


def prepare(
    profile_name: str,
    tokenizer,
    *,
    engine: str = "auto",
    server: str = "auto",
    endpoints: tuple[str, str] | None = None,
    checkpoint: Path | dict | None = None,
    base_path: Path | None = None,
    field: str = "--profile",
    engine_field: str = "--engine",
) -> Plan:
    """Load the profile, check every prompt length against the evaluation text, and pick the
    engine. `checkpoint`: its directory, or (a recipe's checkpoint not written yet) the config it
    will have. Creates vLLM's environment if the engine is vLLM and it does not exist yet."""
    profile = load_profile(profile_name, field)
    ids = tokenizer(data.python_docs("evaluation"))["input_ids"]
    for length in [*profile.prompt_tokens, *profile.context_tokens]:
        prompts(ids, length, 1, profile.seed)
    if engine == "openai":
        if not (endpoints and all(endpoints)):
            raise UserError(
                "--engine openai needs --endpoint URL (the checkpoint) and --base-endpoint URL (its base model)"
            )
        check_endpoint(endpoints[0], "--endpoint")
        check_endpoint(endpoints[1], "--base-endpoint")
        return Plan(profile_name, profile, ids, engines.get("openai"), endpoints, engine, "asked for (--engine openai)")
    chosen = engines.choose(engine, server, checkpoint, base_path, engine_field)
    if chosen.engine.kind == "in-process" and (profile.request_rates or profile.sweep):
        what = "request_rates need" if profile.request_rates else "a sweep needs"
        raise UserError(
            f"{field}: {what} a server (open-loop arrivals); the hf engine measures "
            "batched generate only. Measure through a server (--engine auto picks one where one serves)"
        )
    if chosen.engine.kind == "in-process" and (profile.context_tokens or profile.kv_cache):
        what = "context_tokens need" if profile.context_tokens else "kv_cache needs"
        raise UserError(f"{field}: {what} a server (the server's memory and KV cache); the hf engine has neither")
    if profile.kv_cache and profile.kv_cache not in chosen.engine.kv_cache_types:
        offered = chosen.engine.kv_cache_types
        others = "vLLM takes fp8 where its CPU build has AVX-512; llama.cpp's server q8_0, q4_0, ..."
        raise UserError(
            f"{field}: kv_cache: {chosen.engine.label} does not start with a KV cache of type "
            f"'{profile.kv_cache}' here"
            + (
                f"; it takes {', '.join(offered)}"
                if offered
                else f"; it takes no KV-cache type through quantbench ({others})"
            )
        )
    unfit = chosen.engine.kv_cache_unfit(checkpoint, profile.kv_cache) if profile.kv_cache and checkpoint else None
    if unfit:
        raise UserError(f"{field}: kv_cache: {chosen.engine.label} cannot keep this checkpoint's KV cache so: {unfit}")
    if profile.prefix and chosen.engine.kind == "in-process":
        raise UserError(f"{field}: a prefix workload needs a server with a prefix cache; the hf engine has none")
    if profile.prefix and chosen.engine.prefix_cache is not None:
        raise UserError(
            f"{field}: prefix: {chosen.engine.label} {chosen.engine.prefix_cache}; vLLM and llama.cpp's server "
            "turn their prefix caches off per request (--engine vllm or llamacpp)"
        )
    plan = Plan(profile_name, profile, ids, chosen.engine, None, engine, chosen.why)
    if chosen.engine.kind == "server":
        chosen.engine.ensure(f"{engine_field} {engine}")
        longest = (
            max([*profile.prompt_tokens, *profile.context_tokens, prefix_length(profile)]) + profile.output_tokens + 16
        )
        for path in (checkpoint, base_path):
            limit = chosen.engine.max_model_len(path) if isinstance(path, Path) else None
            if limit is not None and longest > limit:
                raise UserError(
                    f"{field}: prompts of {longest - profile.output_tokens - 16} tokens plus {profile.output_tokens} "
                    f"output tokens exceed {path}'s max_position_embeddings ({limit})"
                )
    return plan


def bench(checkpoint: Path, base: models.ResolvedModel, plan: Plan) -> BenchResult:
    """Measure `checkpoint` against `base`. BenchFailed, with what was measured, if the engine
    fails part-way."""
    plan = _recheck(plan, checkpoint)
    engine = plan.describe()
    log.info(
        "bench: %s vs base %s, profile %s, through %s (%s)", checkpoint, base.name, plan.profile_name, engine, plan.why
    )
    report, tags = _report_head(plan, engine), _tags_head(plan, engine)
    logs: list[Path] = []
    served: dict[str, tuple[str, str]] = {}
    sweep = SweepRates() if plan.profile.sweep else None
    watch = BusyWatch()
    try:
        with watch, _measurers(plan, checkpoint, base, logs, sweep, served) as measurers:
            result = bench_pair(measurers, plan.token_ids, plan.profile, sweep, plan.one_at_a_time)
            scored = _long_context_quality(plan, served)
    except PartialBench as exc:
        tags |= _served_dtypes(plan, logs)
        partial = BenchResult(
            {},
            {**tags, TAG + "bench_partial": "true"},
            {
                **report,
                "partial": True,
                "error": str(exc),
                "samples": spread(exc.samples),
                "unfinished": exc.unfinished,
            },
            logs,
        )
        raise BenchFailed(exc, partial) from exc
    tags |= _served_dtypes(plan, logs)
    if plan.profile.kv_cache:
        tags[TAG + "bench_kv_cache"] = plan.profile.kv_cache
    busy = judge_busy(watch, result.metrics)
    tags |= busy_tags(busy)
    metrics = {
        **result.metrics,
        **_kv_cache_sizes(plan, logs),
        **scored,
        **busy.metrics(),
        "model/size_mb": weights_size_mb(checkpoint),
    }
    plots = []
    if logs:  # a server engine: its load levels have latencies to plot
        title = f"{checkpoint.name} vs {base.name} · {engine}"
        plots = [p for p in (load_plot(metrics, logs[0].parent / PLOT, title),) if p]
        if sweep and plan.profile.slo:
            plots.append(slo_plot(metrics, plan.profile.slo, logs[0].parent / SLO_PLOT, title))
    if sweep:
        report["sweep_rates"] = sweep.rates
    report = {
        **report,
        "partial": False,
        "metrics": metrics,
        "samples": spread(result.samples),
        "dtypes": {"candidate": tags.get(TAG + "bench_dtype"), "base": tags[TAG + "bench_base_dtype"]},
        "busy": {"busy": busy.busy, "why": busy.why, **busy.metrics("")},
    }
    return BenchResult(metrics, tags, report, logs, plots)


def _report_head(plan: Plan, engine: str) -> dict:
    """bench.json's first keys: how, through what and with which profile the bench measures."""
    return {
        "backend": plan.how,
        "server": plan.server,
        "engine": plan.engine.tag_name,
        "engine_description": engine,
        "why": plan.why,
        "requested": plan.requested,
        "profile": plan.profile_name,
        "profile_settings": plan.profile.model_dump(mode="json"),
        "hardware": environment.describe(),
        "order": "one model, then the other (their servers do not fit in memory together)"
        if plan.one_at_a_time
        else "interleaved",
    }


def _tags_head(plan: Plan, engine: str) -> dict[str, str]:
    """The run's bench tags known before anything is measured."""
    return {
        TAG + "bench_backend": plan.how,
        TAG + "bench_profile": plan.profile_name,
        TAG + "bench_server": plan.engine.tag_name,
        TAG + "bench_engine": engine,
        TAG + "bench_base_dtype": plan.profile.base_dtype if plan.how == "hf" else plan.profile.serve_dtype,
        TAG + "bench_device": hardware.device_class(),  # speed holds for this class of machine (the verdict says it)
    }


# The speedup whose interval judges the repetitions' spread (the one a release policy holds).
SPREAD_METRIC = "speedup/decode_tok_s"


def judge_busy(watch: BusyWatch, metrics: dict[str, float]) -> Busy:
    """Whether the machine was too busy for the figures: what else ran during the bench, and how
    far its repetitions disagreed. Said once on the terminal when it was."""
    assert watch.result is not None
    interval = intervals.interval_of(metrics, SPREAD_METRIC)
    busy = watch.result.judge(interval)
    if busy.busy:
        log.warning(
            "bench: the machine was too busy to measure speed here (%s); these speed figures are logged but "
            "a gate calls them unmeasurable: re-run `make bench RUN=<run id>` on a quiet machine",
            busy.why,
        )
    return busy


def busy_tags(busy: Busy) -> dict[str, str]:
    return {
        TAG + "bench_busy": "true" if busy.busy else "false",
        **({TAG + "bench_busy_why": busy.why} if busy.busy else {}),
    }


def prefix_length(profile: Profile) -> int:
    """The longest prompt of the profile's prefix workload (0 without one)."""
    return profile.prefix.tokens + profile.prefix.suffix_tokens + 8 if profile.prefix else 0


def _recheck(plan: Plan, checkpoint: Path) -> Plan:
    """A recipe's engine was chosen from the format it would write; check the one it wrote, and
    where that engine does not serve it, choose again (or refuse, when the engine was asked for)."""
    problem = plan.engine.unserved(checkpoint)
    if problem is None:
        return plan
    if plan.requested == plan.engine.name:
        raise RuntimeError(f"{plan.engine.label} does not serve {checkpoint} here: {problem}")
    chosen = engines.choose(plan.requested, plan.server or "auto", checkpoint, None)
    chosen.engine.ensure(plan.requested)
    plan.engine = chosen.engine
    plan.why = f"{plan.requested}: the checkpoint written: {chosen.why.split(': ', 1)[-1]}"
    return plan


def _served_dtypes(plan: Plan, logs: list[Path]) -> dict[str, str]:
    """The dtype each model ran in, as the server reports it in its log (where it does)."""
    out = {}
    for path in logs if plan.engine.kind == "server" else []:
        dtype = plan.engine.served_dtype(path)
        if dtype:
            out[TAG + ("bench_dtype" if path.stem == "candidate" else "bench_base_dtype")] = dtype
    return out


def _long_context_quality(plan: Plan, served: dict[str, tuple[str, str]]) -> dict[str, float]:
    """With context_tokens, through a server engine that gives prompt log-probabilities (vLLM):
    the candidate as served (its KV-cache type included) against the base as served, on a prompt of
    the longest length (`quality_engine/ctx<L>/...`). Not measured is said, and the speed kept."""
    profile = plan.profile
    if not (profile.context_tokens and served and plan.engine.quality == "prompt_logprobs"):
        return {}
    if plan.one_at_a_time:
        log.info("bench: no quality at long context: the two servers never ran together (not enough memory)")
        return {}

    [ids] = prompts(plan.token_ids, max(profile.context_tokens), 1, profile.seed)
    log.info("bench: scoring candidate and base as served on a %d-token prompt (prompt log-probabilities)", len(ids))
    try:
        return long_context_quality(served, ids)
    except EndpointError as exc:
        log.warning("bench: no quality at long context through %s: %s", plan.engine.label, exc)
        return {}


def _kv_cache_sizes(plan: Plan, logs: list[Path]) -> dict[str, float]:
    """The KV cache each server allocated (MiB), as its log says, and the candidate's against the
    base's (speedup: base / candidate, as for memory)."""
    sizes = {path.stem: plan.engine.kv_cache_mb(path) for path in logs if plan.engine.kind == "server"}
    out = {f"{'speed' if m == 'candidate' else 'base_speed'}/kv_cache_mb": v for m, v in sizes.items() if v}
    if len(out) == 2:
        out["speedup/kv_cache_mb"] = out["base_speed/kv_cache_mb"] / out["speed/kv_cache_mb"]
    return out


def spread(samples: dict[str, dict[str, list[float]]]) -> dict:
    """Per sample name: the median (the metric's own statistic), min, max and every value."""
    return {
        model: {
            key: {"median": statistics.median(v), "min": min(v), "max": max(v), "values": v} for key, v in rows.items()
        }
        for model, rows in samples.items()
    }


@contextmanager
def _measurers(
    plan: Plan,
    checkpoint: Path,
    base: models.ResolvedModel,
    logs: list[Path],
    sweep: SweepRates | None = None,
    served: dict[str, tuple[str, str]] | None = None,
):
    """{"candidate": measure(prompt_sets, rep), "base": ...} for the engine; servers started one
    after the other (never two starting at once), stopped on exit, their logs appended to `logs`
    and, while they run, their (URL, model name) in `served`. `sweep`: the sweep's rates, shared by
    both measurers (set by bench_pair after the warm-up)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    profile = plan.profile
    if plan.how == "hf":
        base_dtype = "auto" if profile.base_dtype == "auto" else getattr(torch, profile.base_dtype)
        yield {
            "candidate": hf_measurer(lambda: load_model(checkpoint), profile),
            "base": hf_measurer(lambda: AutoModelForCausalLM.from_pretrained(base.path, dtype=base_dtype), profile),
        }
        return

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    texts = prefix_prompts(plan.token_ids, profile.prefix, tokenizer, profile.seed) if profile.prefix else None
    if plan.how == "openai":
        assert plan.endpoints is not None
        yield {
            "candidate": openai_measurer(
                plan.endpoints[0], str(checkpoint), tokenizer, profile, engine=plan.engine, sweep=sweep
            ),
            "base": openai_measurer(
                plan.endpoints[1], str(base.path), tokenizer, profile, engine=plan.engine, sweep=sweep
            ),
        }
        return
    directory = Path(tempfile.mkdtemp(prefix="qb-serve-"))
    engine = plan.engine
    try:
        length = (
            max([*profile.prompt_tokens, *profile.context_tokens, prefix_length(profile)]) + profile.output_tokens + 64
        )
        limits = [x for x in (engine.max_model_len(checkpoint), engine.max_model_len(base.path)) if x]
        settings = ServerSettings(
            min([length, *limits]),
            compiled=profile.compile,
            dtype=profile.serve_dtype,
            slots=profile.slots,
            in_flight=profile.max_requests,
            prefix_tokens=profile.prefix.tokens if profile.prefix else 0,
            gpu_share=GPU_SHARE_ALONE if plan.one_at_a_time else GPU_SHARE_PAIR,
        )
        if plan.one_at_a_time:
            with _OneServerAtATime(
                {
                    "candidate": (checkpoint, replace(settings, kv_cache=profile.kv_cache)),
                    "base": (base.path, settings),
                },
                directory,
                engine,
                lambda url, name, pid: openai_measurer(url, name, tokenizer, profile, pid, engine, sweep, texts),
                served,
            ) as servers:
                yield servers.measurers()
            return
        with (
            model_server(
                checkpoint, directory / "candidate.log", engine, replace(settings, kv_cache=profile.kv_cache)
            ) as cand,
            model_server(base.path, directory / "base.log", engine, settings) as ref,
        ):
            if served is not None:
                served |= {"candidate": (cand[0], cand[1]), "base": (ref[0], ref[1])}
            yield {
                "candidate": openai_measurer(cand[0], cand[1], tokenizer, profile, cand[2], engine, sweep, texts),
                "base": openai_measurer(ref[0], ref[1], tokenizer, profile, ref[2], engine, sweep, texts),
            }
    finally:
        logs.extend(sorted(directory.glob("*.log")))


class _OneServerAtATime:
    """Servers started when their model is first measured, the other one stopped first: one model's
    server in memory at a time (bench_pair measures every repetition of one model, then the other's)."""

    def __init__(self, models: dict, directory: Path, engine, measurer, served: dict | None):
        self.models, self.directory, self.engine = models, directory, engine
        self.make_measurer, self.served = measurer, served
        self.running: str | None = None
        self.stack: ExitStack | None = None
        self.current = None

    def __enter__(self) -> _OneServerAtATime:
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.stack is not None:
            self.stack.close()
        self.stack, self.running, self.current = None, None, None
        if self.served is not None:
            self.served.clear()

    def _switch(self, name: str):
        if self.running != name:
            self._stop()
            path, settings = self.models[name]
            self.stack = ExitStack()
            url, model, pid = self.stack.enter_context(
                model_server(path, self.directory / f"{name}.log", self.engine, settings)
            )
            self.running, self.current = name, self.make_measurer(url, model, pid)
            if self.served is not None:
                self.served[name] = (url, model)
        return self.current

    def measurers(self) -> dict:
        return {name: (lambda sets, rep, name=name: self._switch(name)(sets, rep)) for name in self.models}


# ---------------------------------------------------------------------------------------------
# The load curve


def load_curve(metrics: dict[str, float]) -> dict[str, list[dict]]:
    """Per model, the load levels in order of throughput: {level, throughput_tok_s, ttft_ms_p50, ...}."""
    out: dict[str, list[dict]] = {}
    for model, prefix in (("candidate", "speed/"), ("base", "base_speed/")):
        levels: dict[str, dict] = {}
        for key, value in metrics.items():
            found = re.fullmatch(re.escape(prefix) + r"((?:c\d+|r[0-9.]+))/(\w+)", key)
            if found:
                levels.setdefault(found.group(1), {"level": found.group(1)})[found.group(2)] = value
        out[model] = sorted((v for v in levels.values() if "ttft_ms_p50" in v), key=lambda v: v["throughput_tok_s"])
    return out


def load_plot(metrics: dict[str, float], path: Path, title: str) -> Path | None:
    """Throughput against latency (TTFT and ITL, p50) at each load level, candidate and base on one
    chart: the curve `vllm bench serve` and guidellm users read. None when no level has latencies."""
    curve = load_curve(metrics)
    if not any(curve.values()):
        return None
    fig, axes = _two_panels()
    for ax, key, label in (
        (axes[0], "ttft_ms_p50", "time to first token, p50 (ms)"),
        (axes[1], "itl_ms_p50", "inter-token latency, p50 (ms)"),
    ):
        for model, color in (("candidate", "tab:green"), ("base", "tab:gray")):
            points = [p for p in curve[model] if key in p]
            if not points:
                continue
            xs, ys = [p["throughput_tok_s"] for p in points], [p[key] for p in points]
            ax.plot(xs, ys, marker="o", color=color, label=model)
            for p, x, y in zip(points, xs, ys):
                ax.annotate(p["level"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(label)
    return _save(fig, axes, title, path)


def slo_plot(metrics: dict[str, float], slo: dict[str, float], path: Path, title: str) -> Path:
    """A sweep against its SLOs: TTFT and ITL p95 against the offered load (a rate level's rate, a
    concurrency level's achieved requests/s), candidate and base on one chart, each SLO on a latency
    drawn as a dashed line and each model's SLO rate (the highest rate that held every SLO) as a
    dotted one."""

    def offered(point: dict) -> float:
        return float(point["level"][1:]) if point["level"].startswith("r") else point["requests_s"]

    curve = load_curve(metrics)
    fig, axes = _two_panels()
    for ax, metric in ((axes[0], "ttft"), (axes[1], "itl")):
        key = f"{metric}_ms_p95"
        for model, prefix, color in (("candidate", "speed/", "tab:green"), ("base", "base_speed/", "tab:gray")):
            points = sorted((offered(p), p[key]) for p in curve[model] if key in p)
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", color=color, label=model)
            rate = metrics.get(prefix + "slo_rate_rps")
            if rate:
                ax.axvline(rate, color=color, linestyle=":", label=f"{model} SLO rate {rate:.3g}/s")
        for name, limit in slo.items():
            if name.startswith(metric + "_"):
                ax.axhline(limit, color="tab:red", linestyle="--", label=f"SLO {name} ≤ {limit:g} ms")
        ax.set_xlabel("offered load (requests/s; a concurrency level: what it achieved)")
        ax.set_ylabel(f"{'time to first token' if metric == 'ttft' else 'inter-token latency'}, p95 (ms)")
        ax.set_yscale("log")
    return _save(fig, axes, title, path)


def _two_panels():
    """A figure of two charts side by side (matplotlib without a screen)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, 2, figsize=(11, 4.5), dpi=110)


def _save(fig, axes, title: str, path: Path) -> Path:
    """Grid and legend on each chart, the title over both, written to `path` and closed."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
