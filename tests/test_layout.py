"""The shape of the package: stages that do not know each other, one module that talks to MLflow."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "quantbench"


def imports(path: Path) -> set[str]:
    """Every module a file imports (absolute names), at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_quantize_and_evaluate_do_not_import_each_other():
    for package, other in (("quantize", "quantbench.evaluate"), ("evaluate", "quantbench.quantize")):
        for path in (SRC / package).glob("*.py"):
            bad = sorted(m for m in imports(path) if m == other or m.startswith(other + "."))
            assert bad == [], f"{path.relative_to(SRC)} imports {bad}: share it through a top-level module instead"


def test_only_tracking_talks_to_mlflow():
    for path in SRC.rglob("*.py"):
        if path.name == "tracking.py":
            continue
        bad = sorted(m for m in imports(path) if m == "mlflow" or m.startswith("mlflow."))
        assert bad == [], f"{path.relative_to(SRC)} imports {bad}: go through quantbench.tracking"
