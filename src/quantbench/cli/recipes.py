"""`quantbench recipes`: list the shipped recipes."""

from __future__ import annotations

import json

from quantbench.cli.common import common
from quantbench.core.errors import UserError
from quantbench.recipe import available_recipes, load_recipe, recipes_dir


def add_parser(sub) -> None:
    sub.add_parser("recipes", parents=[common("json")], help="list the shipped recipes")


def run(args) -> int:
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
