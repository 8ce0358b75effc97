"""`quantbench compare --runs` on stack runs (`quantbench stack`): their speedup ledgers side by
side, step by step, written as Markdown and JSON and logged to a summary run. release/compare.py
hands the runs here when they are stack runs."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from quantbench.core.errors import UserError
from quantbench.tracking import TAG, Tracker


def given_runs(tracker: Tracker, run_ids: list[str] | None) -> tuple[list, list[str]]:
    """The runs --runs names, and a problem for each the store does not have (compare's candidates
    are found so too)."""
    runs, problems = [], []
    for run_id in run_ids or []:
        try:
            runs.append(tracker.get(run_id, "--runs"))
        except UserError as exc:
            problems += exc.problems
    return runs, problems


@dataclass
class Stack:
    run_id: str
    name: str  # the stack file's name
    report: dict  # its ledger (stack.json)


def collect_stacks(tracker: Tracker, run_ids: list[str] | None) -> list[Stack] | None:
    """The stack runs named by --runs with their ledgers; None when none of them is a stack run.
    Stacks and candidates are not mixed (a ledger has no single quality or speed), and a stack that
    did not finish is refused."""
    if not run_ids:
        return None
    found, problems = given_runs(tracker, run_ids)
    if not any(r.data.tags.get(TAG + "role") == "stack" for r in found):
        return None  # candidates: collect() reports the rest
    stacks = []
    for r in found:
        role, status = r.data.tags.get(TAG + "role"), r.info.status
        if role != "stack":
            problems.append(
                f"--runs: '{r.info.run_id}' is a {role or 'non-quantbench'} run; stacks are compared with stacks"
            )
        elif status != "FINISHED":
            problems.append(f"--runs: stack run '{r.info.run_id}' is {status}, not FINISHED; its ledger is partial")
        else:
            stacks.append(r)
    if problems:
        raise UserError(problems)
    out = []
    with tempfile.TemporaryDirectory(prefix="quantbench-stacks-") as tmp:
        for r in stacks:
            path = Path(tracker.client.download_artifacts(r.info.run_id, "stack.json", tmp))
            out.append(
                Stack(r.info.run_id, r.data.tags.get(TAG + "stack", r.info.run_name), json.loads(path.read_text()))
            )
            path.unlink()
    return out


def stacks_table(stacks: list[Stack]) -> str:
    """One row per step name (in the order the stacks first name them), per stack its throughput,
    step and cumulative multipliers with their intervals and the quality cost; then per stack the
    last step over the first measured directly, the product of its multipliers, its device."""

    def times(value, ci) -> str:
        return f"{value:.2f}×" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "") if value is not None else "—"

    names: list[str] = []
    for st in stacks:
        names += [row["step"] for row in st.report["steps"] if row["step"] not in names]
    label = [f"{st.name} ({st.run_id[:8]})" for st in stacks]
    headers = ["step"]
    for lab in label:
        headers += [f"{lab} tok/s", "× step", "× cumulative", "quality vs base"]
    rows = []
    for name in names:
        row = [name]
        for st in stacks:
            step = next((r for r in st.report["steps"] if r["step"] == name), None)
            if step is None:
                row += ["—"] * 4
                continue
            q = step.get("quality")
            row += [
                f"{step['throughput_tok_s']:.1f}" if "throughput_tok_s" in step else "FAILED",
                times(step.get("multiplier"), step.get("multiplier_ci")),
                times(step.get("cumulative"), step.get("cumulative_ci")),
                f"{q['label']} {q['value']:.4g}" if q else "—",
            ]
        rows.append(row)
    text = tabulate(rows, headers=headers, tablefmt="github")
    for lab, st in zip(label, stacks):
        r = st.report
        direct = f"{r['direct']:.2f}×" if r.get("direct") else "—"
        product = f"{r['product']:.2f}×" if r.get("product") else "—"
        text += (
            f"\n{lab}: last step over the first, measured directly {direct}; product of the step multipliers {product}"
        )
        text += f"; measured on {r.get('device') or 'an unrecorded device'}"
    devices = {st.report.get("device") for st in stacks}
    if len(devices) > 1:
        text += "\nthe stacks were measured on different devices: compare multipliers, not tok/s"
    return text


@dataclass
class StacksResult:
    run_id: str  # the summary run
    outputs: Path
    stacks: list[Stack]
    table: str

    def summary(self) -> dict:
        return {
            "run_id": self.run_id,
            "outputs": str(self.outputs),
            "stacks": [{"run_id": st.run_id, "name": st.name, **st.report} for st in self.stacks],
        }

    def text(self) -> str:
        return self.table + f"\nwritten: {self.outputs}/stacks.{{md,json}}"


def run_stacks(tracker: Tracker, stacks: list[Stack], outputs: Path) -> StacksResult:
    table = stacks_table(stacks)
    tags = {
        TAG + "role": "summary",
        TAG + "compared_runs": ",".join(st.run_id for st in stacks),
        "mlflow.note.content": f"{len(stacks)} speedup ledgers side by side, step by step.",
    }
    with tracker.start_run(f"compare · {len(stacks)} stacks", tags) as run_:
        out = outputs / "compare" / run_.run_id
        out.mkdir(parents=True, exist_ok=True)
        result = StacksResult(run_.run_id, out, stacks, table)
        (out / "stacks.md").write_text(f"# quantbench compare · {len(stacks)} stacks\n\n{table}\n")
        (out / "stacks.json").write_text(json.dumps(result.summary(), indent=2))
        run_.log_artifacts(out, "compare")
        run_.log_metrics({"compare/stacks": len(stacks)})
    return result
