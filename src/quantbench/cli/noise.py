"""`quantbench noise`: the noise floor of every metric: the base model against itself (and a recipe at
two seeds)."""

from __future__ import annotations

from quantbench import engines
from quantbench.cli import report
from quantbench.cli.common import common, print_json, renamed, run_stage
from quantbench.jobs import noise


def add_parser(sub) -> None:
    n = sub.add_parser(
        "noise",
        parents=[common("experiment", "outputs", "json")],
        help="the noise floor of every metric: the base model against itself (and a recipe at two seeds)",
        description="Save the base model again in its own dtype and score it against itself as a candidate is "
        "scored: evaluate (suite) and bench (profile), with intervals. What this shows is what measuring the same "
        "model twice gives. With --recipe R (a calibrated recipe) R is also quantized at its calibration seed and "
        "the next one, and |difference| of every quality metric is logged as noise_seed/<metric>. The result is a "
        "run tagged quantbench.role=noise; `compare` shows it as a row and a band. "
        'With --json the last line is {"run_id", "recipe_runs", "metrics"}.',
    )
    n.add_argument("model", help="the base model source (builtin:NAME, a checkpoint dir, a .gguf, run:ID, recipe:NAME)")
    n.add_argument("--suite", default=None, help="suites/NAME.yaml (default: default)")
    n.add_argument("--profile", default=None, help="profiles/NAME.yaml for the bench (default: cpu-smoke)")
    n.add_argument("--no-bench", action="store_true", help="skip the speed part")
    engine = n.add_argument(
        "--engine",
        default="auto",
        choices=[b for b in engines.engine_choices() if b not in ("openai", "serve")],
        help="the engine the speed part measures through, as for bench (default auto: vLLM where it "
        "serves the model, else transformers serve, else hf)",
    )
    n.add_argument("--recipe", default=None, help="a calibrated recipe to run at two calibration seeds as well")
    renamed(n, "--backend", engine)


def run(args) -> int:
    result = run_stage(
        "noise",
        noise.run,
        args.model,
        suite=args.suite,
        profile=args.profile,
        bench=not args.no_bench,
        engine=args.engine,
        recipe=args.recipe,
        experiment=args.experiment,
        outputs=args.outputs,
    )
    if result is None:
        return 1
    speed = ("speed/", "base_speed/", "speedup/", "model/", "noise_seed/")
    print(
        report.evaluation_table(
            {k: v for k, v in result.metrics.items() if not k.startswith(speed)}, result.baseline_metrics, result.notes
        )
    )
    if any(k.startswith("speedup/") for k in result.metrics):
        print(report.bench_table(result.metrics))
    spread = {k: v for k, v in result.metrics.items() if k.startswith("noise_seed/")}
    if spread:
        seeds = ", ".join(f"seed {r['seed']}: run {r['run_id']}" for r in result.recipe_runs)
        print(f"calibration seed to seed (|difference|; {seeds}):")
        print(report.metric_lines(spread))
    print(f"noise run: {result.run_id}")
    return print_json(args, result.summary())
