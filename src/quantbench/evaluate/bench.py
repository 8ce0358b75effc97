"""The bench stage: a checkpoint's speed against its base model, measured in the same run with
the same profile, interleaved. evaluate/speed.py says what is measured; evaluate/serving.py holds
the `openai` and `serve` backends.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from quantbench import data, environment, models
from quantbench.checkpoint import weights_size_mb
from quantbench.errors import UserError
from quantbench.evaluate.speed import PartialBench, Profile, bench_pair, hf_measurer, load_profile, prompts
from quantbench.tracking import TAG

log = logging.getLogger(__name__)
BACKENDS = ("hf", "openai", "serve")


@dataclass
class Plan:
    """A profile, its prompts' text and the backend, checked before any run starts."""

    profile_name: str
    profile: Profile
    token_ids: list[int]
    backend: str = "hf"
    server: str | None = None  # backend serve: "vllm" or "transformers"
    endpoints: tuple[str, str] | None = None  # backend openai: (checkpoint's, base model's)


@dataclass
class BenchResult:
    """What the pipeline logs into the candidate's run; `logs` holds the servers' logs, if any."""

    metrics: dict[str, float]
    tags: dict[str, str]
    report: dict  # bench.json
    logs: list[Path] = field(default_factory=list)


class BenchFailed(RuntimeError):
    """The bench stopped part-way (e.g. a server died): `partial` holds what was measured."""

    def __init__(self, cause: BaseException, partial: BenchResult):
        super().__init__(str(cause))
        self.partial = partial


def prepare(profile_name: str, tokenizer, *, backend: str = "hf", server: str = "auto",
            endpoints: tuple[str, str] | None = None, field: str = "--profile") -> Plan:
    """Load the profile and check every prompt length against the evaluation text."""
    profile = load_profile(profile_name, field)
    if backend == "openai":
        from quantbench.evaluate.serving import check_endpoint

        if not (endpoints and all(endpoints)):
            raise UserError("--backend openai needs --endpoint URL (the checkpoint) and --base-endpoint URL (its base model)")
        check_endpoint(endpoints[0], "--endpoint")
        check_endpoint(endpoints[1], "--base-endpoint")
    picked = None
    if backend == "serve":
        from quantbench.evaluate.serving import pick_server

        picked = pick_server(server)
    ids = tokenizer(data.python_docs("evaluation"))["input_ids"]
    for length in profile.prompt_tokens:
        prompts(ids, length, 1, profile.seed)
    return Plan(profile_name, profile, ids, backend, picked, endpoints if backend == "openai" else None)


def bench(checkpoint: Path, base: models.ResolvedModel, plan: Plan) -> BenchResult:
    """Measure `checkpoint` against `base`. BenchFailed, with what was measured, if the backend
    fails part-way."""
    log.info("bench: %s vs base %s, profile %s, backend %s%s", checkpoint, base.name, plan.profile_name, plan.backend,
             f" ({plan.server})" if plan.server else "")
    report = {"backend": plan.backend, "server": plan.server, "profile": plan.profile_name,
              "profile_settings": plan.profile.model_dump(mode="json"), "hardware": environment.describe()}
    tags = {TAG + "bench_backend": plan.backend, TAG + "bench_profile": plan.profile_name,
            TAG + "bench_base_dtype": plan.profile.base_dtype, **({TAG + "bench_server": plan.server} if plan.server else {})}
    logs: list[Path] = []
    try:
        with _measurers(plan, checkpoint, base, logs) as measurers:
            result = bench_pair(measurers, plan.token_ids, plan.profile)
    except PartialBench as exc:
        partial = BenchResult({}, {**tags, TAG + "bench_partial": "true"},
                              {**report, "partial": True, "error": str(exc), "samples": spread(exc.samples)}, logs)
        raise BenchFailed(exc, partial) from exc
    metrics = {**result.metrics, "model/size_mb": weights_size_mb(checkpoint)}
    return BenchResult(metrics, tags, {**report, "partial": False, "metrics": metrics, "samples": spread(result.samples)}, logs)


def spread(samples: dict[str, dict[str, list[float]]]) -> dict:
    """Per sample name: the median (the metric's own statistic), min, max and every value."""
    return {
        model: {key: {"median": statistics.median(v), "min": min(v), "max": max(v), "values": v} for key, v in rows.items()}
        for model, rows in samples.items()
    }


@contextmanager
def _measurers(plan: Plan, checkpoint: Path, base: models.ResolvedModel, logs: list[Path]):
    """{"candidate": measure(prompt_sets, rep), "base": ...} for the backend; servers stopped on
    exit, their logs appended to `logs`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    profile = plan.profile
    if plan.backend == "hf":
        base_dtype = "auto" if profile.base_dtype == "auto" else getattr(torch, profile.base_dtype)
        yield {
            "candidate": hf_measurer(lambda: AutoModelForCausalLM.from_pretrained(checkpoint), profile),
            "base": hf_measurer(lambda: AutoModelForCausalLM.from_pretrained(base.path, dtype=base_dtype), profile),
        }
        return
    from quantbench.evaluate.serving import model_server, openai_measurer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if plan.backend == "openai":
        yield {
            "candidate": openai_measurer(plan.endpoints[0], str(checkpoint), tokenizer, profile),
            "base": openai_measurer(plan.endpoints[1], str(base.path), tokenizer, profile),
        }
        return
    directory = Path(tempfile.mkdtemp(prefix="qb-serve-"))
    try:
        length = max(profile.prompt_tokens) + profile.output_tokens + 64
        with model_server(checkpoint, directory / "candidate.log", plan.server, length) as cand, \
                model_server(base.path, directory / "base.log", plan.server, length) as ref:
            yield {
                "candidate": openai_measurer(cand[0], cand[1], tokenizer, profile, server_pid=cand[2]),
                "base": openai_measurer(ref[0], ref[1], tokenizer, profile, server_pid=ref[2]),
            }
    finally:
        logs.extend(sorted(directory.glob("*.log")))
