"""`quantbench compare`: one table of candidates with the quality-vs-speed Pareto frontier; Markdown,
HTML, PNG."""

from __future__ import annotations

from quantbench.cli.common import common, print_json, run_stage
from quantbench.release import compare


def add_parser(sub) -> None:
    c = sub.add_parser(
        "compare",
        parents=[common("experiment", "outputs", "json")],
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


def run(args) -> int:
    result = run_stage(
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
    return print_json(args, result.summary())
