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


def execute(workdir: Path) -> tuple:
    """The notebook run by a real kernel in `workdir`: (the executed notebook, the text of every
    output, how many images), no cell having failed."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}).execute()
    texts, images = [], 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            assert output.output_type != "error", output
            data = output.get("data", {})
            images += "image/png" in data
            texts.append(output.get("text", "") + data.get("text/plain", "") + data.get("text/html", ""))
    return nb, "\n".join(texts), images


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
    nb, text, images = execute(workdir)
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


@pytest.mark.slow  # the real llama.cpp (llama-quantize), a stack measured in-process, a real kernel
@pytest.mark.llamacpp
def test_a_gguf_candidate_and_a_stack_ledger_show_in_the_notebook(workdir, tiny_model_dir, tmp_path_factory,
                                                                  monkeypatch, capsys):
    """A GGUF checkpoint is a candidate like any other (its format a column), and the experiment's
    stack runs show as their ledger, step by step, with the newest one's waterfall chart."""
    from tests import gguf_files as gg
    from tests.helpers import last_json, write_recipe

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "notebook-gguf-stack")
    source = gg.write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", gg.gpt2_bpe_vocab(400, add_bos=False))
    write_recipe(workdir, "tiny-q8", f"model:\n  source: {source}\n  dtype: float32\nquantize:\n  method: gguf\n"
                 "  type: Q8_0\ncheck:\n  base_ppl_bound: false\n  ppl_tokens: 512\n  window: 128\n")  # fmt: skip
    assert main(["quantize", "tiny-q8", "--json"]) == 0, capsys.readouterr().err[-3000:]
    gguf_run = last_json(capsys.readouterr().out)["run_id"]
    (workdir / "stacks").mkdir()
    (workdir / "stacks" / "tiny.yaml").write_text(
        f"base: {tiny_model_dir}\nworkload:\n  prompt_tokens: 16\n  output_tokens: 4\n  requests: 2\n"
        "  repetitions: 3\n  warmup: 0\nsteps:\n  - {name: naive, engine: hf, dtype: float32}\n"
        "  - {name: batched, concurrency: 2}\n")  # fmt: skip
    assert main(["stack", "tiny", "--json"]) == 0, capsys.readouterr().err[-3000:]
    ledger = last_json(capsys.readouterr().out)

    _, text, images = execute(workdir)
    assert gguf_run[:8] in text and "tags.quantbench.format" in text and "gguf" in text
    # the ledger: each step's row with this stack's own cumulative multiplier; the waterfall chart
    for step in ledger["steps"]:
        assert f"| {step['step']}" in text and f"{step['cumulative']:.2f}×" in text
    assert f"tiny ({ledger['run_id'][:8]}): last step over the first, measured directly" in text
    assert images == 2 and (workdir / "outputs" / "notebooks" / "stack_waterfall.png").stat().st_size > 10_000
