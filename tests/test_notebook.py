"""notebooks/tradeoffs.ipynb: committed without outputs, and executed (nbclient, a real kernel)
against the real runs the tests made, after one of them was gated."""

import json
from pathlib import Path

import nbformat
import pytest
import yaml
from nbclient import NotebookClient

from quantbench.cli import main

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "tradeoffs.ipynb"


def test_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


@pytest.mark.slow
def test_notebook_executes_against_the_store(workdir, scored_runs, monkeypatch, capsys):
    (workdir / "policies").mkdir()
    (workdir / "policies" / "nb.yaml").write_text(yaml.safe_dump(
        {"max": {"quality/kld_mean": 100.0}, "registry": {"model": "tiny-notebook", "alias": "champion"}}))
    assert main(["gate", scored_runs["gptq"], "--policy", "nb"]) == 0
    capsys.readouterr()

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", scored_runs["experiment"])  # the kernel inherits the env
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}).execute()

    texts, images = [], 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            assert output.output_type != "error", output
            data = output.get("data", {})
            images += "image/png" in data
            texts.append(output.get("text", "") + data.get("text/plain", "") + data.get("text/html", ""))
    text = "\n".join(texts)
    assert images == 1 and (workdir / "outputs" / "notebooks" / "tradeoffs.png").is_file()
    assert scored_runs["gptq"][:8] in text and scored_runs["fp8"][:8] in text
    assert "nb: pass" in text and "tiny-notebook@champion" in text
    assert "★" in text and "quality/kld_mean" in text
    (workdir / "executed.ipynb").write_text(json.dumps(nb))  # kept with the test's tmp dir for a look


@pytest.mark.slow
def test_make_notebook_puts_the_plot_where_it_says(workdir, scored_runs, tmp_path):
    """`make notebook` runs the notebook from a copy in another folder: the plot must land where the
    target prints it is, not relative to the copy's folder."""
    import os
    import subprocess

    repo = NOTEBOOK.parents[1]
    out = tmp_path / "nb-out"
    env = {**os.environ, "MLFLOW_TRACKING_URI": scored_runs["tracking_uri"], "MLFLOW_EXPERIMENT_NAME": scored_runs["experiment"]}
    proc = subprocess.run(["make", "-C", str(repo), "-o", ".venv/.installed", "notebook", f"NOTEBOOK_OUT={out}"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"(plot: {out}/tradeoffs.png)" in proc.stdout
    assert (out / "tradeoffs.png").stat().st_size > 10_000 and (out / "tradeoffs.ipynb").is_file()
    assert not (out / "outputs").exists() and not (repo / "outputs" / "notebooks" / "outputs").exists()
