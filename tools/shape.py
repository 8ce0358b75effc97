"""The package's shape, as `make lint` checks it (tests/test_static.py runs it too): no module
under src/quantbench over 600 lines, no function over 80, and no import inside a function but of
a heavy third-party package that LAZY_PACKAGES lists with its reason (so that `quantbench --help`
and the job modules do not load torch, transformers or MLflow), or of the few modules of
quantbench's own that LAZY_COMMANDS and LAZY_MODULES allow, with theirs.

What is over a limit today is listed in SHAPE_DEBT below with its size now: it may shrink (then
lower or drop its line), never grow, and nothing new may join it. Exit 1 naming each breach.

    python tools/shape.py            # check
    python tools/shape.py --debt     # print what is over a limit now, in SHAPE_DEBT's form
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "quantbench"
MODULE_LINES = 600
FUNCTION_LINES = 80

# Imports of quantbench's own modules that may stay inside functions, and why: the heavy ones.
# A command's module (cli/<command>.py) loads the modules of the job it runs when it runs, not when
# `quantbench --help` builds the parser (they import torch: ~2 s here; tests/cli/test_cli.py holds
# --help free of torch, transformers and MLflow).
LAZY_COMMANDS = "quantbench.cli."
LAZY_MODULES = {
    "quantbench.quantize.llmcompressor": "imports torch and llm-compressor (12 s)",
}

# Third-party packages that may be imported inside a function (by their top-level name), and why:
# what importing them costs (`python -c "import X"`, AVX512-BF16 CPU, 2 cores, warm page cache), or
# that they are optional. Anything else (the standard library, light packages such as tqdm or
# tabulate) is imported at module level.
LAZY_PACKAGES = {
    "torch": "1.8 s",
    "transformers": "1.0 s; its models pull torch",
    "tokenizers": "transformers' Rust tokenizers, 0.04 s kept off --help (sources/verify.py is on its path)",
    "llmcompressor": "torch, transformers and compressed-tensors",
    "compressed_tensors": "7 s (torch, transformers)",
    "gptqmodel": "torch; an optional quantizer",
    "lm_eval": "its evaluator pulls torch, transformers and datasets",
    "datasets": "1.1 s",
    "mlflow": "2.7 s; tracking.py alone talks to it",
    "ray": "0.9 s; optional (quantbench[ray])",
    "grpc": "Ray's; optional",
    "matplotlib": "0.3 s; plots only",
    "scipy": "0.14 s, its submodules more",
    "numpy": "0.13 s; kept off --help",
    "gguf": "0.18 s (numpy); GGUF files only",
    "httpx": "0.16 s; servers only",
    "safetensors": "its torch half imports torch",
    "huggingface_hub": "the hub only (never reached offline)",
    "loguru": "optional (llm-compressor's); 0.08 s kept off --help",
}

# "module" or "module:function" -> its size today (lines; for "module:imports", imports inside its
# functions that the LAZY lists do not allow). Shrink it as code is split; never raise a number.
SHAPE_DEBT: dict[str, int] = {
    "quantbench.cli.tune:add_parser": 108,
    "quantbench.jobs.prepare:prepare": 112,
    "quantbench.jobs.stack.command:run": 113,
    "quantbench.jobs.stack.schema:configs": 147,
    "quantbench.quantize.distill:DistillQuantizer.train": 96,
    "quantbench.release.compare": 601,
    "quantbench.release.verdict:build": 109,
    "quantbench.speed.stage:bench": 83,
    "quantbench.speed.serving:load_level": 101,
    "quantbench.tracking": 604,
    "quantbench.tune.command:_run": 135,
    "quantbench.tune.cost:get_vllm": 92,
    "quantbench.tune.plan:prepare": 122,
    "quantbench.tune.sensitivity": 648,
    "quantbench.tune.sensitivity:_fisher": 82,
}


def measure() -> dict[str, int]:
    """Everything over a limit now, keyed as SHAPE_DEBT is."""
    over: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", ".")
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MODULE_LINES:
            over[module] = lines
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if size > FUNCTION_LINES:
                    over[f"{module}:{_qualname(tree, node)}"] = size
        # an import counted once even inside nested functions: count the outermost functions' only
        inner = [
            sub
            for node in _outermost_functions(tree)
            for sub in ast.walk(node)
            if isinstance(sub, (ast.Import, ast.ImportFrom)) and not _lazy_allowed(module, sub)
        ]
        if inner:
            over[f"{module}:imports"] = len(inner)
    return over


def _lazy_allowed(module: str, node: ast.Import | ast.ImportFrom) -> bool:
    """An import inside a function that the LAZY lists allow."""
    names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
    if not _internal_import(node):
        return all(name.split(".")[0] in LAZY_PACKAGES for name in names)
    if module.startswith(LAZY_COMMANDS):
        return True
    return any(name in LAZY_MODULES for name in names)


def _internal_import(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return bool(node.level) or (node.module or "").split(".")[0] == "quantbench"
    return any(a.name.split(".")[0] == "quantbench" for a in node.names)


def _outermost_functions(tree: ast.AST):
    """Functions not inside another function (methods included)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield child
            else:
                stack.append(child)


def _qualname(tree: ast.AST, target: ast.AST) -> str:
    def walk(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if child is target:
                    return name
                found = walk(child, name + ".")
                if found:
                    return found
            else:
                found = walk(child, prefix)
                if found:
                    return found
        return None

    return walk(tree, "") or "?"


def breaches(over: dict[str, int]) -> list[str]:
    found = []
    for key, size in sorted(over.items()):
        allowed = SHAPE_DEBT.get(key)
        what = (
            "imports inside functions (not in a LAZY list)"
            if key.endswith(":imports")
            else ("lines (function)" if ":" in key else "lines (module)")
        )
        limit = 0 if key.endswith(":imports") else (FUNCTION_LINES if ":" in key else MODULE_LINES)
        if allowed is None:
            found.append(f"{key}: {size} {what}, over the limit of {limit}")
        elif size > allowed:
            found.append(f"{key}: {size} {what}, grown past its recorded {allowed} (limit {limit})")
    return found


def main(argv: list[str]) -> int:
    over = measure()
    if "--debt" in argv:
        print("SHAPE_DEBT: dict[str, int] = {")
        for key, size in sorted(over.items()):
            print(f'    "{key}": {size},')
        print("}")
        return 0
    problems = breaches(over)
    for line in problems:
        print(line)
    stale = sorted(k for k in SHAPE_DEBT if k not in over or over[k] < SHAPE_DEBT[k])
    for key in stale:
        print(f"note: {key} is now {over.get(key, 'within the limit')} (recorded {SHAPE_DEBT[key]}): lower its line")
    modules = sum(1 for k in over if ":" not in k)
    functions = sum(1 for k in over if ":" in k and not k.endswith(":imports"))
    imports = sum(v for k, v in over.items() if k.endswith(":imports"))
    print(
        f"shape: {modules} modules over {MODULE_LINES} lines, {functions} functions over {FUNCTION_LINES}, "
        f"{imports} imports inside functions outside the LAZY lists; {len(problems)} breaches"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
