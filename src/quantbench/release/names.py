"""Whether a metric name is one the stages log (policies, compare axes): the catalogue's families
(quantbench.metrics) with the task names known here (the offline tasks and every task a suite names),
and close matches for a name that is not."""

from __future__ import annotations

import difflib

from quantbench.core.errors import UserError
from quantbench.core.settings import parse_yaml, read_settings
from quantbench.metrics import (
    CONCURRENT,
    FIXED,
    RECOVERABLE,
    SPEED,
    direction,
    without_interval_suffix,
)
from quantbench.quality.suite import suites_dir
from quantbench.quality.tasks import OFFLINE_TASKS


def known_tasks() -> set[str]:
    """The offline tasks plus every task named in the suites directory's files."""
    tasks = set(OFFLINE_TASKS)
    for path in suites_dir().glob("*.yaml"):
        try:
            tasks.update((parse_yaml(read_settings(path), str(path))[0] or {}).get("tasks") or [])
        except (UserError, AttributeError, TypeError):
            continue  # a broken suite is reported where it is used
    return tasks


def catalogue() -> list[str]:
    """Every concrete metric name (concurrency shown as c1, c4, ...), for suggestions."""
    names = list(FIXED)
    speed = [f"speed/{k}" for k in SPEED] + [f"speed/c{n}/{k}" for n in (1, 4) for k in CONCURRENT]
    tasks = [f"task/{t}/{m}" for t in sorted(known_tasks()) for m in ("acc", "acc_norm", "perplexity")]
    names += speed + tasks
    names += [f"speedup/{s.removeprefix('speed/')}" for s in speed]
    names += ["recovery/quality/ppl", "recovery/quality_ood/ppl"] + [f"recovery/{t}" for t in tasks]
    return names


def check_name(name: str) -> str | None:
    """None if `name` is a metric the stages log; else the problem, with close matches."""
    name = without_interval_suffix(name)
    base = name.removeprefix("recovery/")
    if name.startswith("recovery/") and not RECOVERABLE.fullmatch(base):
        return f"unknown metric '{name}' (recovery/ exists for quality/ppl, quality_ood/ppl and task/*)." + _close(name)
    if base.startswith(("task/", "task_engine/")):
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
    return f" Close matches: {', '.join(close)}." if close else " See docs/metrics.md for every metric name."
