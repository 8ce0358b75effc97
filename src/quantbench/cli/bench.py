"""`quantbench bench`: measure speed against the base model (TTFT, tok/s, latency, throughput, memory)."""

from __future__ import annotations

import argparse

from quantbench import engines
from quantbench.cli import report
from quantbench.cli.common import common, print_json, renamed, run_stage, verdict_json, verdict_text
from quantbench.core.errors import UserError
from quantbench.jobs import existing


def add_parser(sub) -> None:
    b = sub.add_parser(
        "bench",
        parents=[common("experiment", "base", "json")],
        help="measure speed against the base model (TTFT, tok/s, latency, throughput, memory)",
        description="Measure a checkpoint and its base model with a profile (profiles/NAME.yaml), interleaved, "
        "and log speed/<metric> and speedup/<metric> (above 1 is faster). A run id logs into that run. Ends with the "
        "run's verdict (decode and TTFT speedups with their intervals, the engine and CPU class, quality and size "
        "from the run, what the release policy would say); every metric is in the run's log file and --json.\n\n"
        "Speculative decoding: `quantbench bench --draft <run id | checkpoint> [TARGET]` generates with TARGET "
        "(default: the draft's base model, e.g. the teacher of a distilled student) and the draft proposing tokens "
        "(transformers assisted generation), against TARGET alone; logs speed/spec_acceptance and "
        "speedup/spec_decode_tok_s into the draft's run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument(
        "target",
        nargs="?",
        help="an MLflow run id (from quantize), a checkpoint directory or a .gguf file (with --base); with --draft: "
        "the model to speed up (a run id, checkpoint dir or model source; default the draft's base model)",
    )
    b.add_argument("--draft", metavar="RUN_ID|DIR", help="measure speculative decoding with this draft model")
    b.add_argument("--profile", default=None, help="profiles/NAME.yaml (default: cpu-smoke)")
    engine = b.add_argument(
        "--engine",
        default=None,
        choices=engines.engine_choices(),
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
        help="with --engine serve: auto = the first server engine that serves the format here",
    )
    b.add_argument("--endpoint", help="with --engine openai: the checkpoint's endpoint, e.g. http://127.0.0.1:8000/v1")
    b.add_argument("--base-endpoint", help="with --engine openai: the base model's endpoint")
    renamed(b, "--backend", engine)


def run(args) -> int:
    if args.draft:
        if args.engine not in (None, "hf"):
            raise UserError("--draft measures in-process (transformers assisted generation); drop --engine")
        result = run_stage(
            "bench", existing.speculative, args.draft, args.target, profile=args.profile, experiment=args.experiment
        )
        if result is None:
            return 1
        print(report.metric_lines(result.metrics, 36))
    else:
        if not args.target:
            raise UserError("bench: give a run id or checkpoint directory (or --draft)")
        endpoints = (args.endpoint, args.base_endpoint) if args.engine == "openai" else None
        result = run_stage(
            "bench",
            existing.bench,
            args.target,
            profile=args.profile,
            engine=args.engine or "auto",
            server=args.server,
            base=args.base,
            experiment=args.experiment,
            endpoints=endpoints,
        )
        if result is None:
            return 1
        print(report.bench_engine(result.bench))
        print(verdict_text(result.verdict))
    print(f"mlflow run: {result.run_id}")
    return print_json(args, result.summary() | verdict_json(result.verdict))
