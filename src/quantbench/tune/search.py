"""`quantbench tune --policy NAME`: the smallest checkpoint that passes a policy, by per-layer
mixed precision.

    prepare (policy, schemes, template recipe, model shapes, budget: nothing written)
    -> sensitivity (sensitivity.py: stored once per base model, schemes and calibration text)
    -> allocate a scheme per unit under a budget (allocate.py: least predicted KLD)
    -> write the allocation as a real recipe file, run it as a `quantbench quantize` child process
       (quantize, reload check, evaluate, bench, like any other run) under a `quantbench.role=tune`
       parent run
    -> search the budget: bisection on the *measured* verdict of the policy's quality checks
    -> gate the answer with the policy (a pass moves the alias, as `quantbench gate` does)

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
import tempfile
import logging
import math
from dataclasses import asdict
from pathlib import Path


from quantbench.core import tables
from quantbench.core.errors import UserError
from quantbench.core.files import canonical_sha
from quantbench.recipe import (
    LoadedRecipe,
)
from quantbench.release import gate
from quantbench.sources import models
from quantbench.tracking import TAG, Tracker
from quantbench.tune import allocate, cost, sensitivity
from quantbench.tune.candidates import Candidate, write_recipe
from quantbench.tune.frontier import answer, frontier, plot_frontier, shipped_references
from quantbench.tune.plan import Plan, Request, prepare
from quantbench.tune.quantize_jobs import QuantizeJob, run_quantize_jobs
from quantbench.tune.state import read_state, tune_lock, write_state

log = logging.getLogger(__name__)

TOLERANCE_BITS = 0.05  # the search stops when passing and failing candidates are this close (bits per weight)
TOLERANCE_MS = 0.01  # ... or, searching on predicted decode time, this close as a share of it
# Checks more bits cannot fix: the search bisects on the others (quality), the answer reports all.
NOT_QUALITY = ("run status", "licence", "checkpoint on disk")


def problem(plan: Plan, sens: sensitivity.Sensitivity, costs: cost.CostTable | None = None) -> allocate.Problem:
    """The allocation problem of a tune: over bits, or with `costs` (a latency tune) over predicted
    decode ms/token."""
    p = allocate.problem(sens, plan.request.schemes or [], plan.dtype_bits, plan.fixed_bytes, plan.unquantized)
    if costs is not None:
        p.base_ms = costs.ms[costs.reference]
        p.unit_ms = [
            {name: unit.params * costs.per_weight(name) for name, _, _ in opts}
            for unit, opts in zip(sens.units, p.options)
        ]
    return p


class Search:
    def __init__(
        self,
        plan: Plan,
        tracker: Tracker,
        sens: sensitivity.Sensitivity,
        parent,
        experiment: str,
        outputs: Path,
        state: dict,
        executor,
        costs: cost.CostTable | None = None,
    ):
        self.plan, self.tracker, self.sens, self.parent, self.executor = plan, tracker, sens, parent, executor
        self.experiment, self.outputs, self.state = experiment, outputs, state
        self.problem = problem(plan, sens, costs)
        self.candidates: list[Candidate] = []
        self.allocations: dict[str, allocate.Allocation] = {}  # recipe sha -> allocation

    def _spent(self, alloc: allocate.Allocation) -> float:
        """What an allocation spends of the searched budget: bits, or predicted decode ms."""
        return alloc.predicted_ms if alloc.predicted_ms is not None else alloc.bits

    def _close(self, lo: float, hi: float, share: float = 1.0) -> bool:
        """Whether a budget interval is too narrow to cut again (`share` of the tolerance)."""
        if self.problem.by_ms:
            return hi - lo < share * TOLERANCE_MS * hi
        return (hi - lo) / self.problem.total_params < share * TOLERANCE_BITS

    def _describe(self, budget: float) -> str:
        if self.problem.by_ms:
            return f"{budget:.2f} ms/token"
        return f"{budget / self.problem.total_params:.3f} bits/weight"

    def budgets(self) -> None:
        request = self.plan.request
        if request.latency_ms is not None:
            self.measure(allocate.solve(self.problem, request.latency_ms), request.latency_ms)
            return
        if request.bits is not None:
            self.measure(allocate.for_bits(self.problem, request.bits), request.bits * self.problem.total_params)
            return
        if request.max_size_mb is not None:
            self.measure(
                allocate.for_size(self.problem, request.max_size_mb), self.problem.bits_for_size(request.max_size_mb)
            )
            return
        cheapest, best = self.problem.bounds()
        lo, hi = cheapest, best  # bits (or ms): lo fails (assumed until measured), hi passes (assumed)
        lo_measured = hi_measured = False
        # the policy's KLD limit: a number, or a bound on one end of the interval (`{value, on}`)
        bound = self.plan.policy.policy.max.get("quality/kld_mean")
        limit = bound.value if isinstance(bound, gate.Bound) else bound
        used = 0
        while used < request.budget_runs:
            # a round: the model's pick, and with --parallel N, N - 1 more around it
            targets = self._targets(
                min(request.parallel, request.budget_runs - used), limit, lo, hi, lo_measured, hi_measured
            )
            wanted: list[tuple[allocate.Allocation, float]] = []
            for target in targets:
                alloc = allocate.solve(self.problem, target)
                if any(_same(alloc, c) for c in self.candidates) or any(
                    f"{alloc.bits_per_weight:.3f}" == f"{a.bits_per_weight:.3f}" for a, _ in wanted
                ):
                    continue  # measured already, or a batch-mate (and its recipe name) at the same bits
                wanted.append((alloc, target))
            if not wanted:
                log.info(
                    "tune: the allocation%s at %s %s measured already; the search has converged",
                    "s" if len(targets) > 1 else "",
                    ", ".join(self._describe(t) for t in targets),
                    "were" if len(targets) > 1 else "was",
                )
                break
            measured = self.measure_many([(alloc, target, None) for alloc, target in wanted])
            used += len(measured)
            if any(c.status == "failed" for c in measured):
                break
            spent = [(self._spent(alloc), cand) for (alloc, _), cand in zip(wanted, measured)]
            passing = [x for x, c in spent if c.quality_passed]
            if passing:
                hi, hi_measured = min(passing), True
            failing = [x for x, c in spent if not c.quality_passed and x < hi]
            if failing and max(failing) > lo:
                lo, lo_measured = max(failing), True
            if not passing and max(x for x, _ in spent) >= best - 1e-6:
                log.info(
                    "tune: even the allocation with the least predicted KLD fails the policy's quality checks; "
                    "more bits cannot help with these schemes"
                )
                break
            if hi_measured and self._close(lo, hi):
                break

    def _targets(self, k: int, limit, lo, hi, lo_measured, hi_measured) -> list[float]:
        """The next round's budgets inside (lo, hi): the model's pick (`_target`) and, for k > 1,
        k - 1 more around it, below and above in turn, (hi - lo) / 2k apart (the pick's error is
        unknown until measured), kept inside the interval."""
        pick = self._target(limit, lo, hi, lo_measured, hi_measured)
        step = (hi - lo) / (2 * k)
        points = [pick]
        for j in range(1, 2 * k):
            if len(points) == k:
                break
            offset = step * ((j + 1) // 2) * (-1 if j % 2 else 1)
            if lo < pick + offset < hi:
                points.append(pick + offset)
        return sorted(points)

    def _target(self, limit, lo, hi, lo_measured, hi_measured) -> float:
        """The next budget (total bits) inside (lo, hi): where the predicted KLD, scaled by what the
        nearest candidate measured against its prediction, meets the policy's limit; the plain
        midpoint when the policy has no KLD limit or KLD was not what failed."""
        done = [c for c in self.candidates if c.status in ("finished", "reused") and "quality/kld_mean" in c.metrics]
        pivot = None
        if limit is not None:
            scale = 1.0
            if done:
                near = min(done, key=lambda c: abs(c.budget_bits - (lo + hi) / 2))
                scale = near.metrics["quality/kld_mean"] / max(near.predicted_kld, 1e-12)
                if not done[-1].quality_passed and done[-1].metrics["quality/kld_mean"] <= limit:
                    scale = None  # KLD passed but another quality check failed: bisect
            if scale is not None:
                pivot = self._budget_for(limit / scale, lo, hi)
        if pivot is None:
            pivot = (lo + hi) / 2
        if not lo_measured and not hi_measured:
            return pivot
        margin = 0.1 * (hi - lo)
        return min(max(pivot, lo + margin), hi - margin)

    def _budget_for(self, predicted: float, lo: float, hi: float) -> float:
        """The smallest budget in [lo, hi] whose allocation's predicted KLD is at most `predicted`."""
        if allocate.solve(self.problem, hi).predicted_kld > predicted:
            return hi
        a, b = lo, hi
        for _ in range(30):
            mid = (a + b) / 2
            if allocate.solve(self.problem, mid, resolution=1000).predicted_kld <= predicted:
                b = mid
            else:
                a = mid
            if self._close(a, b, share=0.1):
                break
        return b

    def alternatives(self) -> None:
        """The answer's allocation made with each other template (method), measured the same way."""
        if not self.plan.alternatives:
            return
        chosen, _ = answer(self.candidates, self.plan.request.objective)
        if chosen is None:
            return
        alloc = self.allocations[chosen.sha]
        for template in self.plan.alternatives:
            log.info(
                "tune: the chosen allocation (%.3f bits/weight) with %s (method %s)",
                alloc.bits_per_weight,
                template.name,
                template.recipe.quantize.method,
            )
        self.measure_many([(alloc, chosen.budget_bits, template) for template in self.plan.alternatives])

    def measure(
        self, alloc: allocate.Allocation, budget_bits: float, template: LoadedRecipe | None = None
    ) -> Candidate:
        return self.measure_many([(alloc, budget_bits, template)])[0]

    def measure_many(self, wanted: list[tuple[allocate.Allocation, float, LoadedRecipe | None]]) -> list[Candidate]:
        """Each allocation (with its budget and template) written as a recipe and measured: reused
        where a run of the same recipe exists, the rest quantized, evaluated and benched as child
        runs, up to --parallel at once; then held to the policy."""
        batch: list[tuple[int, Candidate, allocate.Allocation]] = []
        jobs: list[tuple[QuantizeJob, int, Candidate]] = []
        for alloc, budget_bits, template in wanted:
            path, name, sha = write_recipe(self.plan, alloc, self.sens.units, self.parent.run_id, template)
            self.allocations[sha] = alloc
            cand = Candidate(
                name,
                str(path),
                sha,
                budget_bits,
                alloc.predicted_kld,
                alloc.size_mb,
                alloc.bits_per_weight,
                alloc.counts(),
                alloc.predicted_ms,
            )
            self.candidates.append(cand)
            step = len(self.candidates)
            batch.append((step, cand, alloc))
            done = self.tracker.find_runs({TAG + "recipe_sha": sha})
            if done:
                cand.run_id, cand.status = done[0], "reused"
                log.info("tune [%d] %s: measured before (run %s)", step, name, done[0])
                continue
            log.info(
                "tune [%d] %s: predicted KLD %.4g, %.3f bits/weight, %.1f MiB%s -> quantize, evaluate, bench",
                step,
                name,
                alloc.predicted_kld,
                alloc.bits_per_weight,
                alloc.size_mb,
                f", {alloc.predicted_ms:.2f} ms/token decode" if alloc.predicted_ms is not None else "",
            )
            job = QuantizeJob(
                name,
                path,
                self.plan.directory / "logs" / f"{name}.log",
                {TAG + "tune": self.plan.tune_id, TAG + "tune_policy": self.plan.policy.name},
            )
            jobs.append((job, step, cand))
        if jobs:
            self._save(status="running " + ", ".join(job.name for job, _, _ in jobs))
            outcomes = run_quantize_jobs(
                [job for job, _, _ in jobs],
                executor=self.executor,
                tracker=self.tracker,
                outputs=self.outputs,
                parent=self.parent.run_id,
                concurrency=self.plan.request.parallel,
            )
            for outcome, (job, step, cand) in zip(outcomes, jobs):
                cand.wall_s = outcome.wall_s
                if outcome.result is None:
                    cand.status, cand.reason = "failed", outcome.reason
                    log.warning("tune [%d] %s failed: %s (log %s)", step, cand.name, outcome.reason, job.log)
                else:
                    cand.run_id, cand.status = outcome.result["run_id"], "finished"
        for step, cand, alloc in batch:
            if cand.status != "failed":
                self._held_to_policy(step, cand, alloc)
        self._save()
        return [cand for _, cand, _ in batch]

    def _held_to_policy(self, step: int, cand: Candidate, alloc: allocate.Allocation) -> None:
        """A measured candidate's checks against the policy; its predictions logged to its run, the
        tune's step metrics to the parent run."""
        run = self.tracker.existing(cand.run_id)
        info, data = run.info, run.data
        cand.metrics = dict(data.metrics)
        try:
            checks = gate.evaluate_policy(self.plan.policy.policy, info.status, dict(data.tags), cand.metrics)
        except gate.MissingInterval as exc:  # e.g. a task scored on too few items for an interval
            key = str(exc)
            why = "logged without the interval the policy holds to its limit"
            checks = [gate.Check(key, cand.metrics.get(key), "an interval's end", False, why)]
        cand.checks = [asdict(c) for c in checks]
        cand.passed = all(c.passed for c in checks)
        cand.quality_passed = all(c.passed for c in checks if not _beyond_bits(c.check))
        predicted = {"tune/predicted_kld": alloc.predicted_kld, "tune/predicted_size_mb": alloc.size_mb}
        if alloc.predicted_ms is not None:
            predicted["tune/predicted_decode_ms"] = alloc.predicted_ms
        run.log_metrics(predicted)
        measured = cand.metrics.get("quality/kld_mean")
        decode = cand.metrics.get("speed/decode_tok_s")
        self.parent.log_metrics(
            {
                k: v
                for k, v in {
                    "tune/predicted_kld": alloc.predicted_kld,
                    "tune/measured_kld": measured,
                    "tune/bits_per_weight": cand.metrics.get("model/bits_per_weight"),
                    "tune/size_mb": cand.metrics.get("model/size_mb"),
                    "tune/passed": float(cand.passed),
                    "tune/predicted_decode_ms": alloc.predicted_ms,
                    "tune/decode_ms": 1000.0 / decode if decode else None,
                }.items()
                if v is not None
            },
            step=step,
        )
        log.info(
            "tune [%d] %s: measured KLD %s (predicted %.4g), %s MiB: %s",
            step,
            cand.name,
            f"{measured:.4g}" if measured is not None else "—",
            alloc.predicted_kld,
            f"{cand.metrics.get('model/size_mb', float('nan')):.1f}",
            "PASS" if cand.passed else "fails " + ", ".join(c["check"] for c in cand.failed_checks()),
        )

    def _save(self, status: str = "") -> None:
        self.state["candidates"] = [asdict(c) for c in self.candidates]
        self.state["status"] = status
        write_state(self.plan.directory, self.state)


def _beyond_bits(check: str) -> bool:
    """A check more bits cannot fix (speed, licence, ...): not what the budget search bisects on."""
    if check in NOT_QUALITY or check.startswith("stage "):
        return True
    name = check.removeprefix("recovery/")
    return name.startswith(("speed/", "speedup/", "base_speed/")) or check.startswith("speedup/")


def _same(alloc: allocate.Allocation, cand: Candidate) -> bool:
    return (
        abs(alloc.bits_per_weight - cand.bits_per_weight) < 1e-9
        and abs(alloc.predicted_kld - cand.predicted_kld) < 1e-12
    )


def run(request: Request, *, outputs: Path = Path("outputs"), experiment: str | None = None) -> dict:
    from quantbench.jobs import ray_executor

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
    from quantbench.engines import llamacpp
    from quantbench.engines import llamacpp_build as build
    from quantbench.sources import data
    from quantbench.tune import gguf as gguf_tune

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
    costs = None
    if request.objective == "latency" and plan.gguf:
        costs = cost.get(
            plan.base,
            request.schemes or [],
            sorted(set((plan.gguf_names or {}).values())),
            remeasure=request.remeasure_costs,
        )
    elif request.objective == "latency":
        costs = cost.get_vllm(
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
                "--schemes: vLLM serves none of them here: " + "; ".join(f"{k}: {v}" for k, v in costs.unserved.items())
            )
    if costs is not None:
        fastest, slowest = problem(plan, sens, costs).bounds()
        if request.latency_ms is not None and request.latency_ms < fastest - 1e-9:
            raise UserError(
                f"--latency-ms {request.latency_ms:g}: below {fastest:.2f} ms/token, the fastest any mix of "
                f"{', '.join(request.schemes or [])} is predicted to decode here ({costs.cpu}, {costs.threads} threads; "
                f"the least-KLD mix: {slowest:.2f} ms/token)"
            )
    parent_id = state.get("parent_run")
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
        f"`{plan.base.source}`: per-layer schemes from {', '.join(request.schemes)}.",
    }
    run_ = (
        tracker.resume_run(parent_id)
        if resumed
        else tracker.start_run(f"tune · {plan.policy.name} · {models.short_name(plan.base.source)}", tags)
    )
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
            run_.log_params(
                {
                    "tune": {
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
                }
            )
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
        for c in search.candidates:
            run_.log_artifact(Path(c.recipe), "tune/recipes")
        run_.set_tags(
            {
                TAG + "tune_best_run": best.run_id if best else "",
                TAG + "tune_passed": str(summary["passed"]).lower(),
                TAG + "tune_runs": ",".join(c.run_id for c in search.candidates if c.run_id),
            }
        )
        final = {"tune/candidates": len(search.candidates), "tune/passed_final": float(summary["passed"])}
        if best is not None:
            final.update(
                {
                    "tune/best_size_mb": best.metrics.get("model/size_mb", math.nan),
                    "tune/best_kld": best.metrics.get("quality/kld_mean", math.nan),
                    "tune/best_bits_per_weight": best.metrics.get("model/bits_per_weight", math.nan),
                }
            )
        run_.log_metrics({k: v for k, v in final.items() if not (isinstance(v, float) and math.isnan(v))})
        state["status"] = "done"
        write_state(plan.directory, state)
    return summary


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
