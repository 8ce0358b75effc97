"""`quantbench gc`: end runs whose process died (SIGKILL, OOM) and remove what they left."""

from __future__ import annotations

from quantbench.cli.common import common, print_json
from quantbench.tracking import Tracker


def add_parser(sub) -> None:
    gc = sub.add_parser(
        "gc",
        parents=[common("experiment", "json")],
        help="end runs whose process died (SIGKILL, OOM) and remove what they left",
        description="Mark RUNNING runs whose owner process on this host is gone as FAILED, with the "
        "reason, and remove the staging directories they left. Every command does this for the whole "
        "store when it opens it; gc does it on demand for one experiment (--all: every experiment).",
    )
    gc.add_argument("--all", action="store_true", help="every experiment in the store, not only one")


def run(args) -> int:
    done = Tracker(args.experiment, reap=False).reap(everywhere=args.all)
    for d in done:
        print(
            f"marked FAILED: run {d['run_id']} ({d['name']}) in {d['experiment']}, owner {d['owner']} gone"
            + (f"; removed {d['removed']}" if d["removed"] else "")
        )
    if not done:
        print("nothing to collect: no RUNNING run of a dead process on this host")
    return print_json(args, {"reaped": done})
