"""`quantbench evaluate`: score a checkpoint against its base model (ppl, KLD, agreement, tasks, flips)."""

from __future__ import annotations

from quantbench import engines
from quantbench.cli import report
from quantbench.cli.common import common, print_json, run_stage, verdict_json, verdict_text
from quantbench.jobs import existing


def add_parser(sub) -> None:
    e = sub.add_parser(
        "evaluate",
        parents=[common("experiment", "base", "json")],
        help="score a checkpoint against its base model (ppl, KLD, agreement, tasks, flips)",
        description="Score a checkpoint against its base model with a suite (suites/NAME.yaml): perplexity, "
        "KL divergence and top-1 agreement on held-out text, lm-eval tasks, answer flips, recovery. The base "
        "model is scored once per (model, suite) in a baseline run and reused. A run id logs into that run. Ends "
        "with the run's verdict (quality, size, speed where measured, what the release policy would say); every "
        "metric is in the run's log file and --json. "
        'With --json the last line is {"run_id", "checkpoint", "baseline_run", "baseline_reused", "metrics", '
        '"verdict"}.',
    )
    e.add_argument(
        "target",
        help="an MLflow run id (from quantize), a checkpoint directory, or a .gguf file on its own (with --base)",
    )
    e.add_argument("--suite", default=None, help="suites/NAME.yaml (default: default)")
    e.add_argument(
        "--engine",
        choices=engines.scoring(),
        default=None,
        help="also score the suite's lm-eval tasks on the checkpoint served by this engine (lm-eval "
        "local-completions against its server): task_engine/<task>/<metric> and quality/engine_flips_pct "
        "(items whose correctness differs between the engine and transformers)",
    )


def run(args) -> int:
    result = run_stage(
        "evaluate",
        existing.evaluate,
        args.target,
        suite=args.suite,
        base=args.base,
        experiment=args.experiment,
        engine=args.engine,
    )
    if result is None:
        return 1
    if result.engine_tasks is not None:
        print(report.engine_table(result.engine_tasks.metrics, result.evaluation.metrics))
    print(verdict_text(result.verdict))
    reused = " (reused)" if result.evaluation.baseline_reused else " (scored now)"
    print(f"mlflow run: {result.run_id}   baseline run: {result.evaluation.baseline_run}{reused}")
    return print_json(args, result.summary() | verdict_json(result.verdict))
