"""`quantbench quantize`: run a recipe: quantize, save, reload-check, evaluate, bench, track."""

from __future__ import annotations

from quantbench.cli import report
from quantbench.cli.common import common, print_json, run_stage, verdict_json, verdict_text
from quantbench.jobs import pipeline, prepare


def add_parser(sub) -> None:
    q = sub.add_parser(
        "quantize",
        parents=[common("experiment", "outputs", "json")],
        help="run a recipe: quantize, save, reload-check, evaluate, bench, track",
        description="Quantize the recipe's model, save a checkpoint under OUTPUTS/<recipe>/<run id>/, "
        "reload it from disk to check it, run the recipe's evaluate: and bench: sections, and record everything "
        "in one MLflow run. The checkpoint is moved into place only when every stage finished. It ends with the "
        "verdict: the headline quality figures with their 95% intervals, size, speed where measured, and what the "
        "release policy (policies/release.yaml) would say, without registering anything; the same table becomes the "
        "run's description in MLflow. Every metric is in the run's log file and --json. "
        'With --json the last line is {"run_id", "checkpoint", "log", "metrics", "verdict"}.',
    )
    q.add_argument("recipe", help="a recipe name (recipes/NAME.yaml) or a path to a .yaml file")
    q.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe field, e.g. --set calibration.samples=8 (repeatable; VALUE is YAML)",
    )
    q.add_argument(
        "--strict-budget",
        action="store_true",
        help="refuse (exit 2, nothing written) when the produce step's estimate on this machine is over the "
        "recipe's budget_minutes; without it the job says so and goes on",
    )
    q.add_argument(
        "--plan",
        action="store_true",
        help="print the memory and disk each stage would need here (from the model's config and the recipe) and "
        "stop: nothing loaded, nothing written, no MLflow run; exit 2 where the job would not fit, naming the "
        "setting that would make it fit. QUANTBENCH_MEMORY_GIB=N plans for a machine with N GiB",
    )


def run(args) -> int:
    if args.plan:
        found = run_stage(
            "quantize --plan",
            prepare.plan_only,
            args.recipe,
            overrides=tuple(args.overrides),
            outputs=args.outputs,
            experiment=args.experiment,
        )
        if found is None:
            return 1
        return print_json(args, {"fits": True, "plan": found.metrics()})
    result = run_stage(
        "quantize",
        pipeline.quantize,
        args.recipe,
        overrides=tuple(args.overrides),
        outputs=args.outputs,
        experiment=args.experiment,
        strict_budget=args.strict_budget,
    )
    if result is None:
        return 1
    # one screen: the verdict; every metric is in the run's log file and --json
    if result.bench is not None:
        print(report.bench_engine(result.bench))
    print(verdict_text(result.verdict))
    print(f"checkpoint: {result.checkpoint}")
    print(f"mlflow run: {result.run_id}   log: {result.log}")
    return print_json(args, result.summary() | verdict_json(result.verdict))
