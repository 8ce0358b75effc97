"""The package's shape, as `make lint` checks it (tests/test_static.py runs it too): no module
under src/quantbench over 600 lines, no function over 80, and no import inside a function but of
a heavy third-party package that LAZY_PACKAGES lists with its reason (so that `quantbench --help`,
which imports every command's module and through them the job modules, loads no torch,
transformers or MLflow). quantbench's own modules are imported at the top, always. Exit 1 naming
each breach.

    python tools/shape.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "quantbench"
MODULE_LINES = 600
FUNCTION_LINES = 80

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


def measure() -> dict[str, int]:
    """Everything over a limit: "module" and "module:function" -> lines, "module:imports" -> imports
    inside its functions that LAZY_PACKAGES does not allow."""
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
            if isinstance(sub, (ast.Import, ast.ImportFrom)) and not _lazy_allowed(sub)
        ]
        if inner:
            over[f"{module}:imports"] = len(inner)
    return over


def _lazy_allowed(node: ast.Import | ast.ImportFrom) -> bool:
    """An import inside a function that LAZY_PACKAGES allows."""
    names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
    return not _internal_import(node) and all(name.split(".")[0] in LAZY_PACKAGES for name in names)


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
        if key.endswith(":imports"):
            found.append(f"{key}: {size} imports inside functions (of ours, or not in LAZY_PACKAGES), over the limit of 0")
        elif ":" in key:
            found.append(f"{key}: {size} lines (function), over the limit of {FUNCTION_LINES}")
        else:
            found.append(f"{key}: {size} lines (module), over the limit of {MODULE_LINES}")
    return found


def main(argv: list[str]) -> int:
    problems = breaches(measure())
    for line in problems:
        print(line)
    print(
        f"shape: {len(problems)} breaches (modules over {MODULE_LINES} lines, functions over {FUNCTION_LINES}, "
        "imports inside functions outside LAZY_PACKAGES)"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
