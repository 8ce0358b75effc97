"""The `quantbench` command: one subcommand per verb, argument parsing only."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from quantbench.errors import UserError

log = logging.getLogger("quantbench")

EPILOG = """\
examples:
  quantbench quantize awq-int4                      recipes/awq-int4.yaml on the embedded default model
  quantbench quantize gptq-w4a16 --set calibration.samples=8 --json
  quantbench evaluate <run id | checkpoint dir>     quality against the base model (suites/default.yaml)
  quantbench bench <run id | checkpoint dir>        speed against the base model (profiles/cpu-smoke.yaml)
  quantbench compare                                all candidates, Pareto frontier (quality vs speed)
  quantbench gate <run id> --policy release         pass/fail; a pass moves the registry alias 'champion'
  quantbench sweep cpu-grid                         many jobs (sweeps/cpu-grid.yaml): resumable, timeouts, retries
  quantbench validate recipes/*.yaml                check recipes (every error at once)
  quantbench recipes                                list the shipped recipes
  quantbench ui                                     MLflow UI on http://127.0.0.1:5000

exit codes: 0 ok, 1 the job failed (see its log) or the gate failed, 2 bad input (nothing was written)
tracking: MLFLOW_TRACKING_URI (default sqlite:///mlflow.db here, artifacts in ./mlruns)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quantbench",
        description="Quantize models from recipe files, check the checkpoints, track everything in MLflow.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    q = sub.add_parser(
        "quantize",
        help="run a recipe: quantize, save, reload-check, track",
        description="Quantize the recipe's model, save a checkpoint under OUTPUTS/<recipe>/<run id>/, "
        "reload it from disk to check it, and record everything in one MLflow run.",
    )
    q.add_argument("recipe", help="a recipe name (recipes/NAME.yaml) or a path to a .yaml file")
    q.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set calibration.samples=8 (repeatable; VALUE is YAML)")
    q.add_argument("--outputs", type=Path, default=Path("outputs"), help="output root (default: outputs)")
    q.add_argument("--experiment", help="MLflow experiment (default: $MLFLOW_EXPERIMENT_NAME or 'quantbench')")
    q.add_argument("--json", action="store_true", help='print {"run_id", "checkpoint", "metrics"} as the last line')

    e = sub.add_parser(
        "evaluate",
        help="score a checkpoint against its base model (ppl, KLD, agreement, tasks, flips)",
        description="Score a checkpoint against its base model with a suite (suites/NAME.yaml): perplexity, "
        "KL divergence and top-1 agreement on held-out text, lm-eval tasks, answer flips, recovery. The base "
        "model is scored once per (model, suite) in a baseline run and reused. A run id logs into that run.",
    )
    e.add_argument("target", help="an MLflow run id (from quantize) or a checkpoint directory")
    e.add_argument("--suite", default=None, help="suites/NAME.yaml (default: default)")
    e.add_argument("--base", default=None, help="the base model source, for a checkpoint quantbench did not write")
    e.add_argument("--experiment", help="MLflow experiment (default: $MLFLOW_EXPERIMENT_NAME or 'quantbench')")
    e.add_argument("--json", action="store_true", help='print {"run_id", "baseline_run", "metrics", ...} as the last line')

    b = sub.add_parser(
        "bench",
        help="measure speed against the base model (TTFT, tok/s, latency, throughput, memory)",
        description="Measure a checkpoint and its base model with a profile (profiles/NAME.yaml), interleaved, "
        "and log speed/<metric> and speedup/<metric> (above 1 is faster). A run id logs into that run.\n\n"
        "Speculative decoding: `quantbench bench --draft <run id | checkpoint> [TARGET]` generates with TARGET "
        "(default: the draft's base model, e.g. the teacher of a distilled student) and the draft proposing tokens "
        "(transformers assisted generation), against TARGET alone; logs speed/spec_acceptance and "
        "speedup/spec_decode_tok_s into the draft's run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("target", nargs="?", help="an MLflow run id (from quantize) or a checkpoint directory; with --draft: "
                   "the model to speed up (a run id, checkpoint dir or model source; default the draft's base model)")
    b.add_argument("--draft", metavar="RUN_ID|DIR", help="measure speculative decoding with this draft model")
    b.add_argument("--profile", default=None, help="profiles/NAME.yaml (default: cpu-smoke)")
    b.add_argument("--backend", default="hf", choices=["hf", "openai", "serve"],
                   help="hf: in-process transformers generate; openai: streaming OpenAI-compatible endpoints "
                   "(--endpoint, --base-endpoint); serve: starts a server (vLLM or transformers serve) for both on 127.0.0.1")
    b.add_argument("--server", default="auto", choices=["auto", "vllm", "transformers"],
                   help="with --backend serve: auto = vLLM where installed (here or $QUANTBENCH_VLLM_PYTHON), "
                   "else transformers serve")
    b.add_argument("--endpoint", help="with --backend openai: the checkpoint's endpoint, e.g. http://127.0.0.1:8000/v1")
    b.add_argument("--base-endpoint", help="with --backend openai: the base model's endpoint")
    b.add_argument("--base", default=None, help="the base model source, for a checkpoint quantbench did not write")
    b.add_argument("--experiment", help="MLflow experiment (default: $MLFLOW_EXPERIMENT_NAME or 'quantbench')")
    b.add_argument("--json", action="store_true", help='print {"run_id", "checkpoint", "metrics"} as the last line')

    c = sub.add_parser(
        "compare",
        help="one table of candidates with the quality-vs-speed Pareto frontier; Markdown, HTML, PNG",
        description="Compare the FINISHED candidate runs of an experiment (or --runs): size, recovery, KLD, "
        "flips, task scores, speedups, memory, gate verdicts; mark the Pareto frontier on --quality vs --speed. "
        "Writes outputs/compare/<summary run>/compare.{md,html,png,json} and logs them to a summary run.",
    )
    c.add_argument("--experiment", help="MLflow experiment (default: $MLFLOW_EXPERIMENT_NAME or 'quantbench')")
    c.add_argument("--runs", nargs="+", metavar="RUN_ID", help="compare exactly these candidate runs")
    c.add_argument("--quality", default=None, help="quality axis (default quality/kld_mean; e.g. recovery/quality/ppl)")
    c.add_argument("--speed", default=None, help="speed axis (default speedup/decode_tok_s, or model/compression_ratio "
                   "when no candidate has been benched)")
    c.add_argument("--outputs", type=Path, default=Path("outputs"), help="output root (default: outputs)")
    c.add_argument("--json", action="store_true", help="print the comparison as JSON on the last line")

    g = sub.add_parser(
        "gate",
        help="pass/fail a candidate run against a policy; on pass register it and move an alias",
        description="Check a candidate run against a policy (policies/NAME.yaml): required stages, recovery "
        "against the baseline, absolute limits, licence. Prints every check. On pass the checkpoint becomes a "
        "new version of the policy's registered model and the alias (champion) moves to it; the replaced "
        "version keeps the alias 'previous'. Exit 0 pass, 1 fail, 2 bad input.",
    )
    g.add_argument("run_id", help="the candidate's MLflow run id")
    g.add_argument("--policy", default="release", help="policies/NAME.yaml or a path (default: release)")
    g.add_argument("--experiment", help="MLflow experiment (default: $MLFLOW_EXPERIMENT_NAME or 'quantbench')")
    g.add_argument("--json", action="store_true", help="print the gate report as JSON on the last line")

    s = sub.add_parser(
        "sweep",
        help="run many recipes (a list and/or a matrix of overrides); resumable, with timeouts and retries",
        description="Run the jobs of sweeps/NAME.yaml, each `quantbench quantize` in its own process with a log "
        "file, a timeout and retries. State in outputs/sweeps/NAME/state.json: re-running resumes, skipping jobs "
        "whose recipe sha already has a FINISHED run (unless --force). Ends with a summary table, a parent MLflow "
        "run and the compare output. Exit 0 if every job finished, 1 if any failed, 2 bad input.",
    )
    s.add_argument("sweep", help="a sweep name (sweeps/NAME.yaml) or a path to a .yaml file")
    s.add_argument("--force", action="store_true", help="run every job again, even those already FINISHED")
    s.add_argument("--outputs", type=Path, default=Path("outputs"), help="output root (default: outputs)")
    s.add_argument("--experiment", help="MLflow experiment (default: the sweep's, $MLFLOW_EXPERIMENT_NAME or 'quantbench')")
    s.add_argument("--json", action="store_true", help="print the sweep summary as JSON on the last line")

    v = sub.add_parser("validate", help="validate recipe files, reporting every error at once",
                       description="Check recipe files against the schema and against their model's layer "
                       "widths (group sizes). Reports every problem in every file; exit 2 if any.")
    v.add_argument("files", nargs="*", type=Path, help="recipe files (default: recipes/*.yaml)")
    v.add_argument("--no-model", action="store_true", help="skip the checks that read the model's config")
    v.add_argument("--json", action="store_true", help="print a JSON summary as the last line")

    r = sub.add_parser("recipes", help="list the shipped recipes")
    r.add_argument("--json", action="store_true", help="print a JSON list")

    u = sub.add_parser("ui", help="start the MLflow UI on the tracking store")
    u.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1; expose only behind auth)")
    u.add_argument("--port", type=int, default=5000)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from quantbench.logs import configure_console

    configure_console(args.verbose)
    try:
        return COMMANDS[args.command](args)
    except UserError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _terminate_as_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _run_stage(name: str, fn, *args, **kwargs) -> dict | None:
    """Run a stage that owns an MLflow run; None (exit 1) if it failed after starting."""
    import signal

    # `kill` (a timeout, a scheduler) ends a stage like Ctrl-C: its MLflow run is marked KILLED
    # and any staging directory removed, never left RUNNING.
    signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    try:
        return fn(*args, **kwargs)
    except UserError:
        raise
    except Exception as exc:  # the run is already marked FAILED with the traceback
        log.exception("%s failed: %s", name, exc)
        return None


def cmd_quantize(args) -> int:
    from quantbench.quantize.job import run

    result = _run_stage("quantize", run, args.recipe, overrides=tuple(args.overrides), outputs=args.outputs,
                        experiment=args.experiment)
    if result is None:
        return 1
    print(f"checkpoint: {result['checkpoint']}")
    print(f"mlflow run: {result['run_id']}   log: {result['log']}")
    for key, value in sorted(result["metrics"].items()):
        print(f"  {key:44s} {value:.4g}")
    if args.json:
        print(json.dumps(result))
    return 0


def cmd_evaluate(args) -> int:
    from quantbench.evaluate.job import run

    result = _run_stage("evaluate", run, args.target, suite=args.suite, base=args.base, experiment=args.experiment)
    if result is None:
        return 1
    reused = " (reused)" if result["baseline_reused"] else " (scored now)"
    print(f"mlflow run: {result['run_id']}   baseline run: {result['baseline_run']}{reused}")
    if args.json:
        print(json.dumps(result))
    return 0


def cmd_bench(args) -> int:
    if args.draft:
        from quantbench.evaluate.speculative import run as run_spec

        if args.backend != "hf":
            raise UserError("--draft measures in-process (transformers assisted generation); drop --backend")
        result = _run_stage("bench", run_spec, args.draft, args.target, profile=args.profile, experiment=args.experiment)
    else:
        from quantbench.evaluate.bench import run

        if not args.target:
            raise UserError("bench: give a run id or checkpoint directory (or --draft)")
        result = _run_stage("bench", run, args.target, profile=args.profile, backend=args.backend, base=args.base,
                            experiment=args.experiment, endpoint=args.endpoint, base_endpoint=args.base_endpoint,
                            server=args.server)
    if result is None:
        return 1
    print(f"mlflow run: {result['run_id']}")
    if args.json:
        print(json.dumps(result))
    return 0


def cmd_compare(args) -> int:
    from quantbench.compare import run

    result = _run_stage("compare", run, experiment=args.experiment, run_ids=args.runs, quality=args.quality,
                        speed=args.speed, outputs=args.outputs)
    if result is None:
        return 1
    if args.json:
        print(json.dumps(result))
    return 0


def cmd_gate(args) -> int:
    from quantbench.gate import run

    result = _run_stage("gate", run, args.run_id, args.policy, experiment=args.experiment)
    if result is None:
        return 1
    if args.json:
        print(json.dumps(result))
    return 0 if result["passed"] else 1


def cmd_sweep(args) -> int:
    from quantbench.sweep import run

    result = _run_stage("sweep", run, args.sweep, force=args.force, outputs=args.outputs, experiment=args.experiment)
    if result is None:
        return 1
    if args.json:
        print(json.dumps(result))
    return 0 if result["counts"]["failed"] == 0 else 1


def cmd_validate(args) -> int:
    from quantbench.recipe import load_recipe, recipes_dir

    files = args.files or sorted(recipes_dir().glob("*.yaml"))
    if not files:
        raise UserError(f"no recipe files given and none in {recipes_dir()}/")
    problems: dict[str, list[str]] = {}
    for path in files:
        try:
            loaded = load_recipe(path)
            if not args.no_model:
                _validate_against_model(loaded)
        except UserError as exc:
            problems[str(path)] = exc.problems
    for path in files:
        if str(path) in problems:
            for line in problems[str(path)]:
                print(f"error: {line}", file=sys.stderr)
        else:
            print(f"ok: {path}")
    if args.json:
        print(json.dumps({"ok": not problems, "files": [str(f) for f in files], "problems": problems}))
    return 2 if problems else 0


def _validate_against_model(loaded) -> None:
    from quantbench import models
    from quantbench.quantize import get_backend
    from quantbench.quantize.job import check_shapes

    try:
        config = models.read_config(loaded.recipe.model.source)
    except UserError as exc:
        raise UserError([f"{loaded.path}: {p}" for p in exc.problems]) from None
    get_backend(loaded.recipe.quantize.method, getattr(loaded.recipe.quantize, "format", None))
    try:
        if loaded.recipe.evaluate is not None:
            from quantbench.evaluate.suite import load_suite

            load_suite(loaded.recipe.evaluate.suite, "evaluate.suite")
        if loaded.recipe.bench is not None:
            from quantbench.evaluate.speed import load_profile

            load_profile(loaded.recipe.bench.profile, "bench.profile")
    except UserError as exc:
        raise UserError([f"{loaded.path}: {p}" for p in exc.problems]) from None
    if config is not None:
        problems = check_shapes(loaded, config)
        if problems:
            raise UserError(problems)


def cmd_recipes(args) -> int:
    from quantbench.recipe import available_recipes, load_recipe, recipes_dir

    rows = []
    for name in available_recipes():
        try:
            r = load_recipe(recipes_dir() / f"{name}.yaml").recipe
            rows.append({"name": name, "method": r.quantize.method, "scheme": r.quantize.scheme, "description": r.description})
        except UserError:
            rows.append({"name": name, "method": "?", "scheme": "?", "description": "(invalid: run quantbench validate)"})
    if args.json:
        print(json.dumps(rows))
    else:
        for row in rows:
            print(f"{row['name']:16s} {row['method']:12s} {row['scheme']:12s} {row['description']}")
    return 0


def cmd_ui(args) -> int:
    import subprocess

    from quantbench.tracking import Tracker, experiment_name, tracking_uri

    uri = tracking_uri()
    print(f"MLflow UI for {uri} on http://{args.host}:{args.port}")
    found = Tracker().client.get_experiment_by_name(experiment_name())
    if found is not None:  # MLflow 3 opens its GenAI view by default; this link opens the runs table
        print(f"runs: http://{args.host}:{args.port}/#/experiments/{found.experiment_id}/runs?workflowType=machine_learning")
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: {args.host} is not loopback; the MLflow UI has no login of its own. Put authentication "
              "in front of it first (README: 'Exposing the UI').", file=sys.stderr)
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", args.host, "--port", str(args.port)]
    return subprocess.call(cmd)


COMMANDS = {"quantize": cmd_quantize, "evaluate": cmd_evaluate, "bench": cmd_bench, "compare": cmd_compare, "gate": cmd_gate, "sweep": cmd_sweep,
            "validate": cmd_validate, "recipes": cmd_recipes, "ui": cmd_ui}
