"""Speed against the base model: the profile, the A B A B loop, the in-process (`hf`)
measurements and the summary. TTFT, decode and prefill tokens/s, inter-token and end-to-end
latency, each load level's throughput and latency percentiles, peak memory. The server engines'
measurements are in speed/serving.py.

The candidate and the base model are measured with the same profile, interleaved (A B A B, one
model loaded at a time) so machine drift hits both alike. Each repetition after the warm-up
yields one sample per prompt length and per concurrency level; medians are the metrics, min and
max go to the JSON artifact.

Metric names (docs/metrics.md): `speed/ttft_ms_p50`, `speed/ttft_ms_p95`, `speed/decode_tok_s`,
`speed/itl_ms_p50`, `speed/prefill_tok_s`, `speed/e2e_ms_p50`, `speed/e2e_ms_p95`,
`speed/peak_mem_mb`, and per load level (`c<N>`: N in flight, `r<R>`: R requests/s)
`speed/c<N>/throughput_tok_s`, `.../requests_s`, and through a server `.../ttft_ms_p50|p95|p99`,
`.../itl_ms_p50|p95|p99`, `.../e2e_ms_p50|p95` (over the level's requests in a repetition; the
median over repetitions is the metric).
`speedup/<metric>` is oriented so that above 1 is faster: candidate / base for rates,
base / candidate for times and memory. With 3 or more repetitions each speedup also has a 95 %
interval, `speedup/<metric>.ci_low` / `.ci_high`, from the paired repetitions
(`speedup_intervals`, docs/intervals.md).
"""

from __future__ import annotations

import difflib
import gc
import os
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, ValidationInfo, field_validator, model_validator
from tqdm import tqdm

from quantbench.core.errors import UserError
from quantbench.core.intervals import HIGH, LOW, pct, ratio_interval
from quantbench.core.logs import terminal
from quantbench.core.processes import PeakRSS
from quantbench.recipe import load_named
from quantbench.recipe.common import Strict

DEFAULT_PROFILE = "cpu-smoke"
LEVEL = re.compile(r"c\d+|r[0-9.]+")  # a load level's sample prefix: c4, r0.5
LOWER_IS_FASTER = ("_ms_p50", "_ms_p95", "_ms_p99", "peak_mem_mb")
NO_RATIO = (
    "/saturated",
    "/slo_held",
    "/ttft_ratio",
    "/computed_share",
    "/prompt_cached_share",
)  # flags and ratios: no speedup
# An SLO: a request latency at a percentile of a level's requests, e.g. ttft_ms_p95 (ITL: of the
# level's inter-token gaps, and for one request of its own gaps)
SLO_NAME = re.compile(r"(ttft|itl|e2e)_ms_p(\d{1,2}(?:\.\d+)?)")
SWEEP_MEASURES = ("max_rate_rps", "slo_rate_rps")  # a sweep's per-repetition samples besides its levels


class Sweep(Strict):
    """A rate sweep to saturation (through a server): a synchronous run (level c1: one request at
    a time), a throughput run (level c<requests>: every request at once), then `rates` open-loop
    rates evenly from the slower synchronous rate the warm-up measured to a quarter above the
    faster throughput rate (`sweep_rates`; the same rates for candidate and base), each level
    `requests` requests."""

    rates: int = Field(ge=2, le=20)
    requests: int = Field(16, ge=4)
    arrivals: Literal["poisson", "constant"] = "poisson"
    # the share of a level's first and of its last requests left out of its latencies and SLO share
    # (warm-up and cool-down); its throughput is over every request
    trim: float = Field(0.1, ge=0, lt=0.5)
    # with `slo:`: this many more levels per repetition and model, bisecting between the highest
    # level that held the SLOs and the next that did not (each halves the bracket; slo_rate_rps is
    # then the highest rate that held, not only a swept one)
    refine: int = Field(0, ge=0, le=6)


class PrefixWorkload(Strict):
    """`prompts` prompts sharing their first `tokens` tokens, each then `suffix_tokens` of its own
    (a system prompt or a document asked several questions), sent one at a time with the server's
    prefix cache off, then on (after one request that fills it)."""

    tokens: PositiveInt
    prompts: int = Field(8, ge=2)
    suffix_tokens: PositiveInt = 32


class Profile(Strict):
    description: str = ""
    prompt_tokens: list[PositiveInt] = Field(default_factory=lambda: [128])
    output_tokens: PositiveInt = 32
    # load levels: N requests in flight at once. Through a server each level sends
    # `requests_per_level` requests (default 2 x N) and reports throughput and latency
    # percentiles (speed/c<N>/...); in-process (hf) it is one batched generate of N prompts.
    concurrency: list[PositiveInt] = Field(default_factory=lambda: [1, 4])
    # optional open-loop levels, servers only: requests/s with Poisson arrivals (speed/r<R>/...)
    request_rates: list[PositiveFloat] = Field(default_factory=list)
    requests_per_level: PositiveInt | None = None  # default: 2 x N at concurrency N, 8 at a request rate
    repetitions: PositiveInt = 3
    warmup: int = Field(1, ge=0)
    seed: int = 0
    # the dtype the base model is measured in by the hf engine: on CPU float32 is its fastest
    # plain path, on a GPU bfloat16 is what would be served
    base_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # vLLM's --dtype for candidate and base: auto is vLLM's own choice (a float32 checkpoint is
    # served in bfloat16), what a deployment runs; the dtype it ran in is recorded in the run
    serve_dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # vLLM compiles its graphs at start-up (its default, what a deployment runs; 1-2 min per
    # server on CPU here). false: --enforce-eager, ~3x faster start-up but ~35% more CPU per
    # decoded token on CPU, which narrows speedups; the tests' profiles use it
    compile: bool = True
    # a rate sweep to saturation (servers only): speed/r<R>/..., speed/max_rate_rps, speed/slo_rate_rps
    sweep: Sweep | None = None
    # service-level objectives, e.g. {ttft_ms_p95: 500, itl_ms_p95: 50}: per level the share of
    # requests meeting every one (slo_pct), the goodput (goodput_rps) and whether each held at its
    # percentile over the level (slo_held); with a sweep, the highest rate that held (slo_rate_rps)
    slo: dict[str, PositiveFloat] = Field(default_factory=dict)
    # prefix caching (servers whose cache is turned off per request: llama.cpp, vLLM): speed/prefix/...
    prefix: PrefixWorkload | None = None
    # long context (servers only): one streamed request per length, speed/ctx<L>/...
    context_tokens: list[PositiveInt] = Field(default_factory=list)
    # the candidate's server's KV-cache type, in the engine's own names (llama.cpp: q8_0, q4_0, ...; vLLM: fp8);
    # the base's server keeps the engine's 16-bit cache. The sizes the servers allocated are logged
    # (speed/kv_cache_mb): bench a checkpoint against itself to see the KV cache alone
    kv_cache: str | None = None

    @field_validator("slo")
    @classmethod
    def _known_slos(cls, value: dict[str, float]) -> dict[str, float]:
        for name in value:
            found = SLO_NAME.fullmatch(name)
            if not found or not 0 < float(found.group(2)) < 100:
                metric = name.split("_", 1)[0]
                close = ["itl"] if metric == "tpot" else difflib.get_close_matches(metric, ["ttft", "itl", "e2e"], n=1)
                hint = f" Did you mean {close[0]}_ms_p95?" if close and close[0] != metric else ""
                if metric == "tpot":
                    hint += " (time per output token is the inter-token latency here)"
                raise ValueError(
                    f"unknown SLO '{name}': an SLO is ttft_ms_p<P>, itl_ms_p<P> or e2e_ms_p<P> (P a "
                    f"percentile above 0 and below 100), e.g. ttft_ms_p95: 500.{hint}"
                )
        return value

    @model_validator(mode="after")
    def _refine_needs_slos(self) -> Profile:
        if self.sweep is not None and self.sweep.refine and not self.slo:
            raise ValueError(
                f"sweep.refine: {self.sweep.refine} bisects toward the highest rate that holds the SLOs, and "
                "the profile has none (add slo:, e.g. {ttft_ms_p95: 500})"
            )
        return self

    @field_validator("sweep")
    @classmethod
    def _sweep_has_a_warmup(cls, value: Sweep | None, info: ValidationInfo) -> Sweep | None:
        if value and info.data.get("warmup", 1) < 1:
            raise ValueError(
                "a sweep needs warmup of at least 1: its rates are set from the warm-up's synchronous "
                "and throughput runs"
            )
        return value

    def level_requests(self, concurrency: int | None) -> int:
        """Requests a load level sends per repetition."""
        if self.requests_per_level:
            return self.requests_per_level
        return 2 * concurrency if concurrency else 8

    @property
    def prompts_per_repetition(self) -> int:
        """Prompts of the longest length one repetition sends through a server: its streamed request
        and every load level's (a sweep's refining levels included), each a prompt of its own, so
        that no request meets a prompt a server has seen (and could answer from its prefix cache)."""
        swept = {1, self.sweep.requests} if self.sweep else set()
        count = 1 + sum(self.level_requests(n) for n in self.concurrency if n not in swept)
        count += len(self.request_rates) * self.level_requests(None)
        if self.sweep:
            count += (2 + self.sweep.rates + self.sweep.refine) * self.sweep.requests
        return count

    @property
    def slots(self) -> int:
        """Requests a server is started to serve at once (llama-server --parallel; a plan's KV
        cache): the highest concurrency level, or, for a profile of request rates only, every
        request a level sends (open-loop arrivals do not wait for the ones before them)."""
        return max(self.concurrency, default=0) or self.max_requests

    @property
    def max_requests(self) -> int:
        return max(
            [max(self.concurrency, default=0), self.sweep.requests if self.sweep else 0]
            + [self.level_requests(n) for n in self.concurrency]
            + [self.level_requests(None) for _ in self.request_rates]
        )


def prefix_prompts(token_ids: list[int], workload: PrefixWorkload, tokenizer, seed: int) -> list[str]:
    """The prefix workload's texts: one shared prefix and, after it, each prompt's own suffix (from
    other places in the evaluation text); one more than `prompts`, the first to fill the cache."""
    [shared] = prompts(token_ids, workload.tokens, 1, seed)
    own = prompts(token_ids, workload.suffix_tokens, workload.prompts + 1, seed + 1)
    return [tokenizer.decode(shared + suffix) for suffix in own]


@dataclass
class SweepRates:
    """The rates of a profile's sweep, shared by the candidate's and the base's measurer: empty
    during the warm-up, set by bench_pair from the warm-up's synchronous and throughput runs."""

    rates: list[float] = field(default_factory=list)


SWEEP_BEYOND = 1.25  # the top of a sweep's range: this many times the faster throughput run's rate


def sweep_rates(slowest: float, fastest: float, count: int) -> list[float]:
    """`count` rates evenly from the synchronous rate (excluded) to a quarter above the throughput
    rate (included): a warm-up under-measures a server still warming its caches, and the top rate
    should find where the faster model saturates. Each to 3 significant figures (a level's name
    is r<rate>)."""
    low, high = min(slowest, fastest), max(slowest, fastest) * SWEEP_BEYOND
    return [float(f"{low + (high - low) * i / count:.3g}") for i in range(1, count + 1)]


def profiles_dir() -> Path:
    return Path(os.environ.get("QUANTBENCH_PROFILES", "profiles"))


def load_profile(name: str, field: str = "--profile") -> Profile:
    return load_named(profiles_dir(), name, Profile, field, "profile")


def prompts(token_ids: list[int], length: int, count: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` tokens from the evaluation text, at offsets fixed by `seed`."""
    if len(token_ids) < length:
        raise UserError(f"profile: prompt_tokens {length} is longer than the evaluation text ({len(token_ids)} tokens)")
    rng = random.Random(f"{seed}-{length}")
    return [
        token_ids[start : start + length]
        for start in (rng.randrange(len(token_ids) - length + 1) for _ in range(count))
    ]


# ---------------------------------------------------------------------------------------------
# One model's measurements


class _Clock:
    """A generate() streamer that only notes when each step's tokens arrive."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:  # first call: the prompt; then one call per new token
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _generate(model, batch, output_tokens: int, streamer=None):
    import torch

    with torch.inference_mode():
        return model.generate(
            input_ids=batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=output_tokens,
            min_new_tokens=output_tokens,  # the same length every time: EOS does not end a run early
            do_sample=False,
            streamer=streamer,
            pad_token_id=0,
        )


def measure(model, prompt_sets: dict[int, list[list[int]]], profile: Profile, rep: int) -> dict[str, float]:
    """One repetition on one loaded model: a streamed request per prompt length, and a batched
    generate per concurrency level above 1."""
    import torch

    device = next(model.parameters()).device
    out: dict[str, float] = {}
    for length in profile.prompt_tokens:
        rows = prompt_sets[length]
        clock = _Clock()
        batch = torch.tensor([rows[rep % len(rows)]], device=device)
        start = time.perf_counter()
        _generate(model, batch, profile.output_tokens, clock)
        end = time.perf_counter()
        token_times = clock.times[1:]  # after the prompt
        ttft = token_times[0] - start
        gaps = [b - a for a, b in zip(token_times, token_times[1:])]
        out[f"p{length}/ttft_ms"] = ttft * 1000
        out[f"p{length}/e2e_ms"] = (end - start) * 1000
        out[f"p{length}/prefill_tok_s"] = length / ttft
        if gaps:
            out[f"p{length}/decode_tok_s"] = len(gaps) / sum(gaps)
            out[f"p{length}/itl_ms"] = statistics.median(gaps) * 1000
    length = max(profile.prompt_tokens)
    for n in profile.concurrency:
        rows = prompt_sets[length]
        batch = torch.tensor([rows[(rep + i) % len(rows)] for i in range(n)], device=device)
        start = time.perf_counter()
        _generate(model, batch, profile.output_tokens)
        wall = time.perf_counter() - start
        out[f"c{n}/throughput_tok_s"] = n * profile.output_tokens / wall
        out[f"c{n}/requests_s"] = n / wall
    return out


@dataclass
class SpeedResult:
    metrics: dict[str, float]  # speed/..., speedup/...
    samples: dict[str, dict[str, list[float]]]  # model -> sample name -> values per repetition


class RepetitionFailed(RuntimeError):
    """A measurer stopped part-way through a repetition: `measured` holds what it took before
    (the load levels of a sweep finished before the server fell over)."""

    def __init__(self, cause: BaseException, measured: dict[str, float]):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.measured = measured


class PartialBench(RuntimeError):
    """An engine failed part-way (e.g. the server died): what was measured before is kept, the
    finished repetitions in `samples` and the unfinished one's samples in `unfinished`
    ({"model", "repetition", "measured"}), marked as such."""

    def __init__(
        self, cause: BaseException, samples: dict[str, dict[str, list[float]]], unfinished: dict | None = None
    ):
        super().__init__(f"bench stopped part-way: {cause if isinstance(cause, RepetitionFailed) else _named(cause)}")
        self.samples = samples
        self.unfinished = unfinished


def _named(cause: BaseException) -> str:
    return f"{type(cause).__name__}: {cause}"


def hf_measurer(load, profile: Profile):
    """Engine hf: load the model, measure one repetition, free it; peak RSS growth meanwhile."""

    def run(prompt_sets: dict[int, list[list[int]]], rep: int) -> dict[str, float]:
        with PeakRSS() as mem:
            before = mem.peak
            model = load()
            values = measure(model, prompt_sets, profile, rep)
            del model
            gc.collect()
        values["peak_mem_mb"] = (mem.peak - before) / 2**20
        return values

    return run


def bench_pair(
    measurers: dict,
    token_ids: list[int],
    profile: Profile,
    sweep: SweepRates | None = None,
    one_at_a_time: bool = False,
) -> SpeedResult:
    """Measure "candidate" and "base" with `profile`, interleaved A B A B; the warm-up dropped.
    With a sweep, its rates are set after the warm-up from its synchronous and throughput runs.
    `one_at_a_time`: every repetition of the candidate, then every one of the base (A A A B B B):
    for models whose servers do not fit in memory together; repetition i of each is still paired,
    but drift between the two halves is no longer shared (said in bench.json)."""
    # servers: every repetition its own prompts (`prompts_per_repetition`); in-process, a batch of the
    # largest level starting at the repetition's index
    reps = profile.repetitions + profile.warmup
    count = max(profile.max_requests + reps, profile.prompts_per_repetition * reps)
    lengths = [*profile.prompt_tokens, *profile.context_tokens]
    prompt_sets = {length: prompts(token_ids, length, count, profile.seed) for length in lengths}
    samples: dict[str, dict[str, list[float]]] = {"candidate": {}, "base": {}}
    total = (profile.warmup + profile.repetitions) * 2
    warm: dict[str, dict[str, float]] = {}
    if one_at_a_time:
        order = [(rep, name) for name in ("candidate", "base") for rep in range(reps)]
    else:
        order = [(rep, name) for rep in range(reps) for name in ("candidate", "base")]  # A B A B
    with tqdm(total=total, desc="bench", unit="run", file=terminal()) as bar:
        for rep, name in order:
            if sweep is not None and profile.sweep and rep == profile.warmup and name == "candidate":
                sweep.rates = sweep_rates(
                    min(w["c1/requests_s"] for w in warm.values()),
                    max(w[f"c{profile.sweep.requests}/requests_s"] for w in warm.values()),
                    profile.sweep.rates,
                )
            try:
                values = measurers[name](prompt_sets, rep)
            except RepetitionFailed as exc:
                unfinished = {
                    "model": name,
                    "repetition": rep,
                    "warmup": rep < profile.warmup,
                    "measured": exc.measured,
                }
                raise PartialBench(exc, samples, unfinished) from exc
            except Exception as exc:
                raise PartialBench(exc, samples) from exc
            if rep >= profile.warmup:
                for key, value in values.items():
                    samples[name].setdefault(key, []).append(value)
            else:
                warm[name] = values
            bar.update(1)
    metrics = {}
    for name, prefix in (("candidate", "speed/"), ("base", "base_speed/")):
        metrics.update({prefix + k: v for k, v in summarize(samples[name], profile).items()})
    for key, value in list(metrics.items()):
        if key.startswith("speed/") and "base_" + key in metrics and not key.endswith(NO_RATIO):
            base = metrics["base_" + key]
            if value <= 0 or base <= 0:  # e.g. a tiny model whose load did not grow the process: no ratio
                continue
            lower = key.endswith(LOWER_IS_FASTER)
            metrics["speedup/" + key.removeprefix("speed/")] = (base / value) if lower else (value / base)
    metrics.update(speedup_intervals(samples, profile))
    return SpeedResult(metrics, samples)


def speedup_intervals(samples: dict[str, dict[str, list[float]]], profile: Profile) -> dict[str, float]:
    """`speedup/<m>.ci_low` / `.ci_high` from the paired repetitions: repetition i of the candidate
    and of the base ran back to back, so each pair gives one ratio (each model's repetition
    summarised as the metrics are); the interval is Student's t on the log ratios
    (intervals.ratio_interval). {} with fewer than 3 pairs: no interval is made up. None for the
    95th percentiles: one repetition holds one or two timings, no tail to pair."""
    cand, base = samples.get("candidate", {}), samples.get("base", {})
    pairs = min((len(v) for v in [*cand.values(), *base.values()]), default=0)
    ratios: dict[str, list[float]] = {}
    for i in range(pairs):
        try:
            c = summarize({k: [v[i]] for k, v in cand.items()}, profile)
            b = summarize({k: [v[i]] for k, v in base.items()}, profile)
        except (KeyError, ValueError, statistics.StatisticsError):
            return {}  # a repetition that did not measure every sample: no paired interval
        for key in c.keys() & b.keys():
            if c[key] > 0 and b[key] > 0 and not key.endswith(("_p95", *NO_RATIO)):
                ratios.setdefault(key, []).append(b[key] / c[key] if key.endswith(LOWER_IS_FASTER) else c[key] / b[key])
    out = {}
    for key, values in sorted(ratios.items()):
        interval = ratio_interval(values) if len(values) == pairs else None
        if interval:
            out[f"speedup/{key}{LOW}"], out[f"speedup/{key}{HIGH}"] = interval
    return out


def summarize(samples: dict[str, list[float]], profile: Profile) -> dict[str, float]:
    """Per-repetition samples -> the speed/ metric names (medians; p95 over all samples)."""

    def pooled(suffix: str) -> list[float]:
        return [v for k, values in samples.items() if k.endswith(suffix) and k.startswith("p") for v in values]

    ttft, e2e = pooled("/ttft_ms"), pooled("/e2e_ms")
    out = {
        "ttft_ms_p50": statistics.median(ttft),
        "ttft_ms_p95": pct(ttft, 0.95),
        "e2e_ms_p50": statistics.median(e2e),
        "e2e_ms_p95": pct(e2e, 0.95),
        "prefill_tok_s": statistics.median(pooled("/prefill_tok_s")),
    }
    if samples.get("peak_mem_mb"):
        out["peak_mem_mb"] = max(samples["peak_mem_mb"])
    if pooled("/decode_tok_s"):
        out["decode_tok_s"] = statistics.median(pooled("/decode_tok_s"))
        out["itl_ms_p50"] = statistics.median(pooled("/itl_ms"))
    for key, values in samples.items():  # load levels: c<N>/... and r<R>/..., medians over repetitions
        if LEVEL.fullmatch(key.split("/", 1)[0]) or key in SWEEP_MEASURES or key.startswith(("prefix/", "ctx")):
            out[key] = statistics.median(values)
    return out
