"""Backends `openai` and `serve`: speed read from a streaming OpenAI-compatible endpoint.

- `openai`: any endpoint serving `/v1/completions` with streaming. TTFT and inter-token times are
  read from the stream (one server-sent chunk per token); concurrency N is N clients sending at
  once. Refused connections fail at once with the URL; nothing retries.
- `serve`: starts a server for the checkpoint on 127.0.0.1 (a free port, its own process group):
  vLLM's OpenAI server where vLLM is installed (here, or in its own environment named by
  $QUANTBENCH_VLLM_PYTHON), else `transformers serve`; waits for `/health`, measures through the
  `openai` path, and always stops the server: on success, on failure and on Ctrl-C. Its peak RSS is
  sampled while it serves.

guidellm was considered for the load: against `transformers serve` every request came back
HTTP 422 (FIELD-NOTES), so the client here is a small streaming loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from quantbench.errors import UserError
from quantbench.processes import PeakRSS, free_port, stop_group

HEALTH_TIMEOUT_S = 180.0
VLLM_HEALTH_TIMEOUT_S = 600.0  # vLLM-CPU compiles its kernels at start-up (~2 min here)
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
    def run(prompt_sets: dict[int, list[list[int]]], rep: int) -> dict[str, float]:
        out: dict[str, float] = {}
        with PeakRSS(server_pid) as mem:
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


SERVERS = ("auto", "vllm", "transformers")
VLLM_PYTHON = "QUANTBENCH_VLLM_PYTHON"  # the python of an environment with vLLM (e.g. vllm-cpu)


def vllm_python() -> str | None:
    """The interpreter that runs vLLM: $QUANTBENCH_VLLM_PYTHON, or this one if vLLM is installed here."""
    import importlib.util

    if os.environ.get(VLLM_PYTHON):
        return os.environ[VLLM_PYTHON]
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def pick_server(choice: str) -> str:
    """auto: vLLM where it is installed, else transformers serve."""
    if choice == "vllm" and vllm_python() is None:
        raise UserError(f"--server vllm: vLLM is not installed here; install it (e.g. vllm-cpu) in its own "
                        f"environment and name its python in ${VLLM_PYTHON}")
    if choice == "auto":
        return "vllm" if vllm_python() else "transformers"
    return choice


def server_command(engine: str, checkpoint: Path, port: int, max_model_len: int) -> list[str]:
    if engine == "transformers":
        cli = Path(sys.executable).with_name("transformers")
        return [str(cli), "serve", str(checkpoint), "--host", "127.0.0.1", "--port", str(port)]
    # `python -m` rather than the `vllm` script: the vllm-cpu build's script looks up package
    # metadata under the name "vllm" and fails (FIELD-NOTES).
    cmd = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
           "--served-model-name", str(checkpoint), "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(max_model_len)]
    config = json.loads((checkpoint / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("kv_cache_scheme"):
        cmd += ["--kv-cache-dtype", "fp8"]  # a checkpoint with calibrated FP8 KV-cache scales
    return cmd


@contextmanager
def model_server(checkpoint: Path, log_path: Path, engine: str = "transformers", max_model_len: int = 2048):
    """A server (`transformers serve` or vLLM's OpenAI server) for one checkpoint on 127.0.0.1;
    yields (base URL, model name, pid). Stopped with its whole process group whatever happens."""
    import httpx

    port = free_port()
    cmd = server_command(engine, checkpoint, port, max_model_len)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM-CPU's default reserves far more
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    timeout = HEALTH_TIMEOUT_S if engine == "transformers" else VLLM_HEALTH_TIMEOUT_S
    name = "transformers serve" if engine == "transformers" else "vLLM"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.flush()
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise EndpointError(
                    f"{name} could not serve {checkpoint} (exit code {proc.returncode} before it was "
                    f"healthy): {' | '.join(tail)} (full log: {log_path})"
                )
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise EndpointError(f"{name} was not healthy after {timeout:.0f} s; see {log_path}")
            time.sleep(0.5)
        yield url, str(checkpoint), proc.pid
    finally:
        stop_group(proc)
        log.close()
