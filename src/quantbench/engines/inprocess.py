"""In-process transformers `generate` (`hf`): not a serving engine (no server, no continuous
batching; quantized formats run without the kernels that make them fast), always there, loads
every format quantbench writes. The last resort of `auto`."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from quantbench.engines import ServingEngine
from quantbench.engines.formats import decompressed


class InProcess(ServingEngine):
    name = "hf"
    label = "in-process transformers generate"
    kind = "in-process"
    stacks_experts = True

    def status(self) -> tuple[bool, str | None, str]:
        return True, metadata.version("transformers"), "in-process generate (bench --engine hf): not a serving engine"

    def describe(self, compiled: bool = True) -> str:
        return "hf: in-process transformers generate (not a serving engine)"

    def auto_picks(self, checkpoint: Path | dict | None) -> bool:
        """Not for NVFP4 / MXFP4 / MXFP8, which it de-compresses into 16-bit weights: `auto` says
        they are not measurable here instead (`--engine hf` still times the de-compressed model)."""
        return checkpoint is None or decompressed(checkpoint) is None
