"""--best: the fastest subset of the steps whose model passes the policy, predicted from the step
multipliers (`run` then measures it against the start).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from quantbench import engines
from quantbench.jobs.stack.schema import KNOBS, Config, Resolved, StackFile, _apply, refusals


def compose(stack: StackFile, steps: list[Config], keep: tuple[int, ...]) -> Config:
    """The configuration of the start plus the steps `keep` (in order): each knob as the last kept
    step that sets it leaves it (a model keeps the source it was made from)."""
    config = steps[0]
    for i in keep:
        changes = {k: getattr(steps[i], k) for k in KNOBS if getattr(stack.steps[i], k) is not None}
        if "model" in changes:
            changes["source"] = steps[i].source
        config = _apply(config, changes)
    return config


def best_subset(
    stack: StackFile, steps: list[Config], report: dict, models_: dict[str | None, Resolved]
) -> dict | None:
    """Every subset of the steps after the start (order kept) whose configuration the engines serve
    and whose model passes the policy, predicted as the start's throughput times the kept steps'
    multipliers; the highest prediction wins. Stacks do not simply multiply, so the winner is then
    measured (`run` does it) unless it is one of the steps already measured. None: no subset passes."""
    rows = report["steps"]
    if "throughput_tok_s" not in rows[0]:
        return None
    serves: dict[tuple[str, str | None], bool] = {}
    candidates = []
    later = range(1, len(steps))
    for size in range(len(steps)):
        for keep in itertools.combinations(later, size):
            if any("multiplier" not in rows[i] for i in keep):
                continue  # a failed step: nothing to predict from
            config = compose(stack, steps, keep)
            if any(refusals(config).values()):
                continue
            key = (config.engine, config.model_key)
            if key not in serves:
                engine = engines.get(config.engine)
                serves[key] = not (engine.unavailable() or engine.unserved(models_[config.model_key].path))
            if not serves[key]:
                continue
            # whose quality it has: the last kept step that set the model or the KV cache (a KV cache
            # kept from before a later model's step: that model's quality, without the cache's cost)
            setter = max([0] + [i for i in keep if stack.steps[i].model is not None or stack.steps[i].kv_cache])
            if not rows[setter].get("policy_passed", False):
                continue
            predicted = rows[0]["throughput_tok_s"] * math.prod(rows[i]["multiplier"] for i in keep)
            candidates.append((predicted, keep, config))
    if not candidates:
        return None
    predicted, keep, config = max(candidates, key=lambda c: (c[0], -len(c[1])))
    found = {
        "steps": [stack.steps[i].name for i in (0, *keep)],
        "predicted_tok_s": predicted,
        "predicted_cumulative": predicted / rows[0]["throughput_tok_s"],
    }
    same = [i for i, c in enumerate(steps) if c == config and "cumulative" in rows[i]]
    if same:
        row = rows[same[0]]
        found |= {"measured_as": stack.steps[same[0]].name, "throughput_tok_s": row["throughput_tok_s"],
                  "cumulative": row["cumulative"], "cumulative_ci": row.get("cumulative_ci")}  # fmt: skip
    else:
        found["config"] = dataclasses.asdict(config)
    return found
