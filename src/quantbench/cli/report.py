"""Stage results as the text the CLI prints: tables of metrics against the base model.

Stages return typed results and print nothing; these functions format them (lm-eval's make_table
pattern)."""

from __future__ import annotations

from quantbench.core.intervals import interval_of
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
        f"{'metric':42s} {'baseline':>10s} {'candidate':>10s} {'recovery':>9s}  better  "
        f"{'candidate 95% interval':>22s}  recovery 95% interval"
    ]
    for key in sorted(k for k in metrics if not k.startswith("recovery/") and ".ci_" not in k):
        rows.append(
            f"{key:42s} {_fmt(baseline.get(key)):>10s} {_fmt(metrics[key]):>10s} "
            f"{_fmt(metrics.get(f'recovery/{key}')):>9s}  {direction(key) or '':6s}  "
            f"{_interval(metrics, key):>22s}  {_interval(metrics, f'recovery/{key}')}".rstrip()
        )
    rows += [f"no interval: {note}" for note in notes or []]
    return "\n".join(rows)


def bench_table(metrics: dict[str, float]) -> str:
    """Every speed metric measured for both models: base, candidate, speedup (above 1 is faster),
    and the speedup's 95 % interval over the paired repetitions."""
    rows = [f"{'metric':28s} {'base':>10s} {'candidate':>10s} {'speedup':>8s}  speedup 95% interval"]
    for key in sorted(k for k in metrics if k.startswith("speed/") and "base_" + k in metrics):
        short = key.removeprefix("speed/")
        speedup = metrics.get("speedup/" + short)
        rows.append(
            f"{short:28s} {metrics['base_' + key]:10.4g} {metrics[key]:10.4g} "
            f"{'' if speedup is None else format(speedup, '8.3f'):>8s}  "
            f"{_interval(metrics, 'speedup/' + short, '.3f')}".rstrip()
        )
    return "\n".join(rows)


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
    rows = [f"{'metric':42s} {'transformers':>12s} {'engine':>10s}"]
    for key in sorted(k for k in engine if k.startswith("task_engine/")):
        same = "task/" + key.removeprefix("task_engine/")
        rows.append(f"{key:42s} {_fmt(transformers.get(same)):>12s} {_fmt(engine[key]):>10s}")
    for key in sorted(k for k in engine if k.startswith("quality/engine_")):
        rows.append(f"{key:42s} {'':>12s} {_fmt(engine[key]):>10s}")
    return "\n".join(rows)
