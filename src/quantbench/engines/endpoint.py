"""A user's own OpenAI-compatible endpoints (`--engine openai --endpoint URL --base-endpoint
URL`): quantbench starts nothing and cannot tell what they serve; it measures what answers."""

from __future__ import annotations

from quantbench.engines import ServingEngine


class Endpoint(ServingEngine):
    name = "openai"
    label = "OpenAI-compatible endpoints"
    kind = "endpoint"
    tag = "endpoint"

    def status(self) -> tuple[bool, str | None, str]:
        return True, None, "your own running servers (bench --engine openai --endpoint URL --base-endpoint URL)"

    def describe(self, compiled: bool = True) -> str:
        return "OpenAI-compatible endpoints"
