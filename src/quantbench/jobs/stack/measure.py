"""Every step measured in every round (A B C D, A B C D, ...), one after the other on the same
prompts (every round new ones, and steps served by one server each their own, drawn alike from the
held-out text: a server never meets a prompt twice, so a prefix cache reuses only a shared prefix),
so machine drift hits all alike. A step's speed is its output throughput (tokens/s over the
requests in flight at its concurrency); per-request decode rate, TTFT and end-to-end latency are
logged beside it.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from quantbench import engines
from quantbench.core import hardware
from quantbench.core.logs import terminal
from quantbench.engines import ServerSettings
from quantbench.engines.server import model_server
from quantbench.jobs.stack.schema import Config, Resolved, StackFile, Workload, adds
from quantbench.sources import data
from quantbench.sources.checkpoint import load_model
from quantbench.speed.measure import Profile, hf_measurer, prompts
from quantbench.speed.serving import openai_measurer

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    name: str
    adds: str
    config: Config
    samples: dict[str, list[float]] = field(default_factory=dict)  # per round
    error: str | None = None

    @property
    def throughputs(self) -> list[float]:
        return self.samples.get(f"{self.config.level}/throughput_tok_s", [])


def _profile(workload: Workload, config: Config):
    return Profile(
        prompt_tokens=[workload.prompt_tokens],
        output_tokens=workload.output_tokens,
        concurrency=[config.concurrency] if config.rate is None else [],
        request_rates=[config.rate] if config.rate is not None else [],
        requests_per_level=workload.level_requests(config.concurrency, config.rate),
        repetitions=1,
        warmup=0,
        seed=workload.seed,
        compile=workload.compile,
    )


def shared_prefix_prompts(token_ids: list[int], workload: Workload, count: int) -> list[list[int]]:
    """`count` prompts of the workload's length from the evaluation text; with `prefix_tokens`, each
    starts with the same tokens (from a place of their own) and goes on with its own."""
    if not workload.prefix_tokens:
        return prompts(token_ids, workload.prompt_tokens, count, workload.seed)
    [shared] = prompts(token_ids, workload.prefix_tokens, 1, workload.seed + 1)
    own = prompts(token_ids, workload.prompt_tokens - workload.prefix_tokens, count, workload.seed)
    return [shared + tail for tail in own]


def _hf_load(path: Path, dtype: str, is_base: bool):
    import torch
    from transformers import AutoModelForCausalLM

    if is_base:
        return lambda: AutoModelForCausalLM.from_pretrained(
            path, dtype="auto" if dtype == "auto" else getattr(torch, dtype)
        ).eval()
    return lambda: load_model(path, dtype=hardware.compute_dtype_of(path, dtype))


def measure(
    stack: StackFile, steps: list[Config], models_: dict[str | None, Resolved], logs_dir: Path
) -> list[StepResult]:
    """Every step in every round, in order; servers started once each (one after the other) and
    stopped at the end whatever happens. A step that fails is marked and left out of later rounds."""
    from transformers import AutoTokenizer

    workload = stack.workload
    tokenizer = AutoTokenizer.from_pretrained(models_[None].path)
    ids = tokenizer(data.python_docs("evaluation"))["input_ids"]
    rounds = workload.warmup + workload.repetitions
    # every round its own prompts, and a server that serves several steps other prompts for each of
    # them (drawn alike): a server never meets a prompt it has seen, so its prefix cache reuses only
    # the workload's shared prefix; steps on different servers (or in-process) share the prompts
    most = max(_profile(workload, c).prompts_per_repetition for c in steps) * rounds
    block = [
        0 if engines.get(c.engine).kind == "in-process" else [x.server_key() for x in steps[:i]].count(c.server_key())
        for i, c in enumerate(steps)
    ]
    drawn = shared_prefix_prompts(ids, workload, most * (max(block) + 1))
    prompt_sets = [{workload.prompt_tokens: drawn[b * most : (b + 1) * most]} for b in block]
    results = [StepResult(s.name, adds(s, i), c) for i, (s, c) in enumerate(zip(stack.steps, steps))]
    with ExitStack() as servers:
        measurers = {}
        started: dict[tuple, tuple] = {}
        for i, config in enumerate(steps):
            resolved = models_[config.model_key]
            profile = _profile(workload, config)
            if engines.get(config.engine).kind == "in-process":
                measurers[i] = hf_measurer(_hf_load(resolved.path, config.dtype, config.model is None), profile)
                continue
            key = config.server_key()
            if key not in started:
                engine = engines.get(config.engine)
                engine.ensure(f"stack step {stack.steps[i].name}")
                slots = max(c.concurrency for c in steps if c.server_key() == key)
                in_flight = max(_profile(workload, c).max_requests for c in steps if c.server_key() == key)
                settings = ServerSettings(
                    workload.prompt_tokens + workload.output_tokens + 64,
                    compiled=workload.compile,
                    dtype=config.dtype,
                    slots=slots,
                    in_flight=in_flight,
                    draft=models_[config.draft].path if config.draft else None,
                    kv_cache=config.kv_cache,
                    prefix_tokens=workload.prefix_tokens,
                )
                log_path = logs_dir / f"{len(started)}-{config.engine}.log"
                log.info("stack: starting %s for %s", engine.label, resolved.label or resolved.path)
                started[key] = (servers.enter_context(model_server(resolved.path, log_path, engine, settings)), engine)
            (url, model_name, pid), engine = started[key]
            measurers[i] = openai_measurer(
                url, model_name, tokenizer, profile, server_pid=pid, engine=engine, prefix_cache=config.prefix_cache
            )
        with tqdm(total=rounds * len(steps), desc="stack", unit="step", file=terminal()) as bar:
            for rnd in range(rounds):
                for i, result in enumerate(results):
                    bar.update(1)
                    if result.error:
                        continue
                    try:
                        values = measurers[i](prompt_sets[i], rnd)
                    except Exception as exc:  # that step fails; the others are kept
                        result.error = f"{type(exc).__name__}: {exc}"
                        log.error("stack: step %s failed in round %d: %s", result.name, rnd, result.error)
                        continue
                    if rnd >= workload.warmup:
                        for key, value in values.items():
                            result.samples.setdefault(key, []).append(value)
    return results
