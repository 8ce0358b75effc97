"""Quality measures shared by every stage: perplexity, a greedy sample, and the base model's
next-token distributions cached exactly so a candidate is scored against them (KLD, top-1)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from tqdm import tqdm

from quantbench.core import intervals
from quantbench.core.logs import terminal

if TYPE_CHECKING:
    import torch

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _inference_mode(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """`@torch.inference_mode()`, with torch imported when the function is first called: importing
    this module (every stage does) must not import torch, which takes over a second."""

    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        import torch  # lazy: see above

        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run


@_inference_mode
def perplexity(model, token_ids: list[int], window: int, batch_size: int = 1) -> float:
    """Perplexity over consecutive, non-overlapping windows of `window` tokens.

    Every token after the first of each window is scored once; a short tail is dropped so all
    windows are equal and batch cleanly. Callers lay the ids out with data.framed, so that where
    the tokenizer adds a BOS each window starts with it (and the BOS, first, is never scored)."""
    total_nll, total_tokens = 0.0, 0
    for log_probs, targets in _log_probs(model, token_ids, window, batch_size, "perplexity"):
        total_nll -= log_probs.gather(-1, targets[:, None]).double().sum().item()
        total_tokens += len(targets)
    return math.exp(total_nll / total_tokens)


@_inference_mode
def greedy_text(model, tokenizer, prompt: str, new_tokens: int) -> tuple[str, int]:
    """Greedy continuation of `prompt`: (decoded new text, number of new tokens)."""
    inputs = tokenizer(prompt, return_tensors="pt").to(next(model.parameters()).device)
    out = model.generate(
        **inputs,
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )
    new = out[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new, skip_special_tokens=True), int(new.numel())


# ---------------------------------------------------------------------------------------------
# The base model's next-token distributions, cached exactly and compactly, and a candidate
# scored against them.
#
# Storing the base's full distributions would take positions x vocabulary numbers (16k x 49k
# floats = 3 GB). Keeping only its top-k log-probs loses real mass on a small model (measured on
# SmolLM2 with k=64: 9% of the probability outside the top 64, KLD under-estimated by 13%).
# Instead the reference keeps what the distributions are computed from: the base model's final
# hidden states (positions x hidden size, after the final norm) and its output head. A
# candidate's KLD then needs the candidate's forward pass and one matrix product, and is exact
# up to float32 rounding. The baseline checks, on every batch, that head(hidden) reproduces the
# model's own logits, so an architecture that post-processes its logits is refused, not
# silently mis-scored.


@dataclass
class Reference:
    hidden: torch.Tensor  # [positions, hidden] float32: the base's final hidden states
    head_weight: torch.Tensor  # [vocab, hidden] float32: the base's output head
    head_bias: torch.Tensor | None  # [vocab] or None
    nll: torch.Tensor  # [positions] the base model's own negative log-likelihood per token
    neg_entropy: torch.Tensor  # [positions] sum(p log p) of the base distribution
    top1: torch.Tensor  # [positions] int64: the base's most likely next token

    def logits(self, start: int, end: int) -> torch.Tensor:
        import torch  # lazy: see _inference_mode

        return torch.nn.functional.linear(self.hidden[start:end], self.head_weight, self.head_bias)

    def log_probs(self, start: int, end: int) -> torch.Tensor:
        import torch  # lazy: see _inference_mode

        return torch.log_softmax(self.logits(start, end), dim=-1)

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        tensors = {
            "hidden": self.hidden,
            "head_weight": self.head_weight,
            "nll": self.nll,
            "neg_entropy": self.neg_entropy,
            "top1": self.top1,
        }
        if self.head_bias is not None:
            tensors["head_bias"] = self.head_bias
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))

    @classmethod
    def load(cls, path: Path) -> Reference:
        from safetensors.torch import load_file

        t = load_file(str(path))
        return cls(t["hidden"], t["head_weight"], t.get("head_bias"), t["nll"], t["neg_entropy"], t["top1"])


def _windows(token_ids: list[int], window: int) -> torch.Tensor:
    import torch  # lazy: see _inference_mode

    count = len(token_ids) // window
    if count == 0:
        raise ValueError(f"need at least {window} tokens for one window, got {len(token_ids)}")
    return torch.tensor(token_ids[: count * window], dtype=torch.long).view(count, window)


def _forward(model, token_ids: list[int], window: int, batch_size: int, desc: str, hidden: bool = False):
    """Yield (log-probs [positions, vocab] float32, targets [positions], final hidden or None)."""
    import torch  # lazy: see _inference_mode

    ids = _windows(token_ids, window)
    device = next(model.parameters()).device
    for start in tqdm(range(0, len(ids), batch_size), desc=desc, unit="batch", leave=False, file=terminal()):
        batch = ids[start : start + batch_size].to(device)
        out = model(input_ids=batch, output_hidden_states=hidden)
        logits = out.logits[:, :-1].float()
        states = out.hidden_states[-1][:, :-1].float().reshape(-1, out.hidden_states[-1].shape[-1]) if hidden else None
        yield torch.log_softmax(logits, dim=-1).reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1).cpu(), states


def _log_probs(model, token_ids: list[int], window: int, batch_size: int, desc: str):
    for log_probs, targets, _ in _forward(model, token_ids, window, batch_size, desc):
        yield log_probs, targets


@_inference_mode
def reference(model, token_ids: list[int], window: int, batch_size: int = 1) -> Reference:
    import torch  # lazy: see _inference_mode

    head = model.get_output_embeddings()
    weight = head.weight.detach().float().cpu()
    bias = head.bias.detach().float().cpu() if getattr(head, "bias", None) is not None else None
    hidden, nll, neg_entropy, top1 = [], [], [], []
    for log_probs, targets, states in _forward(model, token_ids, window, batch_size, "base distributions", hidden=True):
        states = states.cpu()
        rebuilt = torch.log_softmax(torch.nn.functional.linear(states, weight, bias), dim=-1)
        if not torch.allclose(rebuilt, log_probs.cpu(), atol=1e-3, rtol=1e-4):
            raise ValueError(
                f"{type(model).__name__} post-processes its logits after the output head; its "
                "distributions cannot be rebuilt from hidden states, so KLD cannot be cached exactly"
            )
        hidden.append(states)
        nll.append(-log_probs.gather(-1, targets[:, None].to(log_probs.device))[:, 0].cpu())
        neg_entropy.append(torch.linalg.vecdot(rebuilt.exp(), rebuilt))
        top1.append(rebuilt.argmax(-1))
    return Reference(torch.cat(hidden), weight, bias, torch.cat(nll), torch.cat(neg_entropy), torch.cat(top1))


@dataclass
class Comparison:
    nll: torch.Tensor  # [positions] candidate's negative log-likelihood per token
    kld: torch.Tensor  # [positions] KL(base || candidate)
    top1_agree: torch.Tensor  # [positions] bool: the candidate's argmax is the base's
    per_window: int  # positions scored per window (window - 1), consecutive in the tensors above

    @property
    def windows(self) -> int:
        return len(self.nll) // self.per_window

    def metrics(self, prefix: str = "quality/") -> dict[str, float]:
        kld = self.kld.double()
        return {
            prefix + "ppl": math.exp(self.nll.double().mean().item()),
            prefix + "kld_mean": kld.mean().item(),
            prefix + "kld_p90": kld.quantile(0.90).item(),
            prefix + "kld_p99": kld.quantile(0.99).item(),
            prefix + "kld_max": kld.max().item(),
            prefix + "top1_agreement": self.top1_agree.double().mean().item(),
            prefix + "positions": float(len(self.nll)),
        }

    def buckets(self, edges: list[int]) -> list[tuple[str, slice]]:
        """The position buckets of a window `edges` bound ([0, 512, 2048]: positions 0-511 and
        512-2047 of each window; the last edge is cut to the window), named as the metrics are."""
        ends = [min(e, self.per_window) for e in edges]
        return [(f":pos{a}-{b - 1}", slice(a, b)) for a, b in zip(ends, ends[1:]) if b > a]

    def by_position(self, edges: list[int], prefix: str = "quality/") -> dict[str, float]:
        """KLD and top-1 agreement over the positions of each bucket of every window
        (`quality/kld_mean:pos0-511`, ...): a candidate whose error grows with context is seen."""
        kld = self.kld.double().view(self.windows, self.per_window)
        agree = self.top1_agree.double().view(self.windows, self.per_window)
        out = {}
        for name, cut in self.buckets(edges):
            out[f"{prefix}kld_mean{name}"] = kld[:, cut].mean().item()
            out[f"{prefix}top1_agreement{name}"] = agree[:, cut].mean().item()
        return out

    def position_intervals(self, edges: list[int], boot, prefix: str = "quality/") -> dict[str, float]:
        """95 % intervals of `by_position`, from the same paired bootstrap over whole windows."""
        import torch  # lazy: see _inference_mode

        if not intervals.enough(self.windows) or boot.resamples == 0:
            return {}
        counts = boot.counts(self.windows)
        kld = self.kld.double().view(self.windows, self.per_window)
        agree = self.top1_agree.double().view(self.windows, self.per_window)
        out = {}
        for name, cut in self.buckets(edges):
            sizes = torch.full((self.windows,), float(cut.stop - cut.start), dtype=torch.float64)
            for metric, values in (("kld_mean", kld), ("top1_agreement", agree)):
                draws = intervals.weighted_means(counts, values[:, cut].sum(1), sizes)
                out.update(intervals.bounds(f"{prefix}{metric}{name}", draws, self.windows))
        return out

    def intervals(self, base_nll: torch.Tensor, boot, prefix: str = "quality/") -> dict[str, float]:
        """95 % intervals of the metrics above (and of recovery/<prefix>ppl against `base_nll`, the
        base model's per-position NLL), from a paired block bootstrap over whole windows
        (intervals.py); {} when there are too few windows. kld_max has none: a bootstrap cannot
        see past the largest value it was given."""
        import torch  # lazy: see _inference_mode

        if not intervals.enough(self.windows) or boot.resamples == 0:
            return {}
        counts = boot.counts(self.windows)
        sizes = torch.full((self.windows,), float(self.per_window), dtype=torch.float64)

        def sums(values: torch.Tensor) -> torch.Tensor:
            return values.double().view(self.windows, self.per_window).sum(1)

        cand = intervals.weighted_means(counts, sums(self.nll), sizes)
        base = intervals.weighted_means(counts, sums(base_nll), sizes)
        owner = torch.arange(self.windows).repeat_interleave(self.per_window)
        out = {
            **intervals.bounds(prefix + "ppl", cand.exp(), self.windows),
            **intervals.bounds(f"recovery/{prefix}ppl", (base - cand).exp(), self.windows),  # base ppl / candidate ppl
            **intervals.bounds(
                prefix + "kld_mean", intervals.weighted_means(counts, sums(self.kld), sizes), self.windows
            ),
            **intervals.bounds(
                prefix + "top1_agreement", intervals.weighted_means(counts, sums(self.top1_agree), sizes), self.windows
            ),
        }
        for q, name in ((0.90, "kld_p90"), (0.99, "kld_p99")):
            out.update(
                intervals.bounds(prefix + name, intervals.resampled_quantile(self.kld, owner, counts, q), self.windows)
            )
        return out


def kl_divergence(base_log_probs: torch.Tensor, cand_log_probs: torch.Tensor) -> torch.Tensor:
    """KL(base || candidate) per position, over the whole vocabulary."""
    return (base_log_probs.exp() * (base_log_probs - cand_log_probs)).sum(-1).clamp(min=0)


def _kl_from_cache(base_logits: torch.Tensor, neg_entropy: torch.Tensor, cand_log_probs: torch.Tensor) -> torch.Tensor:
    """kl_divergence with the base's sum(p log p) precomputed: one softmax and one dot product
    per position instead of materialising both log-prob differences (the quality pass's hot loop)."""
    import torch  # lazy: see _inference_mode

    p = torch.softmax(base_logits, dim=-1)
    return (neg_entropy - torch.linalg.vecdot(p, cand_log_probs)).clamp(min=0)


@_inference_mode
def compare(model, token_ids: list[int], window: int, ref: Reference, batch_size: int = 1) -> Comparison:
    import torch  # lazy: see _inference_mode

    nll, kld, agree = [], [], []
    offset = 0
    for log_probs, targets in _log_probs(model, token_ids, window, batch_size, "candidate vs base"):
        log_probs = log_probs.cpu()
        n = len(targets)
        if offset + n > len(ref.nll):
            raise ValueError("the reference was computed on different text or window")
        base = ref.logits(offset, offset + n)
        nll.append(-log_probs.gather(-1, targets[:, None])[:, 0])
        kld.append(_kl_from_cache(base, ref.neg_entropy[offset : offset + n], log_probs))
        agree.append(log_probs.argmax(-1) == ref.top1[offset : offset + n])
        offset += n
    if offset != len(ref.nll):
        raise ValueError("the reference was computed on different text or window")
    return Comparison(torch.cat(nll), torch.cat(kld), torch.cat(agree), window - 1)
