"""`transformers serve` (transformers' own OpenAI-compatible server) as a serving engine: it loads
every format quantbench writes, without the kernels that make quantized formats fast."""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib import metadata
from pathlib import Path

from quantbench.engines import ServerSettings, ServingEngine, model_config
from quantbench.engines.formats import decompressed


def _cli() -> Path:
    return Path(sys.executable).with_name("transformers")


class TransformersServe(ServingEngine):
    name = "transformers"
    label = "transformers serve"
    kind = "server"
    stacks_experts = True

    def unavailable(self) -> str | None:
        if _cli().exists() and all(importlib.util.find_spec(m) is not None for m in ("fastapi", "uvicorn", "openai")):
            return None
        return "transformers serve is not installed (transformers[serving]: fastapi, uvicorn, openai)"

    def unserved(self, checkpoint: Path | dict) -> str | None:
        config = model_config(checkpoint)
        quant = config.get("quantization_config") or {}
        if quant.get("quant_method") == "gguf":
            return "it loads safetensors checkpoints, not a GGUF file (in-process hf de-quantizes one)"
        if why := decompressed(config):
            return why
        if quant.get("quant_method") == "compressed-tensors" and quant.get("format") == "pack-quantized":
            # measured with transformers 5.17 (W4A16 and W8A16 on a tiny model): healthy, then its
            # loader refuses the packed weights on the first request ("mismatched sizes")
            return "its loader refuses compressed-tensors pack-quantized weights (mismatched sizes, transformers 5.17)"
        return None

    def status(self) -> tuple[bool, str | None, str]:
        missing = self.unavailable()
        if missing:
            return False, None, "missing transformers[serving] (fastapi, uvicorn, openai)"
        return (
            True,
            metadata.version("transformers"),
            "bench server (OpenAI API); not compressed-tensors pack-quantized weights",
        )

    def describe(self, compiled: bool = True) -> str:
        return f"transformers serve ({metadata.version('transformers')})"

    def server_command(
        self, checkpoint: Path, port: int, settings: ServerSettings, tmp: Path
    ) -> tuple[list[str], dict[str, str]]:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **settings.extra_env}
        return [str(_cli()), "serve", str(checkpoint), "--host", "127.0.0.1", "--port", str(port)], env
