"""Helpers for tests: recipe files on the tiny model, reading MLflow directly."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import psutil

OWNER = "QUANTBENCH_TEST_OWNER"


def ours(procs) -> list:
    """Of `procs` (psutil processes), those that run and were started from this test process, directly
    or through a command it ran: their environment carries its QUANTBENCH_TEST_OWNER (tests/conftest.py)."""
    found = []
    for proc in procs:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(OWNER) == os.environ[OWNER]:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass  # gone meanwhile
    return found


def write_recipe(workdir: Path, name: str, body: str) -> Path:
    path = workdir / "recipes" / f"{name}.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def tiny_recipe(model_dir: Path, quantize: str, calibration: str = "") -> str:
    """A recipe on the tiny model with a budget of seconds."""
    return f"""\
model:
  source: {model_dir}
  dtype: float32
calibration:
  samples: 4
  seq_len: 64
{textwrap.indent(textwrap.dedent(calibration), '  ')}
quantize:
{textwrap.indent(textwrap.dedent(quantize), '  ')}
check:
  ppl_tokens: 512
  window: 64
  generate_tokens: 4
"""


def runs(experiment: str | None = None):
    """Every run of the test's experiment (tests may read MLflow directly)."""
    from quantbench.tracking import _client

    client = _client()  # under the store-creation lock: a job may be creating the store right now
    exp = client.get_experiment_by_name(experiment or os.environ["MLFLOW_EXPERIMENT_NAME"])
    return [] if exp is None else client.search_runs([exp.experiment_id])


def last_json(out: str) -> dict:
    """The JSON summary a command prints as its last line (`--json`)."""
    return json.loads(out.strip().splitlines()[-1])


def verdict_rows(out: str) -> dict[str, list[str]]:
    """The verdict table a command printed (release/verdict.py): figure -> its other cells (value,
    95% interval, the policy's limit, result), as a reader sees them."""
    import re

    lines = out.split("verdict: ", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("-----")) + 1
    rows = {}
    for line in lines[start:]:
        if not line.strip() or line.startswith(" "):
            break
        cells = re.split(r" {2,}", line.rstrip())
        rows[cells[0]] = cells[1:]
    return rows


def assert_sketched(recipe: Path, written: dict | None) -> None:
    """The quantization_config the recipe's quantizer said its checkpoint would carry (what the bench
    engine is chosen by before the job) agrees with the one written: every key it names has the
    written value (a None: absent or null there)."""
    from quantbench.quantize import make_quantizer
    from quantbench.recipe import load_recipe

    sketch = make_quantizer(load_recipe(recipe).recipe.quantize).quantization_config()

    def agree(said, got, where: str) -> None:
        if isinstance(said, dict):
            assert isinstance(got, dict), (where, said, got)
            for key, value in said.items():
                agree(value, got.get(key), f"{where}.{key}")
        else:
            assert said == got, (where, said, got)

    agree(sketch, written, "quantization_config")
