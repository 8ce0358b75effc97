"""A tune's answer and its frontier: the chosen candidate (or each check no candidate met, with
the closest value one reached), every measured candidate beside the shipped uniform recipes on size vs
KLD, and its plot."""

from __future__ import annotations

import math
from pathlib import Path

from quantbench.core.intervals import pareto
from quantbench.recipe import available_recipes, recipes_dir
from quantbench.tracking import TAG, Tracker
from quantbench.tune.candidates import Candidate


def shipped_references(tracker: Tracker, base_fingerprint: str, gguf: bool | None = None) -> list:
    """The newest FINISHED run of each shipped recipe (recipes/) on this base model that has a
    KLD: the uniform reference points of the frontier (with `gguf`, only llama.cpp's presets, or
    only the others: a tune is drawn beside what its engine serves)."""
    shipped = set(available_recipes(recipes_dir()))
    newest = {}
    for r in tracker.search({TAG + "role": "candidate", TAG + "base_fingerprint": base_fingerprint}):
        recipe = r.data.tags.get(TAG + "recipe")
        if (
            recipe in shipped
            and TAG + "tune" not in r.data.tags
            and "quality/kld_mean" in r.data.metrics
            and recipe not in newest
            and (gguf is None or (r.data.tags.get(TAG + "format") == "gguf") == gguf)
        ):
            newest[recipe] = r
    return list(newest.values())


def frontier(candidates: list[Candidate], references: list, policy: str) -> list[dict]:
    """Every measured tuned candidate and shipped reference on (size, KLD), with whether it is on
    the size-vs-KLD Pareto frontier and which shipped recipes are both smaller and lower in KLD."""
    points = []
    for c in candidates:
        if c.run_id and "quality/kld_mean" in c.metrics and "model/size_mb" in c.metrics:
            points.append(
                {
                    "kind": "tuned",
                    "run_id": c.run_id,
                    "recipe": c.recipe,
                    "name": c.name,
                    "passed": c.passed,
                    "size_mb": c.metrics["model/size_mb"],
                    "kld": c.metrics["quality/kld_mean"],
                    "bits_per_weight": c.metrics.get("model/bits_per_weight"),
                    "predicted_kld": c.predicted_kld,
                    "decode_speedup": c.metrics.get("speedup/decode_tok_s"),
                }
            )
    for r in references:
        m = r.data.metrics
        if "model/size_mb" in m:
            points.append(
                {
                    "kind": "shipped",
                    "run_id": r.info.run_id,
                    "recipe": r.data.tags.get(TAG + "recipe"),
                    "name": r.data.tags.get(TAG + "recipe"),
                    "passed": r.data.tags.get(f"{TAG}gate.{policy}") == "pass",
                    "size_mb": m["model/size_mb"],
                    "kld": m["quality/kld_mean"],
                    "bits_per_weight": m.get("model/bits_per_weight"),
                    "predicted_kld": None,
                    "decode_speedup": m.get("speedup/decode_tok_s"),
                }
            )
    for p, keep in zip(points, pareto([(p["size_mb"], p["kld"]) for p in points])):
        p["frontier"] = keep
        p["dominated_by"] = (
            [
                q["name"]
                for q in points
                if q["kind"] == "shipped" and q["size_mb"] < p["size_mb"] and q["kld"] < p["kld"]
            ]
            if p["kind"] == "tuned"
            else []
        )
    return sorted(points, key=lambda p: p["size_mb"])


def plot_frontier(points: list[dict], path: Path, title: str) -> Path:
    """Size vs KLD (and, when candidates were benched, decode speedup vs KLD): tuned candidates
    coloured by verdict, shipped uniform recipes in grey, the size-vs-KLD frontier dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = [p for p in points if p.get("decode_speedup") is not None]
    fig, axes = plt.subplots(1, 2 if speed else 1, figsize=(13 if speed else 8, 5.5), dpi=110, squeeze=False)
    panels = [("size_mb", "model/size_mb (lower is better)", points)]
    if speed:
        panels.append(("decode_speedup", "speedup/decode_tok_s (higher is better)", speed))
    for ax, (x_key, x_label, shown) in zip(axes[0], panels):
        for p in shown:
            tuned = p["kind"] == "tuned"
            color = ("tab:green" if p["passed"] else "tab:orange") if tuned else "tab:gray"
            ax.scatter(
                [p[x_key]], [p["kld"]], s=60 if tuned else 45, color=color, marker="o" if tuned else "s", zorder=3
            )
            label = f"{p['bits_per_weight']:.2f} b/w" if tuned and p.get("bits_per_weight") else p["name"]
            ax.annotate(label, (p[x_key], p["kld"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
        if x_key == "size_mb":
            line = sorted((p["size_mb"], p["kld"]) for p in shown if p["frontier"])
            if len(line) > 1:
                ax.plot(*zip(*line), color="tab:green", linestyle="--", zorder=2, label="Pareto frontier (size vs KLD)")
        if shown:
            ax.set_yscale("log")
        ax.set_xlabel(x_label)
        ax.set_ylabel("quality/kld_mean (lower is better)")
        ax.grid(alpha=0.3)
    ax = axes[0][0]
    ax.scatter([], [], color="tab:green", label="tuned, passes the policy")
    ax.scatter([], [], color="tab:orange", label="tuned, fails the policy")
    ax.scatter([], [], color="tab:gray", marker="s", label="shipped uniform recipe")
    ax.legend(loc="best", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def answer(candidates: list[Candidate], objective: str = "size") -> tuple[Candidate | None, list[dict]]:
    """The chosen candidate (the smallest that passes the policy, or with the latency objective the
    fastest: measured decode time where benched, else predicted; else the smallest / fastest whose
    quality passes; else the one with the fewest failed checks, then the lowest KLD; a tie goes to
    the lower KLD) and, when none passes, every check no candidate met with the closest value any
    candidate reached."""
    measured = [c for c in candidates if c.checks]
    if not measured:
        return None, []

    def size(c: Candidate) -> tuple[float, float]:
        # size (or decode time) first; at one size (the same allocation made by two methods) the lower KLD
        kld = c.metrics.get("quality/kld_mean", math.inf)
        if objective == "latency":
            decode = c.metrics.get("speed/decode_tok_s")
            return (1000.0 / decode if decode else c.predicted_ms or math.inf), kld
        return round(c.metrics.get("model/size_mb", math.inf), 3), kld

    passing = [c for c in measured if c.passed]
    if passing:
        return min(passing, key=size), []
    quality = [c for c in measured if c.quality_passed]
    best = (
        min(quality, key=size)
        if quality
        else min(measured, key=lambda c: (len(c.failed_checks()), c.metrics.get("quality/kld_mean", math.inf)))
    )
    unmet = []
    for i, check in enumerate(measured[0].checks):
        if any(c.checks[i]["passed"] for c in measured if len(c.checks) > i):
            continue
        values = [(c.checks[i]["value"], c) for c in measured if isinstance(c.checks[i]["value"], (int, float))]
        closest = None
        if values:
            op = str(check["threshold"]).split()[0]
            value, c = max(values, key=lambda v: v[0]) if op == ">=" else min(values, key=lambda v: v[0])
            closest = {"value": value, "run_id": c.run_id, "name": c.name}
        unmet.append({"check": check["check"], "threshold": check["threshold"], "closest": closest})
    return best, unmet
