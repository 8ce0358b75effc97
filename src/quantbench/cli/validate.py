"""`quantbench validate`: validate recipe files, reporting every error at once."""

from __future__ import annotations

import sys
from pathlib import Path

from quantbench.cli.common import common, print_json
from quantbench.core.errors import UserError
from quantbench.jobs.prepare import check_without_model
from quantbench.recipe import RecipeError, load_recipe, recipes_dir


def add_parser(sub) -> None:
    v = sub.add_parser(
        "validate",
        parents=[common("experiment", "json")],
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


def run(args) -> int:
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
            found = found + check_without_model(loaded, args.experiment, invalid)
        if found:
            problems[str(path)] = found
    for path in files:
        if str(path) in problems:
            for line in problems[str(path)]:
                print(f"error: {line}", file=sys.stderr)
        else:
            print(f"ok: {path}")
    print_json(args, {"ok": not problems, "files": [str(f) for f in files], "problems": problems})
    return 2 if problems else 0
