"""GPTQModel quantizer on the tiny model: GPTQ and AWQ formats written by GPTQModel (the successor
of AutoGPTQ / AutoAWQ), reloaded through transformers, and bad input."""

import json
import sys
from pathlib import Path

import pytest

from quantbench.cli import main
from tests.helpers import assert_sketched, last_json, runs, tiny_recipe, write_recipe

pytestmark = pytest.mark.slow  # GPTQModel in child processes, a CPU extension compiled on first use


@pytest.fixture(scope="module")
def awq_model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """Every output width a multiple of 64 (q 128, k/v 64, MLP 256), as GPTQModel's AWQ needs."""
    from tests.conftest import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny-awq"), tiny_tokenizer, hidden_size=128, intermediate_size=256,
                      num_attention_heads=2)



@pytest.mark.parametrize(
    "method, extra, expected",
    [
        ("gptq", "desc_act: true\n", {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": True,
                                      "checkpoint_format": "gptq"}),
        ("awq", "", {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}),
    ],
)
def test_gptqmodel_formats_quantize_save_and_reload(workdir, tiny_model_dir, awq_model_dir, capsys, method, extra, expected):
    """Saved in bfloat16 both; GPTQ computed in float32 (what an AVX2-only CPU computes in; AWQ's
    kernels refuse it and compute in what they save)."""
    model = awq_model_dir if method == "awq" else tiny_model_dir
    body = tiny_recipe(model, f"method: {method}\nformat: {method}\ngroup_size: 32\n{extra}")
    compute = "" if method == "awq" else "\n  compute_dtype: float32"
    write_recipe(workdir, "g", body.replace("dtype: float32", "dtype: bfloat16" + compute))
    assert main(["quantize", "g", "--json"]) == 0, capsys.readouterr().err[-3000:]
    result = last_json(capsys.readouterr().out)
    ckpt = Path(result["checkpoint"])
    config = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    for key, value in expected.items():
        assert config[key] == value, (key, config)
    assert_sketched(workdir / "recipes" / "g.yaml", config)
    from safetensors import safe_open

    with safe_open(ckpt / "model.safetensors", "pt") as f:
        names = set(f.keys())
        dtypes = {name.rsplit(".", 1)[1]: f.get_slice(name).get_dtype() for name in names}
    assert "model.layers.0.mlp.down_proj.qweight" in names and "model.layers.0.mlp.down_proj.scales" in names
    assert "lm_head.qweight" not in names  # ignore: [lm_head]
    assert dtypes["weight"] == "BF16" and dtypes["qweight"] == "I32"  # embeddings and norms in the recipe's dtype
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == "bfloat16"
    m = result["metrics"]
    assert m["check/ppl_ratio"] < 1.3  # scored from the checkpoint reloaded from disk through transformers
    [run] = runs()
    assert run.info.status == "FINISHED" and run.data.tags["quantbench.format"] == method
    # what GPTQModel computed in: GPTQ the job's compute dtype; AWQ (kernels that refuse float32) the
    # saved dtype, whatever this CPU's compute dtype is
    assert run.data.tags["quantbench.compute_dtype"] == ("float32" if method == "gptq" else "bfloat16")
    assert "gptqmodel" in run.data.tags["quantbench.loaders"] and "vLLM" in run.data.tags["quantbench.loaders"]
    card = (ckpt / "README.md").read_text()
    assert f"Format: {method}" in card


@pytest.mark.parametrize(
    "quantize, expected",
    [
        ("method: gptq\nformat: gptq\ngroup_size: 64\n", "quantize.group_size (line 11): 64 does not divide the input width"),
        ("method: awq\nformat: gptq\n", "quantize.format (line 10): unknown value 'gptq'. Available: awq, compressed-tensors"),
        ("method: gptq\nformat: gptq\ngroup_size: 32\nkv_cache: fp8\n", "kv_cache: fp8 needs format compressed-tensors"),
        ("method: awq\nformat: awq\ngroup_size: 32\n", "model.dtype (line 3): GPTQModel's AWQ kernels run in bfloat16"),
        ("method: gptq\ngroup_size: 32\ndesc_act: true\n", "desc_act applies to format gptq (GPTQModel) only; this "
         "recipe's format is compressed-tensors"),
        ("method: awq\nformat: awq\nn_grid: 10\n", "n_grid applies to format compressed-tensors (llm-compressor) only"),
    ],
)
def test_bad_gptqmodel_recipes_are_rejected(workdir, tiny_model_dir, capsys, quantize, expected):
    write_recipe(workdir, "g", tiny_recipe(tiny_model_dir, quantize))
    assert main(["quantize", "g"]) == 2
    assert expected in capsys.readouterr().err
    assert runs() == [] and not (workdir / "outputs").exists()


def test_awq_format_needs_output_widths_in_blocks_of_64(workdir, tiny_model_dir, capsys):
    body = tiny_recipe(tiny_model_dir, "method: awq\nformat: awq\ngroup_size: 32\n").replace("dtype: float32", "dtype: bfloat16")
    write_recipe(workdir, "g", body)
    assert main(["quantize", "g"]) == 2
    err = capsys.readouterr().err
    assert "quantize.format (line 10): GPTQModel's AWQ needs every quantized layer's output width to be a multiple of 64" in err
    assert "output width 32 (4 layers, e.g. model.layers.0.self_attn.k_proj); output width 96 (" in err
    assert runs() == []


def test_missing_gptqmodel_is_named(workdir, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "gptqmodel", None)  # how a missing package looks to Python's import system
    monkeypatch.delitem(sys.modules, "quantbench.quantize.gptqmodel", raising=False)
    write_recipe(workdir, "g", tiny_recipe(tiny_model_dir, "method: gptq\nformat: gptq\ngroup_size: 32\n"))
    assert main(["quantize", "g"]) == 2
    err = capsys.readouterr().err
    assert "quantize.method: 'gptq' with format 'gptq' needs the package 'gptqmodel', which is not installed" in err
    assert runs() == []
