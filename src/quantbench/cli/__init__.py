"""The `quantbench` command: one module per subcommand (`add_parser` and `run`), registered in
COMMANDS in the order `--help` lists them; argument parsing only, the work is done below cli/."""

from __future__ import annotations

import argparse
import os
import sys

from quantbench.cli import (
    bench,
    compare,
    doctor,
    evaluate,
    gate,
    gc,
    noise,
    quantize,
    recipes,
    stack,
    sweep,
    tune,
    ui,
    validate,
    wheelhouse,
)
from quantbench.core.errors import UserError
from quantbench.core.logs import configure_console

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
  quantbench wheelhouse                             the wheels an offline GPU node lacks, packed to carry

exit codes: 0 ok, 1 the job failed (see its log) or the gate failed, 2 bad input (nothing was written),
  130 interrupted (Ctrl-C, SIGTERM: the run is marked KILLED, a quantize job leaves no checkpoint)
tracking: MLFLOW_TRACKING_URI (default sqlite:///mlflow.db here; artifacts in mlruns/ beside a SQLite store)
"""


# --help lists the commands in this order
COMMANDS = {
    "quantize": quantize,
    "evaluate": evaluate,
    "bench": bench,
    "compare": compare,
    "noise": noise,
    "gate": gate,
    "sweep": sweep,
    "stack": stack,
    "tune": tune,
    "validate": validate,
    "recipes": recipes,
    "doctor": doctor,
    "gc": gc,
    "ui": ui,
    "wheelhouse": wheelhouse,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quantbench",
        description="Quantize models from recipe files, check the checkpoints, track everything in MLflow.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="debug logging, and every library's own output on the terminal too (without it, libraries' INFO "
        "and WARNING lines, bars and prints go to the run's log file only)",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="a failed stage's traceback on the terminal too (it is always in the run's log file); "
        "also QUANTBENCH_DEBUG=1",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    configure_console(args.verbose)
    if args.debug:
        os.environ["QUANTBENCH_DEBUG"] = "1"  # child processes (sweep and tune jobs) inherit it
    try:
        return COMMANDS[args.command].run(args)
    except UserError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
