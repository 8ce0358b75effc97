"""`quantbench compare`: every candidate in one table, the quality-vs-speed Pareto frontier marked,
written as Markdown, HTML, JSON and a PNG plot, and logged as artifacts of a summary run.

Candidates are found by tags (`quantbench.role=candidate`, FINISHED), never by run names. A
candidate is on the frontier when no other candidate is at least as good on both axes and better
on one; which way is better comes from the metric catalogue (`metrics.py`).

Where runs carry 95 % intervals (docs/intervals.md), two candidates whose values on an axis each
lie inside the other's interval are listed as "not distinguishable" on it, and the plot draws the
intervals as error bars. The newest noise run of the candidates' base model (`quantbench noise`:
the base against itself) is a row of its own and a band in the plot: differences inside it are
what re-measuring the same model gives.
"""

from __future__ import annotations

import html
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from quantbench import metrics as catalogue
from quantbench.core import tables
from quantbench.core.errors import UserError, check_creatable_dir
from quantbench.core.intervals import interval_of, pareto
from quantbench.release import names
from quantbench.release.stacks import collect_stacks, given_runs, run_stacks
from quantbench.tracking import TAG, Tracker

log = logging.getLogger(__name__)

DEFAULT_QUALITY = "quality/kld_mean"
DEFAULT_SPEED = "speedup/decode_tok_s"
FALLBACK_SPEED = "model/compression_ratio"  # when no candidate has been benched yet
NOT_SERVING = "not a serving engine"
# (column header, metric or tag, format)
COLUMNS = [
    ("size MB", "model/size_mb", "{:.1f}"),
    ("bits/w", "model/bits_per_weight", "{:.2f}"),
    ("compr ×", "model/compression_ratio", "{:.2f}"),
    ("ppl recov", "recovery/quality/ppl", "{:.3f}"),
    ("KLD", "quality/kld_mean", "{:.4f}"),
    ("top-1", "quality/top1_agreement", "{:.3f}"),
    ("flips %", "quality/flips_pct", "{:.1f}"),
    ("decode ×", "speedup/decode_tok_s", "{:.2f}"),
    ("TTFT ×", "speedup/ttft_ms_p50", "{:.2f}"),
    ("peak MB", "speed/peak_mem_mb", "{:.0f}"),
]


@dataclass
class Candidate:
    run_id: str
    name: str
    status: str
    tags: dict[str, str]
    metrics: dict[str, float]
    frontier: bool = False

    @property
    def label(self) -> str:
        return self.tags.get(TAG + "recipe") or self.name

    @property
    def engine(self) -> str:
        """What its speed was measured through: vllm, transformers, endpoint, or hf marked as not a
        serving engine ("" when it was not benched)."""
        served = catalogue.serving(self.tags)
        if served is None:
            return ""
        name = self.tags.get(TAG + "bench_server") or (
            "hf" if not served else self.tags.get(TAG + "bench_backend", "?")
        )
        return name if served else f"{name}: {NOT_SERVING}"

    def gates(self) -> str:
        prefix = TAG + "gate."
        found = {
            k.removeprefix(prefix): v for k, v in self.tags.items() if k.startswith(prefix) and not k.endswith(".at")
        }
        return ", ".join(f"{policy}: {verdict}" for policy, verdict in sorted(found.items()))


@dataclass
class Comparison:
    quality: str
    speed: str
    candidates: list[Candidate] = field(default_factory=list)
    noise: list[Candidate] = field(default_factory=list)  # noise runs of the candidates' base models

    def task_columns(self) -> list[str]:
        return sorted({k for c in self.candidates for k in c.metrics if k.startswith("task/") and k.endswith("/acc")})

    def not_distinguishable(self, metric: str) -> list[tuple[Candidate, Candidate]]:
        """Pairs of candidates whose values of `metric` each lie inside the other's 95 % interval."""
        pairs = []
        for i, a in enumerate(self.candidates):
            for b in self.candidates[i + 1 :]:
                ia, ib = interval_of(a.metrics, metric), interval_of(b.metrics, metric)
                if ia and ib and ia[0] <= b.metrics[metric] <= ia[1] and ib[0] <= a.metrics[metric] <= ib[1]:
                    pairs.append((a, b))
        return pairs


def collect(tracker: Tracker, run_ids: list[str] | None = None) -> list[Candidate]:
    """The candidates: the given runs, or every FINISHED candidate run of the experiment. A given
    run that is not a FINISHED candidate is refused (its numbers are partial, or not a candidate's)."""
    runs, problems = given_runs(tracker, run_ids)
    if not run_ids:
        runs = tracker.runs({TAG + "role": "candidate"})
    out = []
    for r in runs:
        role, status = r.data.tags.get(TAG + "role"), r.info.status
        if role != "candidate":
            problems.append(f"--runs: '{r.info.run_id}' is a {role or 'non-quantbench'} run, not a candidate")
        elif status != "FINISHED":
            error = r.data.tags.get(TAG + "error")
            problems.append(
                f"--runs: '{r.info.run_id}' ({r.info.run_name}) is {status}, not FINISHED"
                + (f" ({error[:200]})" if error else "")
                + "; its numbers are partial: compare finished runs"
            )
        else:
            out.append(Candidate(r.info.run_id, r.info.run_name, status, dict(r.data.tags), dict(r.data.metrics)))
    if problems:
        raise UserError(problems)
    return out


def collect_noise(tracker: Tracker, candidates: list[Candidate]) -> list[Candidate]:
    """The newest FINISHED noise run of each base model the candidates were made from."""
    out = []
    for fingerprint in sorted({c.tags.get(TAG + "base_fingerprint") for c in candidates} - {None}):
        found = tracker.search({TAG + "role": "noise", TAG + "base_fingerprint": fingerprint})
        if found:
            r = found[0]
            name = f"noise floor ({r.data.tags.get(TAG + 'suite', '?')})"
            out.append(Candidate(r.info.run_id, name, r.info.status, dict(r.data.tags), dict(r.data.metrics)))
    return out


def frontier(candidates: list[Candidate], quality: str, speed: str) -> list[Candidate]:
    """Mark and return the candidates not dominated on (quality, speed)."""
    scored = [c for c in candidates if quality in c.metrics and speed in c.metrics]
    # lower is better on each axis: a higher-is-better metric is negated
    signs = [1.0 if catalogue.direction(m) == "lower" else -1.0 for m in (quality, speed)]
    on = pareto([tuple(s * c.metrics[m] for s, m in zip(signs, (quality, speed))) for c in scored])
    frontier = {id(c) for c, keep in zip(scored, on) if keep}
    for c in candidates:
        c.frontier = id(c) in frontier
    return [c for c in candidates if c.frontier]


def check_metric(name: str, flag: str) -> None:
    if catalogue.direction(name) is None:
        problem = names.check_name(name) or f"'{name}' is a context value, not a score"
        raise UserError(f"{flag}: {problem}")


def build(
    candidates: list[Candidate], quality: str | None, speed: str | None, noise: list[Candidate] | None = None
) -> Comparison:
    quality = quality or DEFAULT_QUALITY
    check_metric(quality, "--quality")
    if speed is None:
        speed = DEFAULT_SPEED
        if candidates and not any(DEFAULT_SPEED in c.metrics for c in candidates):
            log.warning(
                "no candidate has %s yet (run `make bench RUN=<id>`); plotting against %s",
                DEFAULT_SPEED,
                FALLBACK_SPEED,
            )
            speed = FALLBACK_SPEED
    check_metric(speed, "--speed")
    comparison = Comparison(quality, speed, candidates, noise or [])
    frontier(candidates, quality, speed)

    # frontier first, then the other scored ones by quality (best first); those missing an axis last
    def key(c: Candidate):
        q = c.metrics.get(quality)
        scored = q is not None and speed in c.metrics
        return (
            not c.frontier,
            not scored,
            q is None,
            (q if catalogue.direction(quality) == "lower" else -q) if q is not None else 0,
        )

    comparison.candidates.sort(key=key)
    return comparison


# ---------------------------------------------------------------------------------------------
# Output: rows, Markdown, HTML, PNG


def rows(cmp: Comparison) -> tuple[list[str], list[list[str]]]:
    header = ["", "run", "recipe", "method", "scheme", "format", "speed via"] + [h for h, _, _ in COLUMNS]
    header += [t.removeprefix("task/").removesuffix("/acc") + " acc" for t in cmp.task_columns()] + ["gate"]
    body = []
    for c in cmp.candidates + cmp.noise:
        marker = "≈" if c in cmp.noise else "★" if c.frontier else ""
        row = [
            marker,
            c.run_id[:8],
            c.label + base_mark(c.tags),
            c.tags.get(TAG + "method", ""),
            c.tags.get(TAG + "scheme", ""),
            c.tags.get(TAG + "format", ""),
            c.engine or "—",
        ]
        for _, key, fmt in COLUMNS:
            row.append(fmt.format(c.metrics[key]) if key in c.metrics else "—")
        row += [f"{c.metrics[t]:.3f}" if t in c.metrics else "—" for t in cmp.task_columns()]
        row.append(c.gates())
        body.append(row)
    return header, body


def terminal(cmp: Comparison) -> str:
    header, body = rows(cmp)
    return (
        tables.table(header, body, "l" * len(header))
        + f"\n★ Pareto frontier on {cmp.quality} ({catalogue.direction(cmp.quality)} is better) "
        f"vs {cmp.speed} ({catalogue.direction(cmp.speed)} is better); 'speed via': the engine "
        f"speed was measured through ({NOT_SERVING}: in-process transformers generate)"
        + "".join("\n" + line for line in notes(cmp))
    )


def base_mark(tags: dict[str, str]) -> str:
    """' ‡' for a candidate quantized into its quantized base's own type, ' †' for any other
    candidate of a base that is itself quantized (notes() says what they mean)."""
    if tags.get(TAG + "same_type_as_base") == "true":
        return " ‡"
    return " †" if tags.get(TAG + "base_quantized", "none") != "none" else ""


def notes(cmp: Comparison) -> list[str]:
    """The lines under the table: a quantized base, the noise row, and the differences the intervals
    cannot tell apart."""
    lines = []
    bases = sorted({c.tags[TAG + "base_quantized"] for c in cmp.candidates if base_mark(c.tags)})
    if bases:
        lines.append(
            f"† the base model is itself quantized ({', '.join(bases)}, de-quantized to float): figures compare "
            "against it, not against the original 16-bit model"
        )
    if any(base_mark(c.tags) == " ‡" for c in cmp.candidates):
        lines.append(
            "‡ quantized into its base's own type: it reproduces the base's grid, so its quality against that "
            "base says little about its loss against the original model"
        )
    if cmp.noise:
        lines.append(
            "≈ noise floor: the base model against itself re-saved (quantbench noise); differences of that "
            "size are what measuring the same model again gives"
        )
    for metric in (cmp.quality, cmp.speed):
        pairs = cmp.not_distinguishable(metric)
        if pairs:
            lines.append(
                f"not distinguishable on {metric} (each value inside the other's 95% interval): "
                + "; ".join(f"{a.label} ~ {b.label}" for a, b in pairs)
            )
    return lines


def markdown(cmp: Comparison, title: str) -> str:
    header, body = rows(cmp)
    lines = [
        f"# {title}",
        "",
        f"Pareto frontier (★) on `{cmp.quality}` vs `{cmp.speed}`. *speed via*: the engine the "
        f"speed was measured through (hf: {NOT_SERVING}, in-process transformers generate).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    lines += [""] + [f"- {line}" for line in notes(cmp)] if notes(cmp) else []
    return "\n".join(lines) + "\n\n![quality vs speed](compare.png)\n"


def html_page(cmp: Comparison, title: str) -> str:
    header, body = rows(cmp)
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    trs = "".join(
        f"<tr class='{'frontier' if r[0] else ''}'>" + "".join(f"<td>{html.escape(x)}</td>" for x in r) + "</tr>"
        for r in body
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
        "padding:4px 8px;text-align:right}tr.frontier{background:#eaf6ea;font-weight:bold}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p>Pareto frontier (★) on <code>{html.escape(cmp.quality)}</code> vs "
        f"<code>{html.escape(cmp.speed)}</code>.</p><table><tr>{head}</tr>{trs}</table>"
        + "".join(f"<p>{html.escape(line)}</p>" for line in notes(cmp))
        + "<p><img src='compare.png' alt='quality vs speed'></p></body></html>\n"
    )


def plot(cmp: Comparison, path: Path, title: str) -> Path:
    """Quality (y) vs speed (x), better towards the top right; the frontier drawn; points labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    scored = [c for c in cmp.candidates if cmp.quality in c.metrics and cmp.speed in c.metrics]
    speed_axis = cmp.speed.startswith(("speedup/", "speed/"))
    for c in scored:
        x, y = c.metrics[cmp.speed], c.metrics[cmp.quality]
        color = "tab:green" if c.frontier else "tab:gray"
        not_serving = speed_axis and catalogue.serving(c.tags) is False
        # hollow: a speed measured in-process (hf), not through a serving engine
        ax.scatter([x], [y], s=60, zorder=3, facecolors="none" if not_serving else color, edgecolors=color)
        xi, yi = interval_of(c.metrics, cmp.speed), interval_of(c.metrics, cmp.quality)
        if xi or yi:  # the 95 % intervals as error bars
            ax.errorbar(
                [x],
                [y],
                xerr=[[x - xi[0]], [xi[1] - x]] if xi else None,
                yerr=[[y - yi[0]], [yi[1] - y]] if yi else None,
                color=color,
                alpha=0.6,
                capsize=3,
                zorder=2,
            )
        label = f"{c.label} [{c.engine}]" if speed_axis and c.engine else c.label
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=9)
    for n in cmp.noise:  # what measuring the base model against itself gives: a band on each axis
        label = f"noise floor ({n.run_id[:8]})"
        for metric, span, line in ((cmp.speed, ax.axvspan, ax.axvline), (cmp.quality, ax.axhspan, ax.axhline)):
            found = interval_of(n.metrics, metric) or ((n.metrics[metric],) * 2 if metric in n.metrics else None)
            if found and found[0] < found[1]:
                span(found[0], found[1], color="tab:orange", alpha=0.15, label=label)
                label = None
            elif found:
                line(found[0], color="tab:orange", linewidth=1.2, linestyle=":", label=label)
                label = None
    line = sorted((c.metrics[cmp.speed], c.metrics[cmp.quality]) for c in scored if c.frontier)
    if len(line) > 1:
        ax.plot(*zip(*line), color="tab:green", linestyle="--", zorder=2, label="Pareto frontier")
    if cmp.speed.startswith("speedup/"):
        ax.axvline(1.0, color="tab:blue", linewidth=0.8, label="base model speed")
    if cmp.quality.startswith("recovery/"):
        ax.axhline(1.0, color="tab:blue", linewidth=0.8, label="base model quality")
    if catalogue.direction(cmp.quality) == "lower":
        ax.invert_yaxis()
    if catalogue.direction(cmp.speed) == "lower":
        ax.invert_xaxis()
    ax.set_xlabel(f"{cmp.speed} ({catalogue.direction(cmp.speed)} is better)")
    ax.set_ylabel(f"{cmp.quality} ({catalogue.direction(cmp.quality)} is better)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)
    if not scored:
        ax.text(0.5, 0.5, f"no candidate has both {cmp.quality} and {cmp.speed}", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def as_json(cmp: Comparison) -> dict:
    return {
        "quality": cmp.quality,
        "speed": cmp.speed,
        "frontier": [c.run_id for c in cmp.candidates if c.frontier],
        "not_distinguishable": {
            m: [[a.run_id, b.run_id] for a, b in cmp.not_distinguishable(m)] for m in (cmp.quality, cmp.speed)
        },
        "noise": [{"run_id": n.run_id, "name": n.name, "metrics": n.metrics} for n in cmp.noise],
        "candidates": [
            {
                "run_id": c.run_id,
                "name": c.name,
                "recipe": c.label,
                "status": c.status,
                "frontier": c.frontier,
                "method": c.tags.get(TAG + "method"),
                "scheme": c.tags.get(TAG + "scheme"),
                "format": c.tags.get(TAG + "format"),
                "base_quantized": c.tags.get(TAG + "base_quantized"),
                "same_type_as_base": c.tags.get(TAG + "same_type_as_base") == "true",
                "speed_engine": c.engine or None,
                "serving_engine": catalogue.serving(c.tags),
                "gates": c.gates(),
                "metrics": c.metrics,
            }
            for c in cmp.candidates
        ],
    }


# ---------------------------------------------------------------------------------------------
# The verb


def run(
    *,
    experiment: str | None = None,
    run_ids: list[str] | None = None,
    quality: str | None = None,
    speed: str | None = None,
    outputs: Path = Path("outputs"),
) -> CompareResult:
    check_creatable_dir(outputs / "compare", "pass --outputs DIR")
    tracker = Tracker(experiment)
    stacks = collect_stacks(tracker, run_ids)
    if stacks is not None:
        if quality or speed:
            raise UserError(
                "--quality/--speed choose the axes candidates are compared on; stacks are compared step by step"
            )
        return run_stacks(tracker, stacks, outputs)
    candidates = collect(tracker, run_ids)
    if not candidates:
        raise UserError(
            f"no finished candidate runs in experiment '{tracker.experiment}' "
            "(run `make quantize RECIPE=...` first, or pass --experiment / --runs)"
        )
    cmp = build(candidates, quality, speed, collect_noise(tracker, candidates))
    title = (
        f"quantbench compare · {tracker.experiment} · {len(candidates)} candidate{'s' if len(candidates) != 1 else ''}"
    )
    tags = {
        TAG + "role": "summary",
        TAG + "compared_runs": ",".join(c.run_id for c in candidates),
        TAG + "quality_metric": cmp.quality,
        TAG + "speed_metric": cmp.speed,
        "mlflow.note.content": f"Pareto frontier of {len(candidates)} candidates on {cmp.quality} vs {cmp.speed}.",
    }
    with tracker.start_run(f"compare · {len(candidates)} candidates", tags) as run_:
        out = outputs / "compare" / run_.run_id
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.md").write_text(markdown(cmp, title))
        (out / "compare.html").write_text(html_page(cmp, title))
        (out / "compare.json").write_text(json.dumps(as_json(cmp), indent=2))
        plot(cmp, out / "compare.png", title)
        run_.log_artifacts(out, "compare")
        run_.log_metrics(
            {"compare/candidates": len(candidates), "compare/frontier": sum(c.frontier for c in candidates)}
        )
    return CompareResult(run_.run_id, out, cmp)


@dataclass
class CompareResult:
    run_id: str  # the summary run
    outputs: Path
    comparison: Comparison

    def summary(self) -> dict:
        return {"run_id": self.run_id, "outputs": str(self.outputs), **as_json(self.comparison)}

    def text(self) -> str:
        return terminal(self.comparison) + f"\nwritten: {self.outputs}/compare.{{md,html,png,json}}"
