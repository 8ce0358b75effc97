"""Stage results as the text the CLI prints: tables of metrics against the base model.

Stages return typed results and print nothing; these functions format them (lm-eval's make_table
pattern)."""

from __future__ import annotations

from quantbench.core.intervals import interval_of
from quantbench.core.tables import table
from quantbench.metrics import direction


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"


def _interval(metrics: dict[str, float], key: str, digits: str = ".4g") -> str:
    found = interval_of(metrics, key)
    return "" if found is None else f"[{found[0]:{digits}}, {found[1]:{digits}}]"


def evaluation_table(metrics: dict[str, float], baseline: dict[str, float], notes: list[str] | None = None) -> str:
    """metric, baseline, candidate, recovery, which way is better, and the 95 % intervals of the
    candidate's value and of its recovery (paired with the base); then what has no interval."""
    rows = [
        [
            key,
            _fmt(baseline.get(key)),
            _fmt(metrics[key]),
            _fmt(metrics.get(f"recovery/{key}")),
            direction(key) or "",
            _interval(metrics, key),
            _interval(metrics, f"recovery/{key}"),
        ]
        for key in sorted(k for k in metrics if not k.startswith("recovery/") and ".ci_" not in k)
    ]
    headers = [
        "metric",
        "baseline",
        "candidate",
        "recovery",
        "better",
        "candidate 95% interval",
        "recovery 95% interval",
    ]
    return "\n".join([table(headers, rows, "lrrrlrl"), *(f"no interval: {note}" for note in notes or [])])


def bench_table(metrics: dict[str, float]) -> str:
    """Every speed metric measured for both models: base, candidate, speedup (above 1 is faster),
    and the speedup's 95 % interval over the paired repetitions."""
    rows = []
    for key in sorted(k for k in metrics if k.startswith("speed/") and "base_" + k in metrics):
        short = key.removeprefix("speed/")
        speedup = metrics.get("speedup/" + short)
        rows.append(
            [
                short,
                f"{metrics['base_' + key]:.4g}",
                f"{metrics[key]:.4g}",
                "" if speedup is None else f"{speedup:.3f}",
                _interval(metrics, "speedup/" + short, ".3f"),
            ]
        )
    return table(["metric", "base", "candidate", "speedup", "speedup 95% interval"], rows, "lrrrl")


def metric_lines(metrics: dict[str, float], width: int = 44) -> str:
    return "\n".join(f"  {key:{width}s} {value:.4g}" for key, value in sorted(metrics.items()))


def bench_engine(result) -> str:
    """Which engine the speed was measured through, and why (a bench stage's result)."""
    r = result.report
    dtypes = r.get("dtypes") or {}
    served = (
        f"; served dtype: candidate {dtypes['candidate']}, base {dtypes['base']}" if dtypes.get("candidate") else ""
    )
    return f"measured through: {r['engine_description']} ({r['why']}){served}"


def engine_table(engine: dict[str, float], transformers: dict[str, float]) -> str:
    """`evaluate --engine`: each task metric through transformers and through the engine."""
    rows = [
        [key, _fmt(transformers.get("task/" + key.removeprefix("task_engine/"))), _fmt(engine[key])]
        for key in sorted(k for k in engine if k.startswith("task_engine/"))
    ]
    rows += [[key, "", _fmt(engine[key])] for key in sorted(k for k in engine if k.startswith("quality/engine_"))]
    return table(["metric", "transformers", "engine"], rows, "lrr")
