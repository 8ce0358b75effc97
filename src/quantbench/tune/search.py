"""The budget search of a tune: its allocation problem (over bits, or over predicted decode time)
and `Search`, which measures candidates and keeps the interval between the largest failing and the
smallest passing one until the runs are spent or the interval holds no other allocation."""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

from quantbench.recipe import LoadedRecipe
from quantbench.release import gate
from quantbench.tracking import TAG, Tracker
from quantbench.tune import allocate, cost, sensitivity
from quantbench.tune.candidates import Candidate, write_recipe
from quantbench.tune.frontier import answer
from quantbench.tune.plan import Plan
from quantbench.tune.quantize_jobs import QuantizeJob, run_quantize_jobs
from quantbench.tune.state import write_state

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
