"""`quantbench tune`: find the smallest checkpoint that passes a policy: per-layer schemes under a
budget, verified."""

from __future__ import annotations

from quantbench import engines
from quantbench.cli.common import common, print_json, run_stage, verdict_text
from quantbench.release import verdict
from quantbench.tune import command, sensitivity
from quantbench.tune.plan import Request

DESCRIPTION = (
    "Measure how much each layer of the base model moves its output when quantized alone with each "
    "scheme (stored once, reused), choose a scheme per layer that minimises the predicted KLD under a budget, write "
    "that choice as a recipe and run it like any quantize job (reload check, evaluate, bench) as a child of a "
    "tune run. Without --bits / --max-size-mb the budget is searched (bisection on the measured quality checks) "
    "for the smallest checkpoint that passes. The answer is gated with the policy (a pass moves its alias). "
    "Re-running resumes. Outputs under OUTPUTS/tune/<policy>-<id>/. Ends with the chosen candidate's verdict. Exit 0 a candidate passes, 1 none does, "
    '2 bad input, 130 interrupted. With --json the last line is {"parent_run", "best_run", "recipe", "passed", '
    '"frontier", ...}.'
)


def add_parser(sub) -> None:
    t = sub.add_parser(
        "tune",
        parents=[common("experiment", "outputs", "json")],
        help="find the smallest checkpoint that passes a policy: per-layer schemes under a budget, verified",
        description=DESCRIPTION,
    )
    t.add_argument("--policy", required=True, help="policies/NAME.yaml or a path")
    _budget_options(t)
    _candidate_options(t)
    _measurement_options(t)


def _budget_options(t) -> None:
    """The budget (one of --bits, --max-size-mb, --latency-ms; none: searched) and what the search minimises."""
    budget = t.add_mutually_exclusive_group()
    budget.add_argument(
        "--bits", type=float, help="average stored bits per quantizable weight (scales included), e.g. 4.5"
    )
    budget.add_argument("--max-size-mb", type=float, help="the checkpoint's size in MiB, embeddings included")
    budget.add_argument(
        "--latency-ms",
        type=float,
        metavar="MS",
        help="one candidate, the least predicted KLD whose predicted decode time is at most MS per token (from "
        "the engine's cost table measured on this machine; implies --objective latency)",
    )
    t.add_argument(
        "--objective",
        choices=["size", "latency"],
        default="size",
        help="what the search minimises among the candidates that pass: size (default), or latency, the "
        "predicted decode time per token from the engine's own kernels measured here (a cost table per type, "
        "measured once with progress and cached: llama.cpp through llama-bench, 30 s for six types on the "
        "default model on 2 AVX2-only cores; vLLM a server per scheme, a minute or two each; schemes vLLM "
        "does not serve here are left out, with its reason)",
    )


def _candidate_options(t) -> None:
    """What the candidates are made of: the schemes, whose types, how many, the recipes they start
    from, and the sensitivity they are allocated by."""
    t.add_argument(
        "--schemes",
        nargs="+",
        metavar="SCHEME",
        default=None,
        help="schemes to choose from (default: W4A16-G64 W4A16-G64-ASYM W4A16-G32 W4A16-G32-ASYM W8A8 BF16, "
        "what vLLM serves together on CPU; also W8A16, FP8, NVFP4A16, MXFP4A16); with --engine llamacpp llama.cpp tensor types "
        "(default: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 IQ4_NL IQ4_XS Q4_K Q5_K Q6_K F16; also Q2_K Q3_K MXFP4; K-quants and "
        "IQ4_XS only on tensors whose rows are multiples of 256)",
    )
    t.add_argument(
        "--engine",
        choices=[e.name for e in engines.tunable()],
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


def _measurement_options(t) -> None:
    """Where candidates run and how the tables they are chosen by are measured."""
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


def run(args) -> int:
    request = Request(
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
    result = run_stage("tune", command.run, request, outputs=args.outputs, experiment=args.experiment)
    if result is None:
        return 1
    print(command.text(result))
    if result.get("best_run"):  # the answer's verdict under the tune's policy (its gate already ran)
        print(verdict_text(verdict.of_run(result["best_run"], policy=args.policy, experiment=args.experiment), True))
    print_json(args, result)
    return 0 if result["passed"] else 1
