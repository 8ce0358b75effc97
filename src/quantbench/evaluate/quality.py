"""Quality measurements on held-out text."""

from __future__ import annotations

import math

import torch


@torch.inference_mode()
def perplexity(model, token_ids: list[int], window: int, batch_size: int = 4) -> float:
    """Perplexity over consecutive, non-overlapping windows of `window` tokens.

    Every token after the first of each window is scored once; a short tail is dropped so all
    windows are equal and batch cleanly."""
    count = len(token_ids) // window
    if count == 0:
        raise ValueError(f"need at least {window} tokens for one window, got {len(token_ids)}")
    ids = torch.tensor(token_ids[: count * window], dtype=torch.long).view(count, window)
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    for start in range(0, count, batch_size):
        batch = ids[start : start + batch_size].to(device)
        logits = model(input_ids=batch).logits.float()
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total_nll += nll.item()
        total_tokens += batch[:, 1:].numel()
    return math.exp(total_nll / total_tokens)


@torch.inference_mode()
def greedy_text(model, tokenizer, prompt: str, new_tokens: int) -> tuple[str, int]:
    """Greedy continuation of `prompt`: (decoded new text, number of new tokens)."""
    inputs = tokenizer(prompt, return_tensors="pt").to(next(model.parameters()).device)
    out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    new = out[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new, skip_special_tokens=True), int(new.numel())
