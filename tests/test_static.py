"""Static checks in the fast tier, as `make lint` runs them (configured in pyproject.toml): ruff
over src/, tests/ and bench/, ruff's formatter's check over src/, mypy over src/ and bench/, import-linter's
contracts (the layers from cli down to core; only quantbench.tracking imports mlflow; no import cycles
between sibling modules), tools/shape.py (module and function length, imports inside functions); and that mypy's settings still catch
an import of a name a quantbench module no longer has (what shipped `tune.py` importing the
removed `vllm_python`), and type mismatches in the packages checked in full (core, engines, quantize, recipe)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tool(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m TOOL ARGS` from this environment in the repository root (where its settings are)."""
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_ruff_is_clean():
    done = tool("ruff", "check", "src", "tests", "bench")
    assert done.returncode == 0, done.stdout + done.stderr


def test_src_is_formatted():
    done = tool("ruff", "format", "--check", "src")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_is_clean():
    done = tool("mypy")  # the files pyproject.toml names: src/ and bench/
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_catches_an_import_of_a_removed_name(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def bench_backend() -> str:\n"
        "    from quantbench.speed.serving import vllm_python\n\n"
        "    return 'serve' if vllm_python() else 'hf'\n"
    )
    done = tool("mypy", "src", str(probe))
    assert done.returncode == 1, done.stdout + done.stderr
    # the file's name only: mypy's cache may replay the error under the path an earlier run's probe had
    [error, count] = done.stdout.splitlines()
    assert error.endswith(
        'probe.py:2: error: Module "quantbench.speed.serving" has no attribute "vllm_python"  [attr-defined]'
    ) and count.startswith("Found 1 error in 1 file"), done.stdout


def test_mypy_checks_types_in_core_engines_quantize_and_recipe_only_so_far(tmp_path):
    """pyproject.toml turns every error code on for quantbench.core, .engines, .quantize and .recipe:
    the same mismatch is an error there and not (yet) in another package."""
    checked = ("core", "engines", "quantize", "recipe")
    for package in (*checked, "jobs"):
        (tmp_path / "quantbench" / package).mkdir(parents=True)
        (tmp_path / "quantbench" / package / "__init__.py").write_text("")
        (tmp_path / "quantbench" / package / "probe.py").write_text('def width() -> int:\n    return "576"\n')
    (tmp_path / "quantbench" / "__init__.py").write_text("")
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "quantbench"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    errors = sorted(line.split(":")[0] for line in done.stdout.splitlines() if ": error:" in line)
    assert errors == [f"quantbench/{p}/probe.py" for p in checked], done.stdout + done.stderr
    assert "[return-value]" in done.stdout


def test_import_contracts_are_kept():
    """lint-imports reads the package it imports: this tree's src/, whatever the environment installed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports"))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "Contracts: 5 kept, 0 broken." in done.stdout, done.stdout + done.stderr


def test_the_package_keeps_its_shape():
    """tools/shape.py: no module over 600 lines, no function over 80, no import inside a function but
    of a heavy package it lists."""
    done = subprocess.run([sys.executable, "tools/shape.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_shape_check_catches_a_long_module_and_an_inner_import(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import shape
    finally:
        sys.path.pop(0)
    package = tmp_path / "quantbench"
    package.mkdir()
    body = "def f():\n    from quantbench import core\n\n    return core\n"
    (package / "long.py").write_text(body + "x = 1\n" * 600)
    # no module of ours is let off: not a command's module loading its job, not a heavy module
    (package / "cli").mkdir()
    (package / "cli" / "job.py").write_text("def run():\n    from quantbench.jobs import pipeline\n")
    (package / "heavy.py").write_text("def f():\n    from quantbench.quantize.llmcompressor import oneshot\n")
    # a heavy third-party package may be imported lazily; the standard library and light ones may not
    (package / "lazy.py").write_text("def f():\n    import torch\n    from transformers import AutoConfig\n")
    (package / "light.py").write_text("def f():\n    import json\n\n\ndef g():\n    import torch, tqdm\n")
    monkeypatch.setattr(shape, "PACKAGE", package)
    over = shape.measure()
    assert over == {
        "quantbench.long": 604,
        "quantbench.long:imports": 1,
        "quantbench.light:imports": 2,
        "quantbench.cli.job:imports": 1,
        "quantbench.heavy:imports": 1,
    }
    assert shape.breaches(over) == [
        "quantbench.cli.job:imports: 1 imports inside functions (of ours, or not in LAZY_PACKAGES), over the limit of 0",
        "quantbench.heavy:imports: 1 imports inside functions (of ours, or not in LAZY_PACKAGES), over the limit of 0",
        "quantbench.light:imports: 2 imports inside functions (of ours, or not in LAZY_PACKAGES), over the limit of 0",
        "quantbench.long: 604 lines (module), over the limit of 600",
        "quantbench.long:imports: 1 imports inside functions (of ours, or not in LAZY_PACKAGES), over the limit of 0",
    ]
