"""`quantbench gate`: pass/fail a candidate run against a policy; on pass register it and move an alias."""

from __future__ import annotations

from quantbench.cli.common import common, print_json, run_stage
from quantbench.jobs.pipeline import settle
from quantbench.release import gate


def add_parser(sub) -> None:
    g = sub.add_parser(
        "gate",
        parents=[common("experiment", "json")],
        help="pass/fail a candidate run against a policy; on pass register it and move an alias",
        description="Check a candidate run against a policy (policies/NAME.yaml): required stages, recovery "
        "against the baseline, absolute limits, licence. Prints every check in the run's verdict (the headline "
        "figures with their intervals, size, speed, each with the policy's limit), which also becomes the run's "
        "description in MLflow. On pass the checkpoint becomes a "
        "new version of the policy's registered model and the alias (champion) moves to it; the replaced "
        "version keeps the alias 'previous'. Exit 0 pass, 1 fail, 2 bad input.",
    )
    g.add_argument("run_id", help="the candidate's MLflow run id")
    g.add_argument("--policy", default="release", help="policies/NAME.yaml or a path (default: release)")


def run(args) -> int:
    result = run_stage("gate", gate.run, args.run_id, args.policy, experiment=args.experiment)
    if result is None:
        return 1
    found = settle(args.run_id, args.experiment, policy=args.policy, gated=True)
    print(gate.text(result, found.text(gated=True) if found is not None else None))
    print_json(args, result)
    return 0 if result["passed"] else 1
