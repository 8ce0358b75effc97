"""The reload check: quality of the in-memory model says nothing about what was saved, so the saved
directory is loaded back from disk, scored on held-out text and asked for a few tokens.

A quantized checkpoint is bounded against the base model's perplexity; a trained one (a distilled
student: another, smaller model) against itself before it was saved.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from quantbench.core.files import pages_handed_back
from quantbench.core.measures import greedy_text, perplexity
from quantbench.sources.checkpoint import gguf_file, load_model

log = logging.getLogger(__name__)


class CheckpointCheckFailed(RuntimeError):
    """The saved checkpoint did not reload into a sane model."""


@dataclass
class CheckResult:
    metrics: dict[str, float]  # check/base_ppl, check/reload_ppl, check/ppl_ratio (+ check/trained_ppl)
    sample: str  # the greedy continuation of the check prompt
    model: object  # the reloaded model: later stages score this very object
    tokenizer: object


def loaded_whole(loading: dict) -> str | None:
    """What transformers could not match between a checkpoint's tensors and its model, or None. A
    weight the model has and the file lacks is left at its random initialisation, and a random
    model's perplexity looks like a random base's: measured with llm-compressor 0.14 and transformers
    5.17, a Mixtral-layout checkpoint saved its experts as `block_sparse_moe.experts.N.gate_proj` and
    reloaded with every expert missing; the perplexity check alone passed it."""
    missing, unexpected = list(loading.get("missing_keys") or []), list(loading.get("unexpected_keys") or [])
    mismatched = list(loading.get("mismatched_keys") or [])
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the model's weights are not in the files (e.g. {sorted(missing)[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} tensors in the files are not the model's (e.g. {sorted(unexpected)[0]})")
    if mismatched:
        parts.append(f"{len(mismatched)} have another shape than the model's (e.g. {mismatched[0]})")
    return "; ".join(parts) or None


def stored_weights(checkpoint: Path) -> list[Path]:
    """The files a quantized checkpoint's weights load from as stored, de-quantized into new tensors
    as they load (so their pages are read once): a GGUF file, a compressed-tensors checkpoint's
    safetensors. [] for any other: stored as its model computes (views of the files, read on every
    pass), or loaded by a kernel that may rewrite its tensors in place (GPTQModel's GPTQ and AWQ
    formats): a hand-back racing such a write would lose it (with it, a GPTQModel GPTQ reload once
    scored a perplexity of 2.8e9 against 15.5 on a fresh clone's test run)."""
    config = checkpoint / "config.json"
    quant = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    gguf = gguf_file(checkpoint)
    if gguf is not None:
        return [gguf]
    if not quant or quant.get("quant_method") != "compressed-tensors":
        return []
    return sorted(checkpoint.glob("*.safetensors"))


def reload_check(
    path: Path,
    spec,
    token_ids: list[int],
    base_ppl: float,
    trained_ppl: float | None = None,
    *,
    dtype: str | None = None,
) -> CheckResult:
    """Reload `path`, score it on `token_ids` and generate; CheckpointCheckFailed if it is broken.
    `spec` is the recipe's `check:` section; `dtype` the dtype to compute in (None: as saved)."""
    import torch
    from transformers import AutoTokenizer

    with pages_handed_back(stored_weights(path)):  # read once, de-quantized: not kept beside the copy
        model, loading = load_model(
            path, output_loading_info=True, **({"dtype": getattr(torch, dtype)} if dtype else {})
        )
        if problem := loaded_whole(loading):
            raise CheckpointCheckFailed(f"the saved checkpoint does not load whole: {problem}")
        reload_ppl = perplexity(model, token_ids, spec.window)  # its first pass de-quantizes the weights
    tokenizer = AutoTokenizer.from_pretrained(path)
    sample, new_tokens = greedy_text(model, tokenizer, spec.prompt, spec.generate_tokens)
    ratio = reload_ppl / base_ppl
    log.info("base ppl %.3f, reloaded ppl %.3f (x%.3f); sample: %r", base_ppl, reload_ppl, ratio, sample)
    reference, against = (
        (base_ppl, "the base model's") if trained_ppl is None else (trained_ppl, "the trained student's (in memory)")
    )
    if not math.isfinite(reload_ppl) or reload_ppl / reference > spec.max_ppl_ratio:
        raise CheckpointCheckFailed(
            f"the saved checkpoint reloads with perplexity {reload_ppl:.4g} against {against} "
            f"{reference:.4g} (x{reload_ppl / reference:.3g} > check.max_ppl_ratio {spec.max_ppl_ratio})"
        )
    if new_tokens == 0:
        raise CheckpointCheckFailed("the saved checkpoint generated no tokens")
    metrics = {"check/base_ppl": base_ppl, "check/reload_ppl": reload_ppl, "check/ppl_ratio": ratio}
    if trained_ppl is not None:
        metrics["check/trained_ppl"] = trained_ppl
    return CheckResult(metrics, sample, model, tokenizer)
