"""Backends `openai` and `serve`: speed read from a streaming OpenAI-compatible endpoint.

- `openai`: any endpoint serving `/v1/completions` with streaming. TTFT and inter-token times are
  read from the stream (one server-sent chunk per token); concurrency N is N clients sending at
  once. Refused connections fail at once with the URL; nothing retries.
- `serve`: starts `transformers serve <checkpoint>` on 127.0.0.1 (a free port, its own process
  group), waits for `/health`, measures through the `openai` path, and always stops the server:
  on success, on failure and on Ctrl-C. Its peak RSS is sampled while it serves.

guidellm was considered for the load: against `transformers serve` every request came back
HTTP 422 (FIELD-NOTES), so the client here is a small streaming loop.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from quantbench.errors import UserError

HEALTH_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 300.0


class EndpointError(RuntimeError):
    """The server failed while being measured (died, dropped the stream, answered an error)."""


def check_endpoint(url: str, field: str) -> None:
    """One quick request: a refused or unreachable endpoint is bad input, reported with its URL."""
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/models", timeout=5.0)
    except httpx.HTTPError as exc:
        raise UserError(f"{field}: cannot reach {url} ({type(exc).__name__}: {exc}); is the server running?") from None


def stream_one(url: str, model: str, prompt: str, max_tokens: int) -> dict[str, float]:
    """One streaming completion: TTFT, inter-token gaps, end-to-end time, tokens received."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    start = time.perf_counter()
    times: list[float] = []
    finished = False
    try:
        with httpx.stream("POST", url.rstrip("/") + "/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
            if response.status_code != 200:
                raise EndpointError(f"{url} answered HTTP {response.status_code}: {response.read()[:300]!r}")
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line.removeprefix("data:").strip()
                if payload == "[DONE]":
                    finished = True
                    break
                choice = json.loads(payload)["choices"][0]
                if choice.get("text"):
                    times.append(time.perf_counter())
                if choice.get("finish_reason"):
                    finished = True
    except httpx.HTTPError as exc:
        raise EndpointError(f"{url}: {type(exc).__name__}: {exc}") from exc
    end = time.perf_counter()
    if not finished or not times:
        raise EndpointError(f"{url}: the stream ended before the completion finished")
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": times[0] - start, "gaps": gaps, "e2e": end - start, "tokens": len(times)}


def openai_measurer(url: str, model: str, tokenizer, profile, server_pid: int | None = None):
    """Backend openai (and serve): one repetition = a streamed request per prompt length, then N
    concurrent streamed requests per concurrency level."""
    from quantbench.evaluate.speed import _PeakRSS

    def run(prompt_sets: dict[int, list[list[int]]], rep: int) -> dict[str, float]:
        out: dict[str, float] = {}
        with _PeakRSS(server_pid) as mem:
            for length, rows in prompt_sets.items():
                r = stream_one(url, model, tokenizer.decode(rows[rep % len(rows)]), profile.output_tokens)
                out[f"p{length}/ttft_ms"] = r["ttft"] * 1000
                out[f"p{length}/e2e_ms"] = r["e2e"] * 1000
                out[f"p{length}/prefill_tok_s"] = length / r["ttft"]
                if r["gaps"]:
                    out[f"p{length}/decode_tok_s"] = len(r["gaps"]) / sum(r["gaps"])
                    out[f"p{length}/itl_ms"] = sorted(r["gaps"])[len(r["gaps"]) // 2] * 1000
            rows = prompt_sets[max(prompt_sets)]
            for n in profile.concurrency:
                results: list[dict | BaseException] = [None] * n

                def client(i: int) -> None:
                    try:
                        results[i] = stream_one(url, model, tokenizer.decode(rows[(rep + i) % len(rows)]), profile.output_tokens)
                    except BaseException as exc:  # re-raised below, in the measuring thread
                        results[i] = exc

                threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
                start = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = time.perf_counter() - start
                for r in results:
                    if isinstance(r, BaseException):
                        raise r
                out[f"c{n}/throughput_tok_s"] = sum(r["tokens"] for r in results) / wall
                out[f"c{n}/requests_s"] = n / wall
        if server_pid is not None:
            out["peak_mem_mb"] = mem.peak / 2**20
        return out

    return run


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def transformers_server(checkpoint: Path, log_path: Path):
    """`transformers serve` for one checkpoint on 127.0.0.1; yields (base URL, model name, pid).
    The server is stopped with its whole process group whatever happens."""
    import httpx

    port = free_port()
    cli = Path(sys.executable).with_name("transformers")
    cmd = [str(cli), "serve", str(checkpoint), "--host", "127.0.0.1", "--port", str(port)]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                log.flush()
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise EndpointError(
                    f"transformers serve could not serve {checkpoint} (exit code {proc.returncode} before it was "
                    f"healthy): {' | '.join(tail)} (full log: {log_path})"
                )
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise EndpointError(f"transformers serve was not healthy after {HEALTH_TIMEOUT_S:.0f} s; see {log_path}")
            time.sleep(0.5)
        yield url, str(checkpoint), proc.pid
    finally:
        stop(proc)
        log.close()


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 10 s; reaped either way."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()
