"""A mixture of experts end to end on tiny random models: quantized (calibration reaching every
expert, said on the card), reloaded whole and checked; a checkpoint that reloads with its experts
missing refused by the reload check; llama.cpp converting and serving one (llamacpp tier)."""

import json
from pathlib import Path

import pytest

from quantbench.cli import main
from tests.helpers import last_json, runs, tiny_recipe, write_recipe

pytestmark = pytest.mark.slow  # quantize jobs on models of a few million parameters (~15-40 s each)


def build_moe(path: Path, tokenizer, kind: str = "qwen3_moe", vocab: int = 512) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    experts = {"qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 64, "head_dim": 32},
               "mixtral": {"num_local_experts": 4}}[kind]
    config = AutoConfig.for_model(kind, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=2, num_experts_per_tok=2,
                                  vocab_size=vocab, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                                  pad_token_id=2, tie_word_embeddings=False, **experts)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "README.md").write_text("---\nlicense: mit\n---\n# tiny mixture of experts\n")
    return path


def test_a_mixture_of_experts_quantizes_with_every_expert_calibrated_and_reloads_whole(
        workdir, tmp_path, tiny_tokenizer, capsys):
    moe = build_moe(tmp_path / "qwen3moe", tiny_tokenizer)
    write_recipe(workdir, "moe-gptq", tiny_recipe(moe, "method: gptq\ngroup_size: 32\nignore: [lm_head, 're:.*mlp.gate$']\n"))
    assert main(["quantize", "moe-gptq", "--json"]) == 0, capsys.readouterr().err
    result = last_json(capsys.readouterr().out)
    checkpoint = Path(result["checkpoint"])
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        packed = [k for k in f.keys() if ".experts." in k and k.endswith("weight_packed")]
    assert len(packed) == 2 * 4 * 3  # every expert's three matrices of both layers, quantized
    card = (checkpoint / "README.md").read_text()
    assert "- Experts: all 4 experts of every layer calibrated on all 256 calibration tokens" in card  # 4 x 64
    assert result["metrics"]["check/ppl_ratio"] < 1.2
    [run] = runs()
    assert run.info.status == "FINISHED"


def test_asymmetric_experts_are_refused_before_calibrating_and_symmetric_ones_reload(
        workdir, tmp_path, tiny_tokenizer, capsys):
    """AWQ's default grid is asymmetric (a zero point per group): transformers 5 cannot reload such
    experts (its fused-experts conversion fails on their zero points; measured on the size ladder's
    MoE rung after minutes of calibration). Refused before the run, naming the setting; with
    symmetric: true the same AWQ job reloads whole."""
    moe = build_moe(tmp_path / "qwen3moe", tiny_tokenizer)
    section = "method: awq\ngroup_size: 32\nn_grid: 4\nignore: [lm_head, 're:.*mlp.gate$']\n"
    write_recipe(workdir, "moe-awq", tiny_recipe(moe, section))
    assert main(["quantize", "moe-awq"]) == 2
    err = capsys.readouterr().err
    err = " ".join(err.split())  # the message as one line, however the terminal folds it
    assert "quantize.symmetric" in err and "false (zero points) on a mixture of experts" in err, err[-600:]
    assert "set quantize.symmetric: true" in err
    assert runs() == [] and not (workdir / "outputs" / "moe-awq").exists()
    write_recipe(workdir, "moe-awq", tiny_recipe(moe, section + "symmetric: true\n"))
    assert main(["quantize", "moe-awq", "--json"]) == 0, capsys.readouterr().err[-3000:]
    result = last_json(capsys.readouterr().out)
    assert result["metrics"]["check/ppl_ratio"] < 1.3
    [run] = runs()
    assert run.info.status == "FINISHED"


def test_a_checkpoint_whose_experts_do_not_reload_is_refused(workdir, tmp_path, tiny_tokenizer, capsys):
    """Mixtral's layout through llm-compressor 0.14 and transformers 5.17: the compressed experts are
    saved under names transformers does not map back, so they reload at random. The perplexity of a
    random tiny model cannot tell; the reload check's loading report does."""
    moe = build_moe(tmp_path / "mixtral", tiny_tokenizer, "mixtral")
    write_recipe(workdir, "moe-rtn", tiny_recipe(moe, "method: rtn\ngroup_size: 32\nignore: [lm_head, 're:.*gate$']\n"))
    assert main(["quantize", "moe-rtn"]) == 1
    err = capsys.readouterr().err
    assert "the saved checkpoint does not load whole:" in err and "of the model's weights are not in the files" in err
    [run] = runs()
    assert run.info.status == "FAILED" and not (workdir / "outputs" / "moe-rtn" / run.info.run_id).exists()


@pytest.mark.llamacpp
def test_llama_cpp_converts_a_mixture_of_experts_and_a_tokenizer_it_changes_is_refused(workdir, tmp_path, capsys):
    """llama.cpp's converter writes the mixture of experts (Qwen3-MoE layout) as a GGUF; quantbench then
    reads it back through transformers, whose GGUF reader maps a qwen3moe file's vocabulary with
    Qwen's own conventions: with SmolLM2's tokenizer on this layout the tokens differ, so the GGUF is
    not the same model and the job is refused before any run, naming the first token that differs. A
    real Qwen3-MoE, with Qwen's tokenizer, is what that mapping is for (not reachable offline here)."""
    from transformers import AutoTokenizer

    from quantbench.sources import models

    tokenizer = AutoTokenizer.from_pretrained(models.resolve("builtin:smollm2-135m-instruct").path)
    moe = build_moe(tmp_path / "qwen3moe", tokenizer, vocab=len(tokenizer))
    write_recipe(workdir, "moe-q8", tiny_recipe(moe, "method: gguf\ntype: Q8_0\n"))
    assert main(["quantize", "moe-q8"]) == 2
    err = capsys.readouterr().err
    assert "its tokenizer does not reproduce" in err and "llama.cpp's converter wrote another vocabulary" in err
    assert runs() == [] and not (workdir / "outputs").exists()
