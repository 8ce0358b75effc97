"""The ledger: per step its throughput, its multiplier over the step before it and the cumulative
one over the first, each with the interval of its paired rounds (step i's repetition r pairs with
step i-1's, and with step 0's). The cumulative multiplier is measured directly (the last step
against the first in the same rounds) and also as the product of the step multipliers (each the
median of its per-round ratios); the two agree within the rounds' noise, and the ledger says by how
much they differ. With `--policy`, the policy's quality checks (not its speed ones) are held
against each step's model. Shown as a table and as a waterfall plot.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from tabulate import tabulate

from quantbench.core.intervals import ratio_interval
from quantbench.jobs.stack.measure import StepResult, _profile
from quantbench.jobs.stack.schema import BASE, Workload
from quantbench.release import gate
from quantbench.speed.measure import summarize


def ledger(results: list[StepResult], qualities: list[dict | None], workload: Workload) -> dict:
    """Per step: throughput (median), its multiplier over the step before it and the cumulative one
    over the first, each with the interval of its paired rounds; the product of the step multipliers
    against the cumulative one measured directly."""
    rows = []
    start = results[0].throughputs
    previous: StepResult | None = None
    product = 1.0
    for result, quality in zip(results, qualities):
        row: dict = {
            "step": result.name,
            "adds": result.adds,
            "engine": result.config.engine,
            "dtype": result.config.dtype,
            "model": (result.config.model or "base") + (f" of {result.config.source}" if result.config.source else ""),
            "concurrency": result.config.concurrency,
            "rate": result.config.rate,
            "draft": _draft_name(result.config.draft, results),
            "kv_cache": result.config.kv_cache,
            "prefix_cache": result.config.prefix_cache,
            "status": "failed" if result.error else "measured",
            "error": result.error,
            "quality": quality,
        }
        thr = result.throughputs
        if thr and not result.error:
            row["throughput_tok_s"] = statistics.median(thr)
            row["throughputs"] = thr  # per round
            # the streamed single request of each round (p<prompt tokens>/...) and the load level,
            # summarised as bench summarises them (medians; peak memory: the maximum)
            speed = summarize(result.samples, _profile(workload, result.config))
            row |= {k: speed[k] for k in ("decode_tok_s", "ttft_ms_p50", "e2e_ms_p50", "peak_mem_mb") if k in speed}
            level = result.config.level
            if any(result.samples.get(f"{level}/saturated", [])):  # arrivals beyond what the server keeps up with
                row["saturated"] = True
            if result.samples.get(f"{level}/spec_acceptance"):  # a draft: its tokens accepted at the load level
                row["spec_acceptance"] = statistics.median(result.samples[f"{level}/spec_acceptance"])
            for name in ("ttft_ms_p50", "ttft_ms_p95", "e2e_ms_p50", "e2e_ms_p95", "requests_s", "prompt_cached_share"):
                if f"{level}/{name}" in speed:
                    row[f"level_{name}"] = speed[f"{level}/{name}"]
            if previous is not None:
                row["multiplier"], row["multiplier_ci"] = _ratio(thr, previous.throughputs)
                product *= row["multiplier"]
            else:
                row["multiplier"], row["multiplier_ci"] = 1.0, None
            if start and not results[0].error:
                row["cumulative"], row["cumulative_ci"] = _ratio(thr, start)
            row["product"] = product
            previous = result
        rows.append(row)
    measured = [r for r in rows if "cumulative" in r]
    direct = measured[-1]["cumulative"] if measured else None
    last_product = measured[-1]["product"] if measured else None
    return {
        "steps": rows,
        "direct": direct,
        "product": last_product,
        "product_vs_direct": (last_product / direct) if direct and last_product else None,
    }


def _draft_name(key: str | None, results: list[StepResult]) -> str | None:
    """A draft as the ledger shows it: the first step that serves its model, else its reference."""
    if key is None:
        return None
    if key == BASE:
        return "base"
    return next((r.name for r in results if r.config.model_key == key), key)


def _ratio(values: list[float], against: list[float]) -> tuple[float, list[float] | None]:
    """The median of the per-round ratios (round r of one step over round r of the other, measured
    back to back) and their 95 % interval; median over median where the rounds do not pair."""
    pairs = [a / b for a, b in zip(values, against) if b > 0]
    if len(pairs) != len(values) or len(values) != len(against):
        return statistics.median(values) / statistics.median(against), None
    interval = ratio_interval(pairs) if len(pairs) >= 3 else None
    return statistics.median(pairs), list(interval) if interval else None


def policy_checks(policy, quality_metrics: dict[str, float]) -> tuple[bool, list[str]]:
    """The policy's quality checks (not its speed, stage or licence ones) on a model's run."""
    try:
        checks = gate.quality_checks(policy, quality_metrics)
    except gate.MissingInterval as exc:
        return False, [f"{exc} (logged without its interval)"]
    return all(c.passed for c in checks), [c.check for c in checks if not c.passed]


def table(report: dict) -> str:
    """The ledger for a terminal or Markdown: one row per step."""

    def interval(ci) -> str:
        return f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""

    rows = []
    for r in report["steps"]:
        q = r.get("quality")
        quality = (
            "—"
            if q is None
            else f"{q['label']} {q['value']:.4g}" + (f" [{q['ci'][0]:.4g}, {q['ci'][1]:.4g}]" if q.get("ci") else "")
        )
        row = [
            r["step"],
            r["adds"],
            f"{r['engine']} · {r['model']} · "
            + (f"{r['rate']:g}/s (≤ {r['concurrency']} at once)" if r.get("rate") else f"c{r['concurrency']}")
            + (
                " · prefix cache"
                + (f" (reused {r['level_prompt_cached_share']:.0%})" if "level_prompt_cached_share" in r else "")
                if r.get("prefix_cache")
                else ""
            )
            + (
                f" · draft {r['draft']}" + (f" (accepted {r['spec_acceptance']:.0%})" if "spec_acceptance" in r else "")
                if r.get("draft")
                else ""
            )
            + (f" · KV {r['kv_cache']}" if r.get("kv_cache") else ""),
            f"{r['throughput_tok_s']:.1f}" + (" (saturated)" if r.get("saturated") else "")
            if "throughput_tok_s" in r
            else "FAILED",
            f"{r['multiplier']:.2f}×{interval(r.get('multiplier_ci'))}" if "multiplier" in r else "—",
            f"{r['cumulative']:.2f}×{interval(r.get('cumulative_ci'))}" if "cumulative" in r else "—",
            quality,
        ]
        if "policy_passed" in r:
            row.append(
                "pass"
                if r["policy_passed"]
                else "fail: " + ", ".join(r["policy_failed"])
                if r["policy_failed"]
                else "—"
            )
        rows.append(row)
    headers = ["step", "adds", "engine · model · concurrency", "tok/s", "× step", "× cumulative", "quality vs base"]
    if any("policy_passed" in r for r in report["steps"]):
        headers.append(f"policy {report.get('policy')}")
    text = tabulate(rows, headers=headers, tablefmt="github")
    if report.get("direct"):
        text += (
            f"\n\nlast step over the first, measured directly: {report['direct']:.2f}×; "
            f"product of the step multipliers: {report['product']:.2f}× "
            f"({(report['product_vs_direct'] - 1) * 100:+.1f} %)"
        )
    if "best" in report:
        b = report["best"]
        if b is None:
            text += f"\n\n--best: no subset of the steps passes the policy {report.get('policy')}"
        elif "cumulative" in b:
            text += (
                f"\n\nfastest stack passing {report.get('policy')}: {' → '.join(b['steps'])}: "
                f"{b['cumulative']:.2f}×{interval(b.get('cumulative_ci'))} over the start, measured"
                + (f" (step {b['measured_as']})" if b["measured_as"] != "measured now" else " in rounds of its own")
                + f"; predicted from the step multipliers {b['predicted_cumulative']:.2f}×"
            )
        else:
            text += f"\n\nfastest stack passing {report.get('policy')}: {' → '.join(b['steps'])}: not measured ({b.get('error')})"
    if report.get("device"):
        text += f"\nmeasured on: {report['device']}"
    return text


def waterfall(report: dict, path: Path, title: str) -> Path | None:
    """The cumulative multiplier per step (log scale), each bar labelled with its step multiplier
    and the quality cost so far."""
    rows = [r for r in report["steps"] if "cumulative" in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4.5), dpi=110)
    xs = range(len(rows))
    values = [r["cumulative"] for r in rows]
    colors = ["tab:green" if r.get("multiplier", 1) >= 1 else "tab:red" for r in rows]
    ax.bar(xs, values, color=colors)
    for x, r in zip(xs, rows):
        q = r.get("quality")
        note = f"×{r['multiplier']:.2f}" + (f"\n{q['label']} {q['value']:.3g}" if q else "")
        ax.annotate(note, (x, r["cumulative"]), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
    ax.set_xticks(list(xs), [r["step"] for r in rows], rotation=20, ha="right")
    ax.set_yscale("log")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("output throughput over the first step (×, log)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
