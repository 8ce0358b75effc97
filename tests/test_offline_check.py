"""The offline GPU check on the CPU, on the node's terms (bench/gpu_check.sh --offline, docs/offline.md):
a fresh virtual environment with an older torch and transformers preinstalled, as on the node (Python
3.12 where this machine has it; torch 2.11.0, PyPI's CUDA 13.0 build, the node's own, which runs on
the CPU when no GPU is there: PyPI has no CPU build of torch for Linux x86-64), a wheelhouse planned
against that environment's own freeze list and downloaded for its Python, installed offline into a
private directory (`--no-index --no-deps --target`), and the check's CPU-possible steps run there
(`--device cpu`, budgets trimmed). ~6-8 min on 2 cores, and ~1.7 GB downloaded (torch 2.11 and its CUDA
libraries, past pip's cache: disk is short on CI machines)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.real]

ROOT = Path(__file__).resolve().parents[1]
NODE_TORCH, NODE_TRANSFORMERS = "2.11.0", "5.17.0"  # the lower end of the range quantbench supports (docs/offline.md)


def node_python() -> str:
    """The node's Python (3.12) where this machine has one that runs (a pyenv shim may not, for the
    Python pyenv has selected), else this one: the mechanics are the same."""
    candidates = [shutil.which("python3.12"), *sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))]
    for candidate in filter(None, candidates):
        if subprocess.run([str(candidate), "-c", "import venv"], capture_output=True).returncode == 0:
            return str(candidate)
    return sys.executable


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(command[:6])} ...: exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[tuple[Path, str]]:
    """A venv standing in for the node: its python and its freeze list. ~3.5 GB on disk (torch's CUDA
    libraries), removed after the test; pip's cache is not used for it (another ~1.7 GB). vLLM's own
    environment, which the run may be creating beside this (tests/conftest.py), is waited for first:
    both at once filled a CI machine's disk."""
    from filelock import FileLock

    from quantbench.engines import vllm_env

    with FileLock(vllm_env.env_dir().parent / f"{vllm_env.env_dir().name}.lock"):
        pass
    venv = tmp_path_factory.mktemp("node") / "venv"
    run([node_python(), "-m", "venv", str(venv)])
    python = str(venv / "bin" / "python")
    run([python, "-m", "pip", "install", "--quiet", "--no-cache-dir", f"torch=={NODE_TORCH}",
         f"transformers=={NODE_TRANSFORMERS}"])  # fmt: skip
    yield venv, run([python, "-m", "pip", "list", "--format=freeze"]).stdout
    shutil.rmtree(venv, ignore_errors=True)


def test_offline_check_on_an_older_torch(node, tmp_path):
    venv, freeze_text = node
    python = str(venv / "bin" / "python")
    version = run([python, "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"]).stdout.strip()
    freeze = tmp_path / "node.freeze"
    freeze.write_text(freeze_text)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    started = time.monotonic()
    house = tmp_path / "house"
    built = run(
        [sys.executable, "-m", "quantbench", "wheelhouse", "--node", str(freeze), "--python-version", version,
         "--dest", str(house), "--no-pack", "--json"],
        cwd=ROOT, env=env,
    )  # fmt: skip
    plan = json.loads(built.stdout.splitlines()[-1])
    # the node's packages are left out (its torch above all), the rest is taken for its Python
    assert "torch" not in plan["taken"] and "transformers" not in plan["taken"]
    assert {"llmcompressor", "compressed-tensors", "datasets", "pyarrow"} <= set(plan["taken"])
    assert {"pydantic", "huggingface-hub"} <= set(plan["node_has"])  # transformers 5.17 brings them
    assert all(f"cp{version.replace('.', '')}" in w or "none-any" in w or "abi3" in w for w in plan["sizes"])
    assert not [u for u in plan["unmet"] if "NOT EXPLAINED" in u], plan["unmet"]

    before = run([python, "-m", "pip", "list", "--format=freeze"]).stdout
    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "tiny.yaml").write_text(  # the fewest windows that get intervals (docs/intervals.md)
        "tokens: 2560\nwindow: 256\nood_text: null\ntasks: []\nintervals: {resamples: 200, seed: 0}\n"
    )
    offline = {
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        "PYTHON": python,
        "QUANTBENCH_OFFLINE_DIR": str(tmp_path / "offline"),
        "QUANTBENCH_SUITES": str(suites),
        "PIP_NO_INDEX": "1",  # nothing may come from an index from here on
    }
    no_gpu = subprocess.run(["bash", "bench/gpu_check.sh", "--offline", str(house)], cwd=ROOT, env=offline,
                            capture_output=True, text=True)  # fmt: skip
    assert no_gpu.returncode == 2 and "no CUDA GPU" in no_gpu.stderr
    trimmed = ["--set", "awq-int4:calibration.samples=2", "--set", "awq-int4:calibration.seq_len=64",
               "--set", "awq-int4:quantize.n_grid=3"]  # fmt: skip  (llm-compressor 0.14 divides by n_grid - 2)
    check = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--offline", str(house), "--device", "cpu", "--suite", "tiny",
         "--recipes", "fp8-dynamic", "awq-int4", *trimmed, "--figures", str(tmp_path / "none.json"),
         "--scale-layers", "1", "--awq-layers", "1", "--awq-calibration", "2x32", "--awq-grid", "3"],
        cwd=ROOT, env=offline, capture_output=True, text=True,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout[-6000:] + check.stderr[-6000:]
    summary = json.loads(check.stdout.strip().splitlines()[-1])
    assert summary["environment"]["torch"].startswith(NODE_TORCH)
    assert summary["environment"]["transformers"] == NODE_TRANSFORMERS
    assert summary["environment"]["python"].startswith(version)
    for row in summary["recipes"]:
        kld = row["metrics"]["quality/kld_mean"]
        low, high = row["metrics"]["quality/kld_mean.ci_low"], row["metrics"]["quality/kld_mean.ci_high"]
        assert 0 < low <= kld <= high < 2, row
    assert [r["recipe"] for r in summary["recipes"]] == ["fp8-dynamic", "awq-int4"]
    scale = summary["scale"]
    assert scale["W4A16 RTN"]["params"] > 1e9 and scale["AWQ W4A16"]["per_layer_s"] > 0
    assert "no serving engine here" in summary["speed"]
    for step in ("the base model", "scale: Llama-3.1-8B's shape on cpu"):
        assert "== [" in check.stdout and step in check.stdout
    # the node's own packages were not touched
    assert run([python, "-m", "pip", "list", "--format=freeze"]).stdout == before
    print(f"offline check on torch {summary['environment']['torch']}: {time.monotonic() - started:.0f} s")
