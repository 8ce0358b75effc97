"""`quantbench tune --policy NAME`: the smallest checkpoint that passes a policy, by per-layer
mixed precision.

    prepare (plan.py: policy, schemes, template recipe, model shapes, budget: nothing written)
    -> sensitivity (sensitivity.py: stored once per base model, schemes and calibration text)
    -> allocate a scheme per unit under a budget (allocate.py: least predicted KLD)
    -> write the allocation as a real recipe file (candidates.py), run it as a `quantbench quantize`
       child process (quantize_jobs.py: quantize, reload check, evaluate, bench, like any other run)
       under a `quantbench.role=tune` parent run
    -> search the budget (search.py): bisection on the *measured* verdict of the policy's quality checks
    -> gate the answer with the policy (frontier.py chooses it; a pass moves the alias, as
       `quantbench gate` does)

With `--bits` or `--max-size-mb` the budget is given and one candidate is made. Without, the
search starts where the predicted KLD meets the policy's KLD limit (scaled by what the last
candidate measured against its prediction) and keeps the interval between the largest failing
and the smallest passing candidate, cutting it at least a tenth each time, until `--budget-runs`
candidates were measured or the interval holds no other allocation.

Everything a candidate is lives in its recipe file (outputs/tune/<policy>-<tune id>/recipes/),
which `make quantize RECIPE=<path>` re-runs. Re-running the same tune replays the same decisions
and reuses every candidate that already has a FINISHED run (found by recipe sha).
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import asdict
from pathlib import Path

from quantbench.core import tables
from quantbench.core.errors import UserError
from quantbench.core.files import canonical_sha
from quantbench.engines import llamacpp
from quantbench.engines import llamacpp_build as build
from quantbench.jobs import ray_executor
from quantbench.release import gate
from quantbench.sources import data, models
from quantbench.tracking import TAG, Tracker
from quantbench.tune import cost, sensitivity
from quantbench.tune import gguf as gguf_tune
from quantbench.tune.frontier import answer, frontier, plot_frontier, shipped_references
from quantbench.tune.plan import Plan, Request, prepare
from quantbench.tune.search import Search, problem
from quantbench.tune.state import read_state, tune_lock, write_state


def run(request: Request, *, outputs: Path = Path("outputs"), experiment: str | None = None) -> dict:
    plan = prepare(request, outputs, experiment)
    executor = ray_executor.make(request.ray)  # a bad Ray address fails here, before anything is written
    try:
        tracker = Tracker(experiment)
        if request.ray is not None:
            executor.check_store(tracker)
        lock = tune_lock(plan.directory)
        try:
            return _run(plan, tracker, outputs, executor)
        finally:
            lock.close()
    finally:
        executor.close()


def _rounding(plan: Plan, folder: Path):
    """What rounds a llama.cpp tune's K- and I-quants (llama-quantize), and every type when the
    template weighs by an importance matrix (computed here as its candidates compute theirs: on
    the template's calibration windows); None for a vLLM tune."""
    if plan.base_gguf is None or plan.gguf_names is None:
        return None
    plan.directory.mkdir(parents=True, exist_ok=True)
    log_path = plan.directory / "llama-quantize.log"
    tools = build.ensure("a llama.cpp tune")
    imatrix = None
    if getattr(plan.template.recipe.quantize, "imatrix", False):
        cal = plan.template.recipe.calibration
        text = data.load_text(cal.source, field="calibration.source", text_field=cal.text_field, hub_split=cal.split)

        def compute() -> Path:
            windows = data.recipe_windows(plan.tokenizer, text, cal)
            return llamacpp.imatrix(tools, plan.base_gguf, plan.tokenizer, windows, cal.seq_len, folder, log_path)

        described = {"text": data.text_sha(text), "samples": cal.samples, "seq_len": cal.seq_len, "seed": cal.seed}
        imatrix = (canonical_sha(described)[:16], compute)
    return gguf_tune.EngineRounding(tools, plan.base_gguf, plan.gguf_names, folder, log_path, imatrix)


def _run(plan: Plan, tracker: Tracker, outputs: Path, executor) -> dict:
    request = plan.request
    state = read_state(plan.directory)
    # candidates left RUNNING by a tune that died (this tune holds its lock now)
    tracker.fail_orphans({TAG + "tune": plan.tune_id, TAG + "role": "candidate"}, "tune")
    with tempfile.TemporaryDirectory(prefix="quantbench-rounding-") as tmp:
        sens = sensitivity.get(
            tracker,
            plan.base,
            plan.tokenizer,
            request.schemes,
            plan.template.recipe.calibration,
            request.sensitivity,
            _rounding(plan, Path(tmp)),
        )
    costs = _costs(plan, sens)
    run_, resumed = _parent_run(plan, tracker, sens, state.get("parent_run"))
    state = {
        "tune": plan.tune_id,
        "parent_run": run_.run_id,
        "policy": plan.policy.name,
        "candidates": [],
        "status": "",
    }
    write_state(plan.directory, state)
    with run_:
        if not resumed:
            run_.log_params({"tune": _params(plan)})
        search = Search(plan, tracker, sens, run_, tracker.experiment, outputs, state, executor, costs)
        search.budgets()
        search.alternatives()
        best, unmet = answer(search.candidates, request.objective)
        references = shipped_references(tracker, plan.base.fingerprint, gguf=plan.gguf)
        points = frontier(search.candidates, references, plan.policy.name)
        verdict = None
        if best is not None:
            verdict = gate.run(best.run_id, str(plan.policy.path), experiment=tracker.experiment)
        summary = _summary(plan, sens, search.candidates, best, unmet, points, verdict, run_.run_id, resumed, costs)
        _save(plan, run_, summary, points, search.candidates)
        _log_outcome(run_, summary, best, search.candidates)
        state["status"] = "done"
        write_state(plan.directory, state)
    return summary


def _costs(plan: Plan, sens) -> cost.CostTable | None:
    """A latency tune's cost table (None for a size one). The schemes the engine does not serve here
    leave the request; a --latency-ms below what the fastest mix is predicted to take is refused."""
    request = plan.request
    costs = None
    if request.objective == "latency" and plan.gguf:
        costs = cost.get(
            plan.base,
            request.schemes or [],
            sorted(set((plan.gguf_names or {}).values())),
            remeasure=request.remeasure_costs,
        )
    elif request.objective == "latency" and plan.engine is not None:
        costs = cost.get_served(
            plan.engine,
            plan.base,
            request.schemes or [],
            plan.shapes,
            plan.unquantized,
            plan.directory / "cost-table-servers.log",
            remeasure=request.remeasure_costs,
        )
    if costs is not None and costs.unserved:
        # what the engine does not serve here is never proposed (its reasons from the engine interface)
        request.schemes = [s for s in request.schemes or [] if s not in costs.unserved]
        if not request.schemes:
            raise UserError(
                f"--schemes: {plan.engine.label} serves none of them here: "
                + "; ".join(f"{k}: {v}" for k, v in costs.unserved.items())
            )
    if costs is not None:
        fastest, slowest = problem(plan, sens, costs).bounds()
        if request.latency_ms is not None and request.latency_ms < fastest - 1e-9:
            raise UserError(
                f"--latency-ms {request.latency_ms:g}: below {fastest:.2f} ms/token, the fastest any mix of "
                f"{', '.join(request.schemes or [])} is predicted to decode here ({costs.cpu}, {costs.threads} threads; "
                f"the least-KLD mix: {slowest:.2f} ms/token)"
            )
    return costs


def _parent_run(plan: Plan, tracker: Tracker, sens, parent_id: str | None):
    """The tune's parent run: the one a re-run recorded in state.json when it still exists (resumed:
    True), else a new one."""
    resumed = bool(parent_id and tracker.existing(parent_id) is not None)
    tags = {
        TAG + "role": "tune",
        TAG + "tune": plan.tune_id,
        TAG + "tune_policy": plan.policy.name,
        TAG + "base_model": plan.base.source,
        TAG + "base_fingerprint": plan.base.fingerprint,
        TAG + "recipe": plan.template.name,
        TAG + "sensitivity_run": sens.run_id,
        "mlflow.note.content": f"`quantbench tune --policy {plan.policy.name}` from recipe `{plan.template.name}` on "
        f"`{plan.base.source}`: per-layer schemes from {', '.join(plan.request.schemes)}.",
    }
    run_ = (
        tracker.resume_run(parent_id)
        if resumed
        else tracker.start_run(f"tune · {plan.policy.name} · {models.short_name(plan.base.source)}", tags)
    )
    return run_, resumed


def _params(plan: Plan) -> dict:
    """The parent run's `tune.*` parameters: what was asked."""
    request = plan.request
    return {
        "policy": plan.policy.name,
        "template": str(plan.template.path),
        "alternatives": ",".join(str(t.path) for t in plan.alternatives),
        "schemes": ",".join(request.schemes),
        "bits": request.bits,
        "max_size_mb": request.max_size_mb,
        "objective": request.objective,
        "latency_ms": request.latency_ms,
        "budget_runs": request.budget_runs,
        "parallel": request.parallel,
        "sensitivity": request.sensitivity.method,
    }


def _save(plan: Plan, run_, summary: dict, points, candidates) -> None:
    """The tune's outputs (tune.json, tune.txt, the frontier's plot) written to its directory and
    logged to the parent run with every candidate's recipe."""
    out = plan.directory
    plot_frontier(
        points,
        out / "frontier.png",
        f"tune {plan.policy.name} · {models.short_name(plan.base.source)}: size vs KLD",
    )
    (out / "tune.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "tune.txt").write_text(text(summary) + "\n")
    run_.log_artifact(out / "tune.json", "tune")
    run_.log_artifact(out / "tune.txt", "tune")
    run_.log_artifact(out / "frontier.png", "tune")
    for c in candidates:
        run_.log_artifact(Path(c.recipe), "tune/recipes")


def _log_outcome(run_, summary: dict, best, candidates) -> None:
    """The answer on the parent run: its tags (best run, passed, the candidates' runs) and metrics."""
    run_.set_tags(
        {
            TAG + "tune_best_run": best.run_id if best else "",
            TAG + "tune_passed": str(summary["passed"]).lower(),
            TAG + "tune_runs": ",".join(c.run_id for c in candidates if c.run_id),
        }
    )
    final = {"tune/candidates": len(candidates), "tune/passed_final": float(summary["passed"])}
    if best is not None:
        final.update(
            {
                "tune/best_size_mb": best.metrics.get("model/size_mb", math.nan),
                "tune/best_kld": best.metrics.get("quality/kld_mean", math.nan),
                "tune/best_bits_per_weight": best.metrics.get("model/bits_per_weight", math.nan),
            }
        )
    run_.log_metrics({k: v for k, v in final.items() if not (isinstance(v, float) and math.isnan(v))})


def _summary(plan, sens, candidates, best, unmet, points, verdict, parent, resumed, costs=None) -> dict:
    return {
        "parent_run": parent,
        "tune": plan.tune_id,
        "policy": plan.policy.name,
        "objective": plan.request.objective,
        "cost_table": (
            {
                "path": str(cost.path(costs.key)),
                "engine": costs.engine,
                "cpu": costs.cpu,
                "threads": costs.threads,
                "reference": costs.reference,
                "ms": costs.ms,
                "unserved": costs.unserved,
            }
            if costs is not None
            else None
        ),
        "resumed": resumed,
        "best_run": best.run_id if best else None,
        "recipe": best.recipe if best else None,
        "passed": bool(verdict and verdict["passed"]),
        "registered": verdict["registered"] if verdict else None,
        "unmet_checks": unmet,
        "failed_checks": [c for c in (verdict or {}).get("checks", []) if not c["passed"]],
        "sensitivity_run": sens.run_id,
        "sensitivity_reused": sens.reused,
        "frontier": points,
        "candidates": [
            {k: v for k, v in asdict(c).items() if k != "checks"}
            | {"failed_checks": [x["check"] for x in c.failed_checks()]}
            for c in candidates
        ],
        "directory": str(plan.directory),
    }


def text(summary: dict) -> str:
    """What `quantbench tune` prints: the candidates, the frontier, the answer."""
    body = []
    for i, c in enumerate(summary["candidates"], 1):
        m = c["metrics"]
        cell = lambda k, f: format(m[k], f) if k in m else "—"  # noqa: E731
        verdict = (
            "pass" if c["passed"] else ("fails " + ", ".join(c["failed_checks"]) if c["failed_checks"] else c["reason"])
        )
        body.append(
            [
                str(i),
                c["name"],
                c["status"],
                cell("model/bits_per_weight", ".3f"),
                cell("model/size_mb", ".1f"),
                f"{c['predicted_kld']:.4f}",
                cell("quality/kld_mean", ".4f"),
                cell("speedup/decode_tok_s", ".2f"),
                verdict,
            ]
        )
    headers = ["#", "candidate", "status", "bits/w", "MiB", "KLD pred", "KLD", "decode x", "verdict"]
    rows = [tables.table(headers, body, "rllrrrrrl")]
    timed = [(i, c) for i, c in enumerate(summary["candidates"], 1) if c.get("predicted_ms") is not None]
    if timed:
        rows.append(
            "decode time per token, predicted from the cost table (measured through the bench's engine): "
            + "; ".join(
                f"#{i} {c['predicted_ms']:.2f} ms"
                + (
                    f" ({1000 / c['metrics']['speed/decode_tok_s']:.2f})"
                    if c["metrics"].get("speed/decode_tok_s")
                    else ""
                )
                for i, c in timed
            )
        )
    shipped = [p for p in summary["frontier"] if p["kind"] == "shipped"]
    if shipped:
        rows.append(
            "shipped uniform recipes (reference): "
            + "; ".join(f"{p['name']} {p['size_mb']:.1f} MiB KLD {p['kld']:.4f}" for p in shipped)
        )
    if summary["best_run"] is None:
        rows.append("no candidate was measured")
    elif summary["passed"]:
        rows.append(
            f"PASS: {summary['best_run']} ({summary['recipe']}) passes {summary['policy']}"
            + (
                f"; registered {summary['registered']['model']} v{summary['registered']['version']} -> "
                f"alias '{summary['registered']['alias']}'"
                if summary.get("registered")
                else ""
            )
        )
    else:
        rows.append(
            f"no candidate passes {summary['policy']}; best: {summary['best_run']} ({summary['recipe']}), which "
            f"still fails: {', '.join(c['check'] for c in summary['failed_checks'])}"
        )
        for u in summary["unmet_checks"]:
            closest = u["closest"]
            got = f"closest {closest['value']:.4g} ({closest['name']})" if closest else "never measured"
            rows.append(f"  no candidate met {u['check']} {u['threshold']}: {got}")
    rows.append(
        f"parent run: {summary['parent_run']}   sensitivity run: {summary['sensitivity_run']}"
        f"{' (reused)' if summary['sensitivity_reused'] else ''}   outputs: {summary['directory']}"
    )
    return "\n".join(rows)
