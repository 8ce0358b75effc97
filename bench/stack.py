"""The speedup ledger's goals, measured: `quantbench stack` on a stack file (default stacks/cpu.yaml),
then the figures the goals are about, from the ledger that run logged.

Every multiplier is a ratio against a baseline measured in the same run (the stack's first step,
in the same interleaved rounds). Prints per step its multiplier [95 % interval], the cumulative one
and the quality cost so far; then:
- the cumulative output throughput of the last step over the naive start (goal >= 30x on a
  2-core CPU for stacks/cpu.yaml);
- the product of the step multipliers against that directly measured ratio (goal: within 10 %);
- with --policy (default release) and --best: the fastest stack that passes, and its multiplier;
- whether every step that changes the model has a quality figure with its interval.
Says the CPU class: the multipliers depend on it. Its last line is a JSON object.

The recipes a stack names are run first when the experiment has no run of them (the default
stack's distillation is the longest: ~30 min on an AVX2-only 2-core CPU); use --experiment to keep
them between runs of this benchmark.

    python bench/stack.py [--stack cpu] [--policy release] [--experiment stack-bench] [--goal 30]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stack", default="cpu", help="a stack name (stacks/NAME.yaml) or a .yaml path")
    parser.add_argument("--policy", default="release", help="the policy --best holds each subset's model to")
    parser.add_argument("--experiment", default="stack-bench", help="the MLflow experiment (recipe runs are reused)")
    parser.add_argument("--goal", type=float, default=30.0, help="the cumulative multiplier the last step should reach")
    parser.add_argument("--outputs", default="outputs", help="where recipes the stack runs write their checkpoints")
    args = parser.parse_args()

    from quantbench.core import hardware
    from quantbench.core.logs import configure_console
    from quantbench.jobs.stack import command, ledger

    configure_console()
    outcome = command.run(
        args.stack, policy=args.policy, best=True, experiment=args.experiment, outputs=Path(args.outputs)
    )
    report = outcome.report
    print(ledger.table(report))
    rows = report["steps"]
    measured = [r for r in rows if "cumulative" in r]
    direct, product = report.get("direct"), report.get("product")
    gap = abs(product / direct - 1) if direct and product else None
    changes_model = [r for before, r in zip(rows, rows[1:]) if r["model"] != before["model"]]
    without_quality = [r["step"] for r in changes_model if not (r.get("quality") and r["quality"].get("ci"))]
    best = report.get("best") or {}
    last = measured[-1] if measured else {}
    print()
    print(f"device: {hardware.device_line()}")
    if direct:
        print(f"last step ({last['step']}) over the naive start, measured directly: {direct:.2f}x "
              f"{_interval(last.get('cumulative_ci'))} (goal >= {args.goal:g}x: {'met' if direct >= args.goal else 'NOT met'})")  # fmt: skip
    if gap is not None:
        print(f"product of the step multipliers {product:.2f}x vs direct {direct:.2f}x: {gap * 100:.1f} % apart "
              f"(goal <= 10 %: {'met' if gap <= 0.10 else 'NOT met'})")  # fmt: skip
    if "cumulative" in best:
        print(f"fastest stack passing {args.policy}: {' -> '.join(best['steps'])}: {best['cumulative']:.2f}x "
              f"{_interval(best.get('cumulative_ci'))}")  # fmt: skip
    else:
        print(f"fastest stack passing {args.policy}: {'none passes' if not best else best.get('error')}")
    print("every model-changing step has quality with an interval: "
          + ("yes" if not without_quality else f"NO ({', '.join(without_quality)})"))  # fmt: skip
    summary = {
        "stack": report.get("stack"),
        "run_id": outcome.run_id,
        "device": hardware.device_line(),
        "steps": [
            {
                k: r.get(k)
                for k in (
                    "step",
                    "adds",
                    "throughput_tok_s",
                    "multiplier",
                    "multiplier_ci",
                    "cumulative",
                    "cumulative_ci",
                    "spec_acceptance",
                    "quality",
                    "policy_passed",
                )
            }
            for r in rows
        ],  # fmt: skip
        "direct": direct,
        "product": product,
        "product_vs_direct_gap": gap,
        "goal": args.goal,
        "goal_met": bool(direct and direct >= args.goal),
        "best": best or None,
        "steps_without_quality_interval": without_quality,
        "failed": outcome.failed,
    }
    print(json.dumps(summary, default=str))


def _interval(ci) -> str:
    return f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""


if __name__ == "__main__":
    main()
