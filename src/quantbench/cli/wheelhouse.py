"""`quantbench wheelhouse`: the wheels an offline GPU node lacks, for its Python and platform, planned
from its `pip list --format=freeze`, downloaded and packed to carry (core/wheelhouse.py, docs/offline.md)."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

from quantbench.cli.common import common
from quantbench.core import wheelhouse


def add_parser(sub) -> None:
    p = sub.add_parser(
        "wheelhouse",
        parents=[common("json")],
        help="download the wheels an offline GPU node lacks (from its pip freeze) and pack them to carry",
    )
    p.add_argument("--node", type=Path, default=Path("bench/offline/h200.freeze"), help="the node's pip freeze")
    p.add_argument("--dest", type=Path, default=Path("outputs/wheelhouse"), help="where the wheels go")
    p.add_argument("--python-version", help="the node's Python (X.Y); default: the freeze's header")
    p.add_argument("--constraints", type=Path, default=Path("constraints.txt"), help="the versions to take")
    p.add_argument("--plan-only", action="store_true", help="print the plan; download nothing")
    p.add_argument("--no-pack", action="store_true", help="leave the wheels unpacked (no .tar.xz)")
    p.add_argument(
        "--figures", type=Path, default=Path("bench/offline/cpu_figures.json"), help="the CPU figures to carry"
    )


def run(args) -> int:
    declared = [r.split(";")[0].split("[")[0].split("=")[0].split("<")[0].split(">")[0].strip()
                for r in metadata.requires("quantbench") or []]  # fmt: skip
    if args.plan_only:
        node = wheelhouse.read_freeze(args.node)
        if args.python_version:
            node = wheelhouse.Node(node.packages, args.python_version, node.platforms, node.source)
        plan = wheelhouse.make_plan(node, wheelhouse.read_pins(args.constraints), declared)
    else:
        extra = [args.figures] if args.figures.is_file() else []
        plan = wheelhouse.build(
            args.node,
            args.constraints,
            args.dest,
            python=args.python_version,
            declared=declared,
            extra=extra,
            pack_it=not args.no_pack,
        )
    if args.json:
        print(json.dumps(plan.as_dict()))
    else:
        print(wheelhouse.report(plan))
        if not args.plan_only:
            print(
                f"\nin {args.dest}/ (wheels/, model/, plan.json); carry it and run: bash bench/gpu_check.sh --offline DIR"
            )
    return 0
