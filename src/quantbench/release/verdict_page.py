"""The verdict's report artifact: `verdict.html` (the verdict table, its notes, and the figures
inline) and `verdict.png` (the figures), opened from the run's Artifacts tab in MLflow.

The figures are what the verdict's one number per row cannot show: how KLD is distributed over the
held-out positions (a mean can hide a tail), how it grows with the position inside a window, and
throughput against load for candidate and base where the bench measured load levels."""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

from quantbench.tracking import Run

HTML = "verdict.html"
PNG = "verdict.png"
POSITION_BINS = 16


def write(run: Run, verdict, work: Path) -> Path:
    """Draw the figures (when the run has anything to draw) and write the page; its path."""
    evaluation = _evaluation(run, work)
    metrics = dict(run.data.metrics)
    png = _figure(evaluation, metrics, work / PNG)
    page = work / HTML
    page.write_text(_page(verdict, png))
    return page


def _evaluation(run: Run, work: Path) -> dict | None:
    if not run.has_artifact("evaluation.json"):
        return None
    return json.loads(run.download("evaluation.json", work / "download").read_text())


def _levels(metrics: dict[str, float]) -> list[tuple[int, float, float]]:
    """(concurrency, candidate tok/s, base tok/s) at every concurrency level both were measured at."""
    found = []
    for key, value in metrics.items():
        level = re.fullmatch(r"speed/c(\d+)/throughput_tok_s", key)
        if level and "base_" + key in metrics:
            found.append((int(level.group(1)), value, metrics["base_" + key]))
    return sorted(found)


def _figure(evaluation: dict | None, metrics: dict[str, float], path: Path) -> Path | None:
    kld = (evaluation or {}).get("kld_per_position") or []
    levels = _levels(metrics)
    decode = [metrics.get("speed/decode_tok_s"), metrics.get("base_speed/decode_tok_s")]
    panels = (["distribution", "position"] if kld else []) + (
        ["load"] if len(levels) > 1 else ["decode"] if None not in decode else []
    )
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), dpi=100, squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "distribution":
            values = np.clip(np.asarray(kld, dtype=float), 1e-6, None)
            ax.hist(values, bins=np.logspace(-6, max(1.0, np.log10(values.max()) + 0.1), 60), color="#4c72b0")
            ax.set_xscale("log")
            for q, style in ((np.mean(values), "-"), (np.quantile(values, 0.99), "--")):
                ax.axvline(q, color="#c44e52", linestyle=style)
            ax.set(title="KLD per held-out position", xlabel="KLD (nats; line: mean, dashed: p99)", ylabel="positions")
        elif panel == "position":
            windows = max(1, int((evaluation or {}).get("intervals", {}).get("windows") or 1))
            per = len(kld) // windows
            grid = np.asarray(kld[: windows * per], dtype=float).reshape(windows, per).mean(0)
            bins = np.array_split(np.arange(per), min(POSITION_BINS, per))
            ax.plot([b[0] for b in bins], [grid[b].mean() for b in bins], marker="o", color="#4c72b0")
            ax.set(title="KLD by position in the window", xlabel="position", ylabel="mean KLD")
        elif panel == "load":
            n, cand, base = zip(*levels)
            ax.plot(n, cand, marker="o", label="candidate")
            ax.plot(n, base, marker="s", label="base")
            ax.set(title="throughput against load", xlabel="requests in flight", ylabel="output tok/s")
            ax.legend()
        else:
            ax.bar(["candidate", "base"], decode, color=["#4c72b0", "#999999"])
            ax.set(title="decode, batch 1", ylabel="tok/s")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _page(verdict, png: Path | None) -> str:
    head = "".join(f"<th>{h}</th>" for h in ("figure", "value", "95% interval", verdict.policy or "policy", "result"))
    rows = "".join(
        f"<tr class='{'bad' if r.result not in ('', 'pass') else ''}'>"
        + "".join(f"<td>{html.escape(x)}</td>" for x in (r.figure, r.value, r.interval, r.limit, r.result))
        + "</tr>"
        for r in verdict.rows
    )
    image = (
        f"<p><img alt='KLD distribution, KLD by position, speed' src='data:image/png;base64,"
        f"{base64.b64encode(png.read_bytes()).decode()}'></p>"
        if png
        else ""
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>verdict</title><style>"
        "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
        "padding:3px 8px}td:nth-child(2),td:nth-child(3){text-align:right}tr.bad td:last-child{color:#b00;"
        "font-weight:bold}</style></head><body>"
        f"<h2>{html.escape(verdict.title)}</h2><p>run {html.escape(verdict.run_id)} · "
        f"{html.escape(verdict.summary(gated=True) if verdict.policy else 'no policy')}</p>"
        f"<table><tr>{head}</tr>{rows}</table>"
        + "".join(f"<p>{html.escape(n)}</p>" for n in verdict.notes)
        + image
        + "</body></html>\n"
    )
