"""`quantbench sweep`: run many recipes (a list and/or a matrix of overrides); resumable, with timeouts
and retries."""

from __future__ import annotations

from quantbench.cli.common import common, print_json, run_stage
from quantbench.jobs import sweep


def add_parser(sub) -> None:
    s = sub.add_parser(
        "sweep",
        parents=[common("experiment", "outputs", "json")],
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


def run(args) -> int:
    result = run_stage(
        "sweep", sweep.run, args.sweep, force=args.force, outputs=args.outputs, experiment=args.experiment, ray=args.ray
    )
    if result is None:
        return 1
    print(result["table"])
    print_json(args, result)
    return 0 if result["counts"]["failed"] == 0 else 1
