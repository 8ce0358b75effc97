"""`quantbench stack`: the speedup ledger: techniques stacked step by step, each one's multiplier and
quality cost."""

from __future__ import annotations

import argparse
import sys

from quantbench.cli.common import common, print_json, run_stage, verdict_text
from quantbench.jobs.stack import command, ledger
from quantbench.release import verdict


def add_parser(sub) -> None:
    k = sub.add_parser(
        "stack",
        parents=[common("experiment", "outputs", "json")],
        help="the speedup ledger: techniques stacked step by step, each one's multiplier and quality cost",
        description="Measure the steps of stacks/NAME.yaml on the same prompts, interleaved round by round: a naive "
        "start (in-process transformers), then each step adding a technique to everything before it (a serving "
        "engine, a 16-bit dtype, a quantized or distilled model, batching). Prints the ledger: each step's output "
        "throughput, its multiplier over the step before [95% interval], the cumulative multiplier over the start, "
        "and the quality of its model against the base (from the model's own run). A step naming recipe:NAME runs "
        "that recipe first when the experiment has no run of it. One parent MLflow run (stack.json, stack.md, "
        "stack_waterfall.png) with a child run per step. Ends with the verdict of the last step's model (quality, size, "
        "what the policy, default release, says of it). Exit 0 all steps measured, 1 a step failed, 2 bad input "
        "(nothing started). See docs/stack.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  quantbench stack cpu                  stacks/cpu.yaml: hf fp32 -> llama.cpp -> Q4_0 -> "
        "batching\n  quantbench stack cpu --policy release  also: does each step's model pass the policy's quality "
        "checks?\n  quantbench stack cpu --policy release --best   and the fastest subset of the steps that passes\n",
    )
    k.add_argument("stack", help="a stack name (stacks/NAME.yaml) or a path to a .yaml file")
    k.add_argument("--policy", help="hold each step's model to this policy's quality checks (policies/NAME.yaml)")
    k.add_argument(
        "--best",
        action="store_true",
        help="with --policy: also find the fastest subset of the steps (order kept) whose model passes the policy "
        "(predicted from the step multipliers, then measured against the start)",
    )


def run(args) -> int:
    result = run_stage(
        "stack",
        command.run,
        args.stack,
        policy=args.policy,
        best=args.best,
        experiment=args.experiment,
        outputs=args.outputs,
    )
    if result is None:
        return 1
    print(ledger.table(result.report))
    model_run = verdict.stack_model_run(result.run_id, experiment=args.experiment)
    if model_run:  # the quality, size and policy of the model the stack ends with (its speed is the ledger's)
        print(verdict_text(verdict.of_run(model_run, policy=args.policy, experiment=args.experiment)))
    print(f"mlflow run: {result.run_id}")
    if result.failed:
        print(f"failed steps: {', '.join(result.failed)} (their runs hold the error)", file=sys.stderr)
    print_json(args, result.summary())
    return 1 if result.failed else 0
