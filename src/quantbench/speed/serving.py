"""Speed through a server: the streaming client, load levels, and the servers quantbench starts.

- The client streams `/v1/completions` (greedy). A request's TTFT is the time to the first chunk
  that carries output tokens; its inter-token latencies (ITL) are the gaps between such chunks, as
  vLLM's own `vllm bench serve` counts them; its decode rate is the tokens after the first chunk
  over the time from the first chunk to the last. Against vLLM every chunk with a choice is
  output (as `vllm bench serve` counts) and the server's total from its last usage chunk
  (`stream_options.include_usage`) fixes the token count; elsewhere a chunk with text counts as
  one token. Against vLLM every request asks for
  exactly `output_tokens` tokens (`ignore_eos`), so candidate and base generate the same amount.
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

import random
import statistics
import threading
import time

from quantbench import engines
from quantbench.core.errors import UserError
from quantbench.core.intervals import pct
from quantbench.core.processes import PeakRSS
from quantbench.engines import ServingEngine
from quantbench.engines.server import Stream, http_client, stream_one


def check_endpoint(url: str, field: str) -> None:
    """One quick request: a refused or unreachable endpoint is bad input, reported with its URL."""
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/models", timeout=5.0)
    except httpx.HTTPError as exc:
        raise UserError(f"{field}: cannot reach {url} ({type(exc).__name__}: {exc}); is the server running?") from None


# ---------------------------------------------------------------------------------------------
# One request


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
) -> dict[str, float]:
    """Send `bodies` with at most `concurrency` in flight, or at Poisson arrivals of `rate`/s;
    the level's throughput and latency percentiles (ms)."""
    results: list[Stream | BaseException | None] = [None] * len(bodies)
    own = client is None
    client = client or http_client()

    def send(i: int) -> None:
        try:
            results[i] = stream_one(url, bodies[i], client)
        except BaseException as exc:  # re-raised below, in the measuring thread
            results[i] = exc

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
            t = threading.Thread(target=send, args=(i,))
            t.start()
            threads.append(t)
            due += rng.expovariate(rate)
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if own:
        client.close()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    streams: list[Stream] = results  # type: ignore[assignment]
    ttft = [s.ttft * 1000 for s in streams]
    e2e = [s.e2e * 1000 for s in streams]
    gaps = [g * 1000 for s in streams for g in s.gaps]
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
    drafted = [s.drafted for s in streams if s.drafted]
    if drafted and sum(d for d, _ in drafted):  # speculative decoding: the level's draft tokens accepted
        out["spec_acceptance"] = sum(a for _, a in drafted) / sum(d for d, _ in drafted)
    return out


def level_name(concurrency: int | None = None, rate: float | None = None) -> str:
    """c4 for 4 requests in flight, r0.5 for 0.5 requests/s."""
    return f"c{concurrency}" if rate is None else f"r{rate:g}"


# ---------------------------------------------------------------------------------------------
# The measurer bench_pair calls


def openai_measurer(
    url: str, model: str, tokenizer, profile, server_pid: int | None = None, engine: ServingEngine | None = None
):
    """Backends openai and serve: one repetition = a streamed request per prompt length, then each
    load level (concurrency levels, then request rates) with the longest prompts. `engine`: whose
    request body to send (default: a plain OpenAI one, as to a user's endpoint)."""
    request_body = (engine or engines.get("openai")).request_body

    def run(prompt_sets: dict[int, list[list[int]]], rep: int) -> dict[str, float]:
        out: dict[str, float] = {}
        with PeakRSS(server_pid, tree=True) as mem, http_client() as client:
            for length, rows in prompt_sets.items():
                body = request_body(model, tokenizer.decode(rows[rep % len(rows)]), profile.output_tokens)
                s = stream_one(url, body, client)
                out[f"p{length}/ttft_ms"] = s.ttft * 1000
                out[f"p{length}/e2e_ms"] = s.e2e * 1000
                out[f"p{length}/prefill_tok_s"] = length / s.ttft
                if s.decode_tok_s:
                    out[f"p{length}/decode_tok_s"] = s.decode_tok_s
                    out[f"p{length}/itl_ms"] = statistics.median(s.gaps) * 1000
                if s.drafted and s.drafted[0]:
                    out[f"p{length}/spec_acceptance"] = s.drafted[1] / s.drafted[0]
            rows = prompt_sets[max(prompt_sets)]
            for n, rate in [(n, None) for n in profile.concurrency] + [(None, r) for r in profile.request_rates]:
                count = profile.level_requests(n)
                bodies = [
                    request_body(model, tokenizer.decode(rows[(rep + i) % len(rows)]), profile.output_tokens)
                    for i in range(count)
                ]
                level = load_level(url, bodies, concurrency=n, rate=rate, seed=profile.seed + rep, client=client)
                out.update({f"{level_name(n, rate)}/{k}": v for k, v in level.items()})
        if server_pid is not None:
            out["peak_mem_mb"] = mem.peak / 2**20
        return out

    return run


# ---------------------------------------------------------------------------------------------
# Servers
