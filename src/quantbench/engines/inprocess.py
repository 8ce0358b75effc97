"""In-process transformers `generate` (`hf`): not a serving engine (no server, no continuous
batching; quantized formats run without the kernels that make them fast), always there, loads
every format quantbench writes. The last resort of `auto`."""

from __future__ import annotations

from importlib import metadata

from quantbench.engines import ServingEngine


class InProcess(ServingEngine):
    name = "hf"
    label = "in-process transformers generate"
    kind = "in-process"

    def status(self) -> tuple[bool, str | None, str]:
        return True, metadata.version("transformers"), "in-process generate (bench --backend hf): not a serving engine"

    def describe(self, compiled: bool = True) -> str:
        return "hf: in-process transformers generate (not a serving engine)"
