"""The metric catalogue: every name the stages log (DESIGN.md, MLflow contract), which direction is
better for each, and close matches for a misspelled name. compare, gate and the tables read it.

Orientation of the ratios: `recovery/<m>` and `speedup/<m>` are both "above 1 is better" (for a
lower-is-better metric they are baseline / candidate), so a policy thresholds them with a minimum.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Literal

Direction = Literal["higher", "lower"]

# Exact names and their direction (None: a count or a context value, not a score).
FIXED: dict[str, Direction | None] = {
    "quantize/wall_s": "lower",
    "quantize/peak_rss_mb": "lower",
    "model/size_mb": "lower",
    "model/base_size_mb": None,
    "model/compression_ratio": "higher",
    "check/base_ppl": None,
    "check/reload_ppl": "lower",
    "check/ppl_ratio": "lower",
    "check/trained_ppl": None,
    "distill/loss": "lower",
    "distill/kd_loss": "lower",
    "distill/lm_loss": "lower",
    "distill/final_loss": "lower",
    "distill/learning_rate": None,
    "distill/grad_norm": None,
    "distill/step_tokens_per_s": "higher",
    "distill/tokens_per_s": "higher",
    "distill/wall_s": "lower",
    "distill/steps": None,
    "distill/tokens": None,
    "distill/student_params": "lower",
    "distill/kld_before": None,
    "distill/kld_after": "lower",
    "distill/ppl_before": None,
    "distill/ppl_after": "lower",
    "distill/teacher_params": None,
    "quality/ppl": "lower",
    "quality/kld_mean": "lower",
    "quality/kld_p90": "lower",
    "quality/kld_p99": "lower",
    "quality/kld_max": "lower",
    "quality/top1_agreement": "higher",
    "quality/flips_pct": "lower",
    "quality/flips_right_to_wrong_pct": "lower",
    "quality/flips_wrong_to_right_pct": None,
    "quality/flips_items": None,
    "quality/positions": None,
}
# speed/<name> (also base_speed/<name>); c<N>/... per concurrency level.
SPEED: dict[str, Direction] = {
    "ttft_ms_p50": "lower",
    "ttft_ms_p95": "lower",
    "e2e_ms_p50": "lower",
    "e2e_ms_p95": "lower",
    "itl_ms_p50": "lower",
    "decode_tok_s": "higher",
    "prefill_tok_s": "higher",
    "peak_mem_mb": "lower",
    "spec_acceptance": "higher",  # speculative decoding with a draft model (bench --draft)
    "spec_decode_tok_s": "higher",
    "spec_tokens_per_target_step": "higher",
}
CONCURRENT: dict[str, Direction] = {"throughput_tok_s": "higher", "requests_s": "higher"}
# task/<task>/<metric>: lm-eval's metric names; these are lower-is-better, the rest higher.
TASK_LOWER = ("perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte")
# Metrics that have a recovery/<m> against the baseline.
RECOVERABLE = re.compile(r"quality/ppl|task/.+")


def direction(name: str) -> Direction | None:
    """Which way is better for a metric name; None for context values and unknown names."""
    if name in FIXED:
        return FIXED[name]
    if name.startswith(("recovery/", "speedup/")):
        return "higher"
    if name.startswith("task/"):
        return "lower" if name.rsplit("/", 1)[-1] in TASK_LOWER else "higher"
    for prefix in ("speed/", "base_speed/"):
        if name.startswith(prefix):
            rest = name.removeprefix(prefix)
            concurrent = re.fullmatch(r"c\d+/(.+)", rest)
            return CONCURRENT.get(concurrent.group(1)) if concurrent else SPEED.get(rest)
    return None


def is_better(name: str, a: float, b: float) -> bool:
    """a strictly better than b for metric `name`."""
    return a < b if direction(name) == "lower" else a > b


def known_tasks() -> set[str]:
    """The offline tasks plus every task named in suites/*.yaml here."""
    import yaml

    from quantbench.evaluate.tasks import OFFLINE_TASKS

    tasks = set(OFFLINE_TASKS)
    for path in Path("suites").glob("*.yaml"):
        try:
            tasks.update((yaml.safe_load(path.read_text()) or {}).get("tasks") or [])
        except (yaml.YAMLError, AttributeError, TypeError):
            continue  # a broken suite is reported where it is used
    return tasks


def catalogue() -> list[str]:
    """Every concrete metric name (concurrency shown as c1, c4, ...), for suggestions."""
    names = list(FIXED)
    speed = [f"speed/{k}" for k in SPEED] + [f"speed/c{n}/{k}" for n in (1, 4) for k in CONCURRENT]
    tasks = [f"task/{t}/{m}" for t in sorted(known_tasks()) for m in ("acc", "acc_norm", "perplexity")]
    names += speed + tasks
    names += [f"speedup/{s.removeprefix('speed/')}" for s in speed]
    names += ["recovery/quality/ppl"] + [f"recovery/{t}" for t in tasks]
    return names


def check_name(name: str) -> str | None:
    """None if `name` is a metric the stages log; else the problem, with close matches."""
    base = name.removeprefix("recovery/")
    if name.startswith("recovery/") and not RECOVERABLE.fullmatch(base):
        return f"unknown metric '{name}' (recovery/ exists for quality/ppl and task/*)." + _close(name)
    if base.startswith("task/"):
        parts = base.split("/")
        if len(parts) == 3 and parts[1] in known_tasks() and parts[2]:
            return None
        return f"unknown metric '{name}'." + _close(name)
    probe = "speed/" + name.removeprefix("speedup/") if name.startswith("speedup/") else base
    if direction(probe) is None and probe not in FIXED:
        return f"unknown metric '{name}'." + _close(name)
    return None


def _close(name: str) -> str:
    close = difflib.get_close_matches(name, catalogue(), n=3, cutoff=0.6)
    return f" Close matches: {', '.join(close)}." if close else " See the metric names in DESIGN.md (MLflow contract)."
