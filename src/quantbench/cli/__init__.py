"""The `quantbench` command: one subcommand per verb, argument parsing only."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from quantbench import engines
from quantbench.core.errors import UserError

log = logging.getLogger("quantbench")


EPILOG = """\
examples:
  quantbench quantize awq-int4                      recipes/awq-int4.yaml on the embedded default model
  quantbench quantize gptq-w4a16 --set calibration.samples=8 --json
  quantbench evaluate <run id | checkpoint dir>     quality against the base model (suites/default.yaml)
  quantbench bench <run id | checkpoint dir>        speed against the base model through vLLM where it serves the
                                                    format (profiles/cpu-smoke.yaml)
  quantbench evaluate <run id> --engine vllm        also the suite's tasks scored on the checkpoint served by vLLM
  quantbench doctor                                 which engines and servers this machine has
  quantbench compare                                all candidates, Pareto frontier (quality vs speed)
  quantbench noise builtin:smollm2-135m-instruct    the noise floor: the base model against itself
  quantbench gate <run id> --policy release         pass/fail; a pass moves the registry alias 'champion'
  quantbench sweep cpu-grid                         many jobs (sweeps/cpu-grid.yaml): resumable, timeouts, retries
  quantbench tune --policy release                  the smallest mixed-precision checkpoint that passes a policy
  quantbench stack cpu                              the speedup ledger: engine, quantization, batching stacked
  quantbench sweep cpu-grid --ray HOST:PORT         the same jobs on a Ray cluster (docs/ray.md)
  quantbench validate recipes/*.yaml                check recipes (every error at once)
  quantbench recipes                                list the shipped recipes
  quantbench gc                                     end runs left RUNNING by a killed process, remove their leftovers
  quantbench ui                                     MLflow UI on http://127.0.0.1:5000

exit codes: 0 ok, 1 the job failed (see its log) or the gate failed, 2 bad input (nothing was written),
  130 interrupted (Ctrl-C, SIGTERM: the run is marked KILLED, a quantize job leaves no checkpoint)
tracking: MLFLOW_TRACKING_URI (default sqlite:///mlflow.db here, artifacts in ./mlruns)
"""


def _common(*names: str) -> argparse.ArgumentParser:
    """Options several commands share, defined once."""
    parent = argparse.ArgumentParser(add_help=False)
    if "experiment" in names:
        parent.add_argument("--experiment", help="MLflow experiment (default: $MLFLOW_EXPERIMENT_NAME or 'quantbench')")
    if "outputs" in names:
        parent.add_argument("--outputs", type=Path, default=Path("outputs"), help="output root (default: outputs)")
    if "base" in names:
        parent.add_argument(
            "--base", default=None, help="the base model source, for a checkpoint quantbench did not write"
        )
    if "json" in names:
        parent.add_argument("--json", action="store_true", help="print a JSON summary as the last line of output")
    return parent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quantbench",
        description="Quantize models from recipe files, check the checkpoints, track everything in MLflow.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    exp_json = _common("experiment", "json")

    q = sub.add_parser(
        "quantize",
        parents=[_common("experiment", "outputs", "json")],
        help="run a recipe: quantize, save, reload-check, evaluate, bench, track",
        description="Quantize the recipe's model, save a checkpoint under OUTPUTS/<recipe>/<run id>/, "
        "reload it from disk to check it, run the recipe's evaluate: and bench: sections, and record everything "
        "in one MLflow run. The checkpoint is moved into place only when every stage finished. "
        'With --json the last line is {"run_id", "checkpoint", "log", "metrics"}.',
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

    e = sub.add_parser(
        "evaluate",
        parents=[_common("experiment", "base", "json")],
        help="score a checkpoint against its base model (ppl, KLD, agreement, tasks, flips)",
        description="Score a checkpoint against its base model with a suite (suites/NAME.yaml): perplexity, "
        "KL divergence and top-1 agreement on held-out text, lm-eval tasks, answer flips, recovery. The base "
        "model is scored once per (model, suite) in a baseline run and reused. A run id logs into that run. "
        'With --json the last line is {"run_id", "checkpoint", "baseline_run", "baseline_reused", "metrics"}.',
    )
    e.add_argument("target", help="an MLflow run id (from quantize) or a checkpoint directory")
    e.add_argument("--suite", default=None, help="suites/NAME.yaml (default: default)")
    e.add_argument(
        "--engine",
        choices=engines.scoring(),
        default=None,
        help="also score the suite's lm-eval tasks on the checkpoint served by this engine (lm-eval "
        "local-completions against its server): task_engine/<task>/<metric> and quality/engine_flips_pct "
        "(items whose correctness differs between the engine and transformers)",
    )

    b = sub.add_parser(
        "bench",
        parents=[_common("experiment", "base", "json")],
        help="measure speed against the base model (TTFT, tok/s, latency, throughput, memory)",
        description="Measure a checkpoint and its base model with a profile (profiles/NAME.yaml), interleaved, "
        "and log speed/<metric> and speedup/<metric> (above 1 is faster). A run id logs into that run.\n\n"
        "Speculative decoding: `quantbench bench --draft <run id | checkpoint> [TARGET]` generates with TARGET "
        "(default: the draft's base model, e.g. the teacher of a distilled student) and the draft proposing tokens "
        "(transformers assisted generation), against TARGET alone; logs speed/spec_acceptance and "
        "speedup/spec_decode_tok_s into the draft's run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument(
        "target",
        nargs="?",
        help="an MLflow run id (from quantize) or a checkpoint directory; with --draft: "
        "the model to speed up (a run id, checkpoint dir or model source; default the draft's base model)",
    )
    b.add_argument("--draft", metavar="RUN_ID|DIR", help="measure speculative decoding with this draft model")
    b.add_argument("--profile", default=None, help="profiles/NAME.yaml (default: cpu-smoke)")
    b.add_argument(
        "--backend",
        default=None,
        choices=engines.backend_choices(),
        help=f"auto (default): the first of {', '.join(engines.AUTO)} that serves the checkpoint's format and "
        "its base model's on this device (vLLM's environment .venv-vllm is created on first use); a server's "
        "name (vllm, transformers, ...): that server on 127.0.0.1 for both models; hf: in-process transformers "
        "generate (not a serving engine); openai: running endpoints (--endpoint, --base-endpoint); serve: "
        "--server picks",
    )
    b.add_argument(
        "--server",
        default="auto",
        choices=["auto", *engines.servers()],
        help="with --backend serve: auto = the first server engine that serves the format here",
    )
    b.add_argument("--endpoint", help="with --backend openai: the checkpoint's endpoint, e.g. http://127.0.0.1:8000/v1")
    b.add_argument("--base-endpoint", help="with --backend openai: the base model's endpoint")

    c = sub.add_parser(
        "compare",
        parents=[_common("experiment", "outputs", "json")],
        help="one table of candidates with the quality-vs-speed Pareto frontier; Markdown, HTML, PNG",
        description="Compare the FINISHED candidate runs of an experiment (or --runs, FINISHED candidates only): size, "
        "recovery, KLD, flips, task scores, speedups, memory, gate verdicts; mark the Pareto frontier on --quality vs --speed. "
        "Writes outputs/compare/<summary run>/compare.{md,html,png,json} and logs them to a summary run.",
    )
    c.add_argument(
        "--runs",
        nargs="+",
        metavar="RUN_ID",
        help="compare exactly these candidate runs (each FINISHED); or these `quantbench stack` runs, their "
        "ledgers side by side step by step (stacks.md, stacks.json)",
    )
    c.add_argument("--quality", default=None, help="quality axis (default quality/kld_mean; e.g. recovery/quality/ppl)")
    c.add_argument(
        "--speed",
        default=None,
        help="speed axis (default speedup/decode_tok_s, or model/compression_ratio when no candidate has been benched)",
    )

    n = sub.add_parser(
        "noise",
        parents=[_common("experiment", "outputs", "json")],
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
    n.add_argument(
        "--backend",
        default="auto",
        choices=[b for b in engines.backend_choices() if b not in ("openai", "serve")],
        help="the engine the speed part measures through, as for bench (default auto: vLLM where it "
        "serves the model, else transformers serve, else hf)",
    )
    n.add_argument("--recipe", default=None, help="a calibrated recipe to run at two calibration seeds as well")

    g = sub.add_parser(
        "gate",
        parents=[exp_json],
        help="pass/fail a candidate run against a policy; on pass register it and move an alias",
        description="Check a candidate run against a policy (policies/NAME.yaml): required stages, recovery "
        "against the baseline, absolute limits, licence. Prints every check. On pass the checkpoint becomes a "
        "new version of the policy's registered model and the alias (champion) moves to it; the replaced "
        "version keeps the alias 'previous'. Exit 0 pass, 1 fail, 2 bad input.",
    )
    g.add_argument("run_id", help="the candidate's MLflow run id")
    g.add_argument("--policy", default="release", help="policies/NAME.yaml or a path (default: release)")

    s = sub.add_parser(
        "sweep",
        parents=[_common("experiment", "outputs", "json")],
        help="run many recipes (a list and/or a matrix of overrides); resumable, with timeouts and retries",
        description="Run the jobs of sweeps/NAME.yaml, each `quantbench quantize` in its own process with a log "
        "file, a timeout and retries. State in outputs/sweeps/NAME/state.json: re-running resumes, skipping jobs "
        "whose recipe sha already has a FINISHED run (unless --force). Ends with a summary table, a parent MLflow "
        "run and the compare output. Exit 0 if every job finished, 1 if any failed, 2 bad input.",
    )
    s.add_argument("sweep", help="a sweep name (sweeps/NAME.yaml) or a path to a .yaml file")
    s.add_argument("--force", action="store_true", help="run every job again, even those already FINISHED")
    s.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run each attempt on a Ray cluster, on the node Ray places it with the resources the recipe or "
        "sweep asks for: ADDRESS is HOST:PORT of its head, ray://HOST:10001 (Ray Client) or auto; omitted, "
        "the cluster running here or else a local Ray for this sweep (docs/ray.md; needs "
        "pip install -e '.[ray]')",
    )

    k = sub.add_parser(
        "stack",
        parents=[_common("experiment", "outputs", "json")],
        help="the speedup ledger: techniques stacked step by step, each one's multiplier and quality cost",
        description="Measure the steps of stacks/NAME.yaml on the same prompts, interleaved round by round: a naive "
        "start (in-process transformers), then each step adding a technique to everything before it (a serving "
        "engine, a 16-bit dtype, a quantized or distilled model, batching). Prints the ledger: each step's output "
        "throughput, its multiplier over the step before [95% interval], the cumulative multiplier over the start, "
        "and the quality of its model against the base (from the model's own run). A step naming recipe:NAME runs "
        "that recipe first when the experiment has no run of it. One parent MLflow run (stack.json, stack.md, "
        "stack_waterfall.png) with a child run per step. Exit 0 all steps measured, 1 a step failed, 2 bad input "
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

    t = sub.add_parser(
        "tune",
        parents=[_common("experiment", "outputs", "json")],
        help="find the smallest checkpoint that passes a policy: per-layer schemes under a budget, verified",
        description="Measure how much each layer of the base model moves its output when quantized alone with each "
        "scheme (stored once, reused), choose a scheme per layer that minimises the predicted KLD under a budget, write "
        "that choice as a recipe and run it like any quantize job (reload check, evaluate, bench) as a child of a "
        "tune run. Without --bits / --max-size-mb the budget is searched (bisection on the measured quality checks) "
        "for the smallest checkpoint that passes. The answer is gated with the policy (a pass moves its alias). "
        "Re-running resumes. Outputs under OUTPUTS/tune/<policy>-<id>/. Exit 0 a candidate passes, 1 none does, "
        '2 bad input, 130 interrupted. With --json the last line is {"parent_run", "best_run", "recipe", "passed", '
        '"frontier", ...}.',
    )
    t.add_argument("--policy", required=True, help="policies/NAME.yaml or a path")
    budget = t.add_mutually_exclusive_group()
    budget.add_argument(
        "--bits", type=float, help="average stored bits per quantizable weight (scales included), e.g. 4.5"
    )
    budget.add_argument("--max-size-mb", type=float, help="the checkpoint's size in MiB, embeddings included")
    budget.add_argument(
        "--latency-ms",
        type=float,
        metavar="MS",
        help="with --engine llamacpp: one candidate, the least predicted KLD whose predicted decode time is at "
        "most MS per token (from the cost table measured on this machine; implies --objective latency)",
    )
    t.add_argument(
        "--objective",
        choices=["size", "latency"],
        default="size",
        help="what the search minimises among the candidates that pass: size (default), or with --engine "
        "llamacpp latency, the predicted decode time per token from llama.cpp's own kernels measured here "
        "(a cost table per type through llama-bench, measured once with progress and cached: 30 s for six "
        "types on the default model on 2 AVX2-only cores)",
    )
    t.add_argument(
        "--schemes",
        nargs="+",
        metavar="SCHEME",
        default=None,
        help="schemes to choose from (default: W4A16-G64 W4A16-G64-ASYM W4A16-G32 W4A16-G32-ASYM W8A8 BF16, "
        "what vLLM serves together on CPU; also W8A16, FP8); with --engine llamacpp llama.cpp tensor types "
        "(default: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 F16)",
    )
    t.add_argument(
        "--engine",
        choices=["vllm", "llamacpp"],
        default=None,
        help="whose types to mix: vllm (compressed-tensors schemes, default) or llamacpp (GGUF tensor types, "
        "each tensor its own, quantized by llama-quantize and served by llama-server); default: the --from "
        "recipe's method",
    )
    t.add_argument("--budget-runs", type=int, default=6, help="candidates to quantize and measure at most (default 6)")
    t.add_argument(
        "--from",
        dest="templates",
        nargs="+",
        default=None,
        metavar="RECIPE",
        help="the recipe the candidates start from: model, calibration, method (gptq, rtn, autoround, "
        "spinquant; gguf for llama.cpp), evaluate and bench sections (default gptq-w4a16; with --engine "
        "llamacpp gguf-q4_0). With several (e.g. gptq-w4a16 "
        "autoround-w4a16), the search uses the first and the answer's allocation is also made with each "
        "other; the best measured wins",
    )
    t.add_argument(
        "--sensitivity",
        choices=["fisher", "kld"],
        default="fisher",
        help="fisher: the second-order proxy, one backward pass per window (default; about a minute on the "
        "default model on 2 cores); kld: measured exactly per layer and scheme (about 25 minutes there)",
    )
    t.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="quantize, evaluate and bench each candidate on a Ray cluster node (as sweep --ray: HOST:PORT, "
        "ray://HOST:10001 or auto; omitted, the cluster running here or else a local Ray); the search and "
        "the sensitivity stay here (docs/ray.md)",
    )
    t.add_argument(
        "--remeasure-costs",
        action="store_true",
        help="with --objective latency: measure the latency cost table again and replace the cached one (it "
        "is kept per build, CPU, threads, model and types; measure on a quiet machine)",
    )
    t.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="with --ray: N candidates at once. Each round of the budget search measures N budgets (the "
        "model's pick and N - 1 more around it, below and above in turn), and --from's alternatives run "
        "together; --budget-runs still counts candidates (default 1: one after another, each chosen from "
        "the last one's measurement)",
    )
    t.add_argument(
        "--sensitivity-windows",
        type=int,
        default=4,
        metavar="N",
        help="held-back calibration windows of 256 tokens the sensitivity is measured on (default 4)",
    )

    v = sub.add_parser(
        "validate",
        parents=[exp_json],
        help="validate recipe files, reporting every error at once",
        description="Check recipe files: the schema, and every check quantize makes before it loads a "
        "model: the model source and its files (whole safetensors, a readable GGUF), its layer widths "
        "(group sizes), the calibration text and its size in tokens, the suite and the profile. Reports "
        "every problem in every file; exit 2 if any.",
    )
    v.add_argument("files", nargs="*", type=Path, help="recipe files (default: recipes/*.yaml)")
    v.add_argument(
        "--no-model", action="store_true", help="the schema only: skip the checks that read the model and texts"
    )

    sub.add_parser("recipes", parents=[_common("json")], help="list the shipped recipes")

    d = sub.add_parser(
        "doctor",
        parents=[_common("json")],
        help="which engines and servers this machine has",
        description="One line per engine and server: transformers (and transformers serve), vLLM (its "
        "version and environment), llm-compressor, bitsandbytes, GPTQModel, lm-eval, torch and CUDA, the "
        "CPU's vector extensions, and which checkpoint formats vLLM serves here. Starts nothing.",
    )
    d.add_argument(
        "--vllm", action="store_true", help="create vLLM's environment first if it does not exist (`make vllm`)"
    )
    d.add_argument(
        "--llamacpp",
        action="store_true",
        help="build llama.cpp's tools for this CPU first if they are not built (`make llamacpp`; ~12 min on 2 cores)",
    )

    gc = sub.add_parser(
        "gc",
        parents=[_common("experiment", "json")],
        help="end runs whose process died (SIGKILL, OOM) and remove what they left",
        description="Mark RUNNING runs whose owner process on this host is gone as FAILED, with the "
        "reason, and remove the staging directories they left. Every command does this for the whole "
        "store when it opens it; gc does it on demand for one experiment (--all: every experiment).",
    )
    gc.add_argument("--all", action="store_true", help="every experiment in the store, not only one")

    u = sub.add_parser("ui", help="start the MLflow UI on the tracking store")
    u.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address (default 127.0.0.1); any other than loopback needs --expose-unauthenticated",
    )
    u.add_argument("--port", type=int, default=5000)
    u.add_argument(
        "--expose-unauthenticated",
        action="store_true",
        help="allow a --host other than loopback: the MLflow UI has no login, so anyone who reaches the port "
        "reads and changes every run and registered model. Put authentication in front of it (docs/gate.md)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from quantbench.core.logs import configure_console

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


def _run_stage(name: str, fn, *args, **kwargs) -> Any | None:
    """Run a stage that owns an MLflow run; None (exit 1) if it failed after starting."""
    import signal

    from quantbench.core.processes import interrupt, interrupted

    # `kill` (a timeout, a scheduler) ends a stage like Ctrl-C: its MLflow run is marked KILLED
    # and any staging directory removed, never left RUNNING (not even when the signal comes while
    # the run is being created or ended: tracking holds it back for that moment).
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    try:
        return fn(*args, **kwargs)
    except UserError:
        raise
    except Exception as exc:  # the run is already marked FAILED (or KILLED) with the traceback
        if interrupted(exc):  # an interrupt a library wrapped in an exception of its own: exit 130
            raise KeyboardInterrupt(str(exc)) from exc
        log.exception("%s failed: %s", name, exc)
        return None


def cmd_quantize(args) -> int:
    from quantbench.cli import report
    from quantbench.jobs import pipeline

    result = _run_stage(
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
    if result.evaluation is not None:
        print(
            report.evaluation_table(
                result.evaluation.metrics, result.evaluation.baseline_metrics, result.evaluation.notes
            )
        )
    if result.bench is not None:
        print(report.bench_table(result.bench.metrics))
        print(report.bench_engine(result.bench))
    print(f"checkpoint: {result.checkpoint}")
    print(f"mlflow run: {result.run_id}   log: {result.log}")
    print(report.metric_lines(result.metrics))
    return _json(args, result.summary())


def cmd_evaluate(args) -> int:
    from quantbench.cli import report
    from quantbench.jobs import pipeline

    result = _run_stage(
        "evaluate",
        pipeline.evaluate,
        args.target,
        suite=args.suite,
        base=args.base,
        experiment=args.experiment,
        engine=args.engine,
    )
    if result is None:
        return 1
    print(
        report.evaluation_table(result.evaluation.metrics, result.evaluation.baseline_metrics, result.evaluation.notes)
    )
    if result.engine_tasks is not None:
        print(report.engine_table(result.engine_tasks.metrics, result.evaluation.metrics))
    reused = " (reused)" if result.evaluation.baseline_reused else " (scored now)"
    print(f"mlflow run: {result.run_id}   baseline run: {result.evaluation.baseline_run}{reused}")
    return _json(args, result.summary())


def cmd_bench(args) -> int:
    from quantbench.cli import report
    from quantbench.jobs import pipeline

    if args.draft:
        if args.backend not in (None, "hf"):
            raise UserError("--draft measures in-process (transformers assisted generation); drop --backend")
        result = _run_stage(
            "bench", pipeline.speculative, args.draft, args.target, profile=args.profile, experiment=args.experiment
        )
        if result is None:
            return 1
        print(report.metric_lines(result.metrics, 36))
    else:
        if not args.target:
            raise UserError("bench: give a run id or checkpoint directory (or --draft)")
        endpoints = (args.endpoint, args.base_endpoint) if args.backend == "openai" else None
        result = _run_stage(
            "bench",
            pipeline.bench,
            args.target,
            profile=args.profile,
            backend=args.backend or "auto",
            server=args.server,
            base=args.base,
            experiment=args.experiment,
            endpoints=endpoints,
        )
        if result is None:
            return 1
        print(report.bench_table(result.metrics))
        print(report.bench_engine(result.bench))
    print(f"mlflow run: {result.run_id}")
    return _json(args, result.summary())


def cmd_compare(args) -> int:
    from quantbench.release import compare

    result = _run_stage(
        "compare",
        compare.run,
        experiment=args.experiment,
        run_ids=args.runs,
        quality=args.quality,
        speed=args.speed,
        outputs=args.outputs,
    )
    if result is None:
        return 1
    print(result.text() + f"   summary run: {result.run_id}")
    return _json(args, result.summary())


def cmd_noise(args) -> int:
    from quantbench.cli import report
    from quantbench.jobs import noise

    result = _run_stage(
        "noise",
        noise.run,
        args.model,
        suite=args.suite,
        profile=args.profile,
        bench=not args.no_bench,
        backend=args.backend,
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
    return _json(args, result.summary())


def cmd_gate(args) -> int:
    from quantbench.release import gate

    result = _run_stage("gate", gate.run, args.run_id, args.policy, experiment=args.experiment)
    if result is None:
        return 1
    print(gate.text(result))
    _json(args, result)
    return 0 if result["passed"] else 1


def cmd_sweep(args) -> int:
    from quantbench.jobs.sweep import run

    result = _run_stage(
        "sweep", run, args.sweep, force=args.force, outputs=args.outputs, experiment=args.experiment, ray=args.ray
    )
    if result is None:
        return 1
    print(result["table"])
    _json(args, result)
    return 0 if result["counts"]["failed"] == 0 else 1


def cmd_tune(args) -> int:
    from quantbench.tune import search as tune
    from quantbench.tune import sensitivity

    request = tune.Request(
        policy=args.policy,
        bits=args.bits,
        max_size_mb=args.max_size_mb,
        schemes=args.schemes,
        budget_runs=args.budget_runs,
        template=args.templates[0] if args.templates else None,
        alternatives=(args.templates or [])[1:],
        engine=args.engine,
        objective=args.objective,
        latency_ms=args.latency_ms,
        remeasure_costs=args.remeasure_costs,
        sensitivity=sensitivity.Settings(method=args.sensitivity, windows=args.sensitivity_windows),
        ray=args.ray,
        parallel=args.parallel,
    )
    result = _run_stage("tune", tune.run, request, outputs=args.outputs, experiment=args.experiment)
    if result is None:
        return 1
    print(tune.text(result))
    _json(args, result)
    return 0 if result["passed"] else 1


def cmd_stack(args) -> int:
    from quantbench.jobs import stack

    result = _run_stage(
        "stack",
        stack.run,
        args.stack,
        policy=args.policy,
        best=args.best,
        experiment=args.experiment,
        outputs=args.outputs,
    )
    if result is None:
        return 1
    print(stack.table(result.report))
    print(f"mlflow run: {result.run_id}")
    if result.failed:
        print(f"failed steps: {', '.join(result.failed)} (their runs hold the error)", file=sys.stderr)
    _json(args, result.summary())
    return 1 if result.failed else 0


def cmd_gc(args) -> int:
    from quantbench.tracking import Tracker

    done = Tracker(args.experiment, reap=False).reap(everywhere=args.all)
    for d in done:
        print(
            f"marked FAILED: run {d['run_id']} ({d['name']}) in {d['experiment']}, owner {d['owner']} gone"
            + (f"; removed {d['removed']}" if d["removed"] else "")
        )
    if not done:
        print("nothing to collect: no RUNNING run of a dead process on this host")
    return _json(args, {"reaped": done})


def _json(args, summary: dict) -> int:
    if getattr(args, "json", False):
        print(json.dumps(summary, default=str))
    return 0


def cmd_validate(args) -> int:
    from quantbench.recipe import RecipeError, load_recipe, recipes_dir

    files = args.files or sorted(recipes_dir().glob("*.yaml"))
    if not files:
        raise UserError(f"no recipe files given and none in {recipes_dir()}/")
    problems: dict[str, list[str]] = {}
    for path in files:
        try:
            loaded, found, invalid = load_recipe(path), [], frozenset()
        except RecipeError as exc:
            loaded, found, invalid = exc.partial, exc.problems, exc.invalid
        except UserError as exc:
            loaded, found = None, exc.problems
        if loaded is not None and not args.no_model:
            from quantbench.jobs.pipeline import check_without_model

            found = found + check_without_model(loaded, args.experiment, invalid)
        if found:
            problems[str(path)] = found
    for path in files:
        if str(path) in problems:
            for line in problems[str(path)]:
                print(f"error: {line}", file=sys.stderr)
        else:
            print(f"ok: {path}")
    _json(args, {"ok": not problems, "files": [str(f) for f in files], "problems": problems})
    return 2 if problems else 0


def cmd_recipes(args) -> int:
    from quantbench.recipe import available_recipes, load_recipe, recipes_dir

    rows = []
    for name in available_recipes():
        try:
            r = load_recipe(recipes_dir() / f"{name}.yaml").recipe
            rows.append(
                {"name": name, "method": r.quantize.method, "scheme": r.quantize.scheme, "description": r.description}
            )
        except UserError:
            rows.append(
                {"name": name, "method": "?", "scheme": "?", "description": "(invalid: run quantbench validate)"}
            )
    if args.json:
        print(json.dumps(rows))
    else:
        for row in rows:
            print(f"{row['name']:16s} {row['method']:12s} {row['scheme']:12s} {row['description']}")
    return 0


def cmd_doctor(args) -> int:
    from quantbench.cli import doctor

    if args.vllm:
        from quantbench.engines import vllm_env as vllm_engine

        vllm_engine.ensure("make vllm")
    if args.llamacpp:
        from quantbench.engines import llamacpp_build

        llamacpp_build.ensure("make llamacpp")
    facts = doctor.facts()
    print(doctor.text(facts))
    return _json(args, {"engines": facts})


def cmd_ui(args) -> int:
    """The MLflow UI as a child process group, stopped with this process: on Ctrl-C, and on
    SIGTERM / SIGHUP (a supervisor, a closed terminal), not left listening."""
    import signal
    import subprocess

    from quantbench.core.processes import interrupt, stop_group
    from quantbench.tracking import Tracker, tracking_uri

    exposed = not _loopback(args.host)
    if exposed and not args.expose_unauthenticated:
        raise UserError(
            f"--host {args.host}: not a loopback address, and the MLflow UI has no login of its own: anyone "
            "who reaches the port reads and changes every run and registered model. Put authentication in "
            "front of it instead (docs/gate.md, 'Exposing the UI'): a reverse proxy with auth and TLS (nginx "
            "auth_basic, an OAuth2 proxy) listening publicly and forwarding to 127.0.0.1, or MLflow's "
            "basic-auth app. To bind it unauthenticated anyway, add --expose-unauthenticated"
        )
    uri = tracking_uri()
    print(f"MLflow UI for {uri} on http://{args.host}:{args.port}")
    experiment_id = Tracker().experiment_id(create=False)
    if experiment_id is not None:  # MLflow 3 opens its GenAI view by default; this link opens the runs table
        print(f"runs: http://{args.host}:{args.port}/#/experiments/{experiment_id}/runs?workflowType=machine_learning")
    if exposed:
        print(
            f"warning: serving the MLflow UI without authentication on {args.host} (--expose-unauthenticated)",
            file=sys.stderr,
        )
    sys.stdout.flush()
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "ui",
        "--backend-store-uri",
        uri,
        "--host",
        args.host,
        "--port",
        str(args.port),
    ]
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupt)
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait()
    finally:
        stop_group(proc)  # the server and its workers, whatever ended this process


def _loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only (a name other than localhost may resolve anywhere)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


COMMANDS = {
    "quantize": cmd_quantize,
    "evaluate": cmd_evaluate,
    "bench": cmd_bench,
    "compare": cmd_compare,
    "noise": cmd_noise,
    "gate": cmd_gate,
    "sweep": cmd_sweep,
    "tune": cmd_tune,
    "stack": cmd_stack,
    "validate": cmd_validate,
    "recipes": cmd_recipes,
    "gc": cmd_gc,
    "doctor": cmd_doctor,
    "ui": cmd_ui,
}
