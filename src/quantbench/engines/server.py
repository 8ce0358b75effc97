"""A server engine's process for one checkpoint, and the streamed request that talks to it.

`model_server` starts an engine's server (its `server_command`) on 127.0.0.1 (a free port, its own
process group), is ready when `/health` answers and one real completion succeeds (a model an
engine cannot run may pass /health and crash on the first request), and always stops the whole
group: on success, failure and Ctrl-C. `stream_one` is one streamed completion, timed."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from quantbench import engines
from quantbench.core.processes import free_port, stop_group
from quantbench.engines import ServerSettings, ServingEngine

REQUEST_TIMEOUT_S = 300.0


class EndpointError(RuntimeError):
    """The server failed while being measured (died, dropped the stream, answered an error)."""


@dataclass
class Stream:
    """One streamed completion. Times in seconds from sending the request."""

    ttft: float
    e2e: float
    chunk_times: list[float]  # arrival of each chunk that carried output tokens
    chunk_tokens: list[int]  # how many tokens each carried (from the server's running usage; else 1)
    counted: bool  # whether the server reported the token counts
    drafted: tuple[int, int] | None = None  # speculative decoding: (tokens drafted, accepted), as the server says
    prompt_computed: int | None = None  # prompt tokens the server computed (not reused from its cache), where it says
    prompt_cached: int | None = None  # prompt tokens the server reused from its prefix cache, where it says

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def gaps(self) -> list[float]:
        """Gaps between chunks, as `vllm bench serve` counts inter-token latency."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first chunk / time from the first chunk to the last."""
        span = self.chunk_times[-1] - self.chunk_times[0]
        after = self.tokens - self.chunk_tokens[0]
        return after / span if span > 0 and after > 0 else None


def http_client():
    """A connection pool kept for a whole measurement (keep-alive, as `vllm bench serve`'s session):
    a new client per request costs a TCP connect and an SSL context, ~10-30 ms of client time that
    would land in TTFT."""
    import httpx

    return httpx.Client(
        timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    )


def stream_one(url: str, body: dict, client=None) -> Stream:
    """One streamed completion. With a usage chunk asked for (vLLM) every chunk with a choice is
    output, as `vllm bench serve` counts them (one whose text is empty holds a byte of a character
    not complete yet), and the server's total corrects the count of the last one; otherwise a chunk
    with text is one token."""
    import httpx

    own = client is None
    client = client or http_client()
    usage_asked = bool((body.get("stream_options") or {}).get("include_usage"))
    start = time.perf_counter()
    times: list[float] = []
    counts: list[int] = []
    total = None  # the server's completion_tokens, from its last chunk
    drafted = None
    computed = cached = None
    finished = False
    try:
        with client.stream("POST", url.rstrip("/") + "/completions", json=body) as response:
            if response.status_code != 200:
                raise EndpointError(f"{url} answered HTTP {response.status_code}: {response.read()[:300]!r}")
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line.removeprefix("data:").strip()
                if payload == "[DONE]":
                    finished = True
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                timings = data.get("timings") or {}  # llama-server: its counts, on the last chunk
                if "draft_n" in timings:
                    drafted = (int(timings["draft_n"]), int(timings.get("draft_n_accepted", 0)))
                if "prompt_n" in timings:
                    computed = int(timings["prompt_n"])
                if "cache_n" in timings:
                    cached = int(timings["cache_n"])
                if not data.get("choices"):  # the usage chunk
                    usage = data.get("usage") or {}
                    total = usage.get("completion_tokens", total)
                    reused = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    if reused is not None and "prompt_tokens" in usage:  # vLLM's prefix cache
                        cached, computed = int(reused), int(usage["prompt_tokens"]) - int(reused)
                    continue
                choice = data["choices"][0]
                if usage_asked or choice.get("text"):
                    times.append(now - start)
                    counts.append(1)
                if choice.get("finish_reason"):
                    finished = True
    except httpx.HTTPError as exc:
        raise EndpointError(f"{url}: {type(exc).__name__}: {exc}") from exc
    finally:
        if own:
            client.close()
    end = time.perf_counter() - start
    if not finished:
        raise EndpointError(f"{url}: the stream ended before the completion finished")
    counted = total is not None
    if not times:  # the model ended at once (its first token an end of sequence; a server without ignore_eos)
        return Stream(end, end, [end], [int(total or 0)], counted, drafted, computed, cached)
    if total is not None and total != sum(counts):  # a chunk held several tokens (or none): the server's total counts
        counts[-1] = max(0, counts[-1] + total - sum(counts))
    return Stream(times[0], end, times, counts, counted, drafted, computed, cached)


@contextmanager
def model_server(
    checkpoint: Path,
    log_path: Path,
    engine: ServingEngine | str = "transformers",
    settings: ServerSettings | None = None,
):
    """A server engine serving one checkpoint on 127.0.0.1; yields (base URL, model name, pid).
    Ready once /health answers and one completion succeeds. Stopped with its process group
    whatever happens."""
    import httpx

    engine = engines.get(engine) if isinstance(engine, str) else engine
    settings = settings or ServerSettings()
    port = free_port()
    # vLLM puts its ZeroMQ sockets in TMPDIR, whose paths must stay under 107 characters
    tmp = Path(tempfile.mkdtemp(prefix="qbv-", dir="/tmp" if Path("/tmp").is_dir() else None))
    try:
        cmd, env = engine.server_command(checkpoint, port, settings, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    log.write(f"$ {' '.join(cmd)}\n".encode())
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    timeout = engine.health_timeout_s
    name = engine.describe(settings.compiled)

    def failed(what: str) -> EndpointError:
        log.flush()
        return EndpointError(
            f"{name} could not serve {checkpoint} ({what}): {engine.explain(log_path)} (full log: {log_path})"
        )

    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise failed(f"exit code {proc.returncode} before it was healthy")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise EndpointError(f"{name} was not healthy after {timeout:.0f} s; see {log_path}")
            time.sleep(0.5)
        try:  # healthy is not enough: a model the engine cannot run fails on its first request
            stream_one(url, engine.request_body(str(checkpoint), "Hello", 2))
        except EndpointError as exc:
            time.sleep(1.0)  # let the server write why
            raise failed(f"healthy, but its first completion failed: {exc}") from None
        yield url, str(checkpoint), proc.pid
    finally:
        stop_group(proc)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
