"""Speculative decoding (`quantbench bench --draft <run id | checkpoint> [TARGET]`).

The target model (default: the draft's base model, e.g. the teacher a student was distilled
from) generates greedily with the draft proposing tokens (transformers assisted generation), and
alone, on the same prompts, interleaved. Greedy assisted generation yields exactly the target's
own tokens; only the speed changes.

Acceptance rate = draft tokens the target accepted / draft tokens proposed. Both are counted
from forward passes: each draft forward proposes one token; each target forward verifies one
round and yields the accepted tokens plus one of its own, so accepted = new tokens - target
forwards. Logged into the draft's run (or the target's, for a draft checkpoint without one):
`speed/spec_acceptance`, `speed/spec_decode_tok_s`, `base_speed/spec_decode_tok_s` (the target
alone) and `speedup/spec_decode_tok_s`.
"""

from __future__ import annotations

import logging
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from quantbench.core import environment
from quantbench.core.errors import UserError
from quantbench.core.logs import terminal
from quantbench.sources import data, models
from quantbench.sources.checkpoint import vocab_mismatch
from quantbench.speed.measure import Profile, load_profile, prompts
from quantbench.tracking import TAG

log = logging.getLogger(__name__)


@dataclass
class Plan:
    draft: Path  # the draft checkpoint
    target: models.ResolvedModel
    profile_name: str
    profile: Profile
    rows: list[list[int]]  # prompts (token ids), the warm-up ones first


@dataclass
class SpecResult:
    metrics: dict[str, float]
    tags: dict[str, str]
    report: dict  # bench_spec.json
    same_tokens: bool


def prepare(draft: Path, target: models.ResolvedModel, profile_name: str, draft_field: str) -> Plan:
    """The profile's prompts; a draft whose vocabulary is not the target's is refused."""
    from transformers import AutoConfig, AutoTokenizer

    settings = load_profile(profile_name)
    tokenizer = AutoTokenizer.from_pretrained(target.path)
    mismatch = vocab_mismatch(
        tokenizer,
        AutoTokenizer.from_pretrained(draft),
        AutoConfig.from_pretrained(target.path),
        AutoConfig.from_pretrained(draft),
    )
    if mismatch:
        raise UserError(
            f"{draft_field}: its tokenizer is not the target's ({mismatch}); a draft must share the vocabulary"
        )
    ids = tokenizer(data.python_docs("evaluation"))["input_ids"]
    rows = prompts(ids, max(settings.prompt_tokens), settings.warmup + settings.repetitions, settings.seed)
    return Plan(draft, target, profile_name, settings, rows)


def run(plan: Plan) -> SpecResult:
    """The target alone and with the draft, interleaved, on the plan's prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    settings = plan.profile
    log.info(
        "speculative decoding: target %s, draft %s, %d prompts of %d tokens, %d new tokens",
        plan.target.name,
        plan.draft,
        settings.repetitions,
        len(plan.rows[0]),
        settings.output_tokens,
    )
    dtype = "auto" if settings.base_dtype == "auto" else getattr(torch, settings.base_dtype)
    target_model = AutoModelForCausalLM.from_pretrained(plan.target.path, dtype=dtype).eval()
    draft_model = AutoModelForCausalLM.from_pretrained(plan.draft, dtype=target_model.dtype).eval()
    samples = measure(target_model, draft_model, plan.rows, settings.output_tokens, settings.warmup)
    metrics = {
        "speed/spec_acceptance": samples["accepted"] / samples["proposed"] if samples["proposed"] else 0.0,
        "speed/spec_tokens_per_target_step": samples["new_tokens"] / samples["target_steps"],
        "speed/spec_decode_tok_s": statistics.median(samples["assisted_tok_s"]),
        "base_speed/spec_decode_tok_s": statistics.median(samples["alone_tok_s"]),
    }
    metrics["speedup/spec_decode_tok_s"] = metrics["speed/spec_decode_tok_s"] / metrics["base_speed/spec_decode_tok_s"]
    if not samples["same_tokens"]:
        log.warning(
            "assisted generation produced different tokens from the target alone (numerics of batched "
            "verification); the speed figures stand, the outputs differ in places"
        )
    tags = {TAG + "spec_target": plan.target.source, TAG + "spec_draft": str(plan.draft.resolve())}
    report = {
        "target": plan.target.source,
        "draft": str(plan.draft),
        "profile": plan.profile_name,
        "profile_settings": settings.model_dump(mode="json"),
        "same_tokens": samples["same_tokens"],
        "samples": samples,
        "metrics": metrics,
        "hardware": environment.describe(),
    }
    return SpecResult(metrics, tags, report, samples["same_tokens"])


def measure(target, draft, rows: list[list[int]], new_tokens: int, warmup: int) -> dict:
    """Greedy generation of `new_tokens` per prompt, alone and with the draft, interleaved."""
    import torch

    out: dict = {
        "alone_tok_s": [],
        "assisted_tok_s": [],
        "accepted": 0,
        "proposed": 0,
        "new_tokens": 0,
        "target_steps": 0,
        "same_tokens": True,
    }
    for index, row in enumerate(tqdm(rows, desc="speculative", unit="prompt", file=terminal())):
        batch = torch.tensor([row])
        alone, alone_s = _generate(target, batch, new_tokens)
        with _count_forwards(target) as target_steps, _count_forwards(draft) as proposed:
            assisted, assisted_s = _generate(target, batch, new_tokens, assistant_model=draft)
        if index < warmup:
            continue
        produced = assisted.shape[1] - batch.shape[1]
        out["alone_tok_s"].append(new_tokens / alone_s)
        out["assisted_tok_s"].append(produced / assisted_s)
        out["new_tokens"] += produced
        out["target_steps"] += target_steps[0]
        out["accepted"] += produced - target_steps[0]
        out["proposed"] += proposed[0]
        out["same_tokens"] &= bool(torch.equal(alone, assisted))
    return out


class _SameProcessor(logging.Filter):
    """transformers warns on every assisted call that min_new_tokens' processor is passed twice
    (to the draft as well); it is the same processor, applied once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "MinNewTokensLengthLogitsProcessor" not in record.getMessage()


def _generate(model, batch, new_tokens: int, **kwargs):
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("transformers.generation.utils").addFilter(_SameProcessor())

    start = time.perf_counter()
    with torch.inference_mode():
        tokens = model.generate(
            input_ids=batch,
            attention_mask=torch.ones_like(batch),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return tokens, time.perf_counter() - start


@contextmanager
def _count_forwards(model):
    """[number of forward passes of `model`] while the block runs."""
    count = [0]

    def hook(*_):
        count[0] += 1

    handle = model.register_forward_hook(hook)
    try:
        yield count
    finally:
        handle.remove()
