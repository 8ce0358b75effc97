"""A mixture of experts end to end on tiny random models: quantized (calibration reaching every
expert, said on the card), reloaded whole and checked; a checkpoint that reloads with its experts
missing refused by the reload check; llama.cpp converting and serving one (llamacpp tier)."""

import json
from pathlib import Path

import pytest

from quantbench.cli import main
from quantbench.sources import data
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
def test_llama_cpp_quantizes_a_mixture_of_experts_into_mxfp4_moe_and_serves_it(workdir, tmp_path, capsys):
    """llama.cpp's converter writes the mixture of experts (a Qwen3-MoE layout with SmolLM2's tokenizer)
    as a GGUF whose tokenizer.ggml.pre says "smollm"; transformers' GGUF reader would split its text as
    Qwen's ("\\n\\n" one token where the model has two), quantbench's as llama.cpp does, so the file is
    the same model and is kept. MXFP4_MOE rounds the experts' 3-D tensors to MXFP4 and every other
    tensor to Q8_0; transformers reloads it de-quantized and llama-server serves it on this CPU."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from quantbench.sources import models
    from quantbench.sources.verify import gguf_tokenizer
    from tests.conftest import TINY_PROFILE
    from tests.engines.test_llamacpp import llama_servers

    tokenizer = AutoTokenizer.from_pretrained(models.resolve("builtin:smollm2-135m-instruct").path)
    moe = build_moe(tmp_path / "qwen3moe", tokenizer, vocab=len(tokenizer))
    (workdir / "profiles").mkdir()
    (workdir / "profiles" / "tiny.yaml").write_text(TINY_PROFILE)
    write_recipe(workdir, "moe-mxfp4", tiny_recipe(moe, "method: gguf\ntype: MXFP4_MOE\n")
                 + "bench:\n  profile: tiny\n  engine: llamacpp\n")  # fmt: skip
    assert main(["quantize", "moe-mxfp4", "--json"]) == 0, capsys.readouterr().err[-3000:]
    checkpoint = Path(last_json(capsys.readouterr().out)["checkpoint"])
    gguf = checkpoint / "model.gguf"
    types = {t.name: t.tensor_type.name for t in GGUFReader(gguf).tensors}
    experts = {n: t for n, t in types.items() if "_exps." in n}
    assert len(experts) == 2 * 3 and set(experts.values()) == {"MXFP4"}  # gate, up, down of 2 layers
    assert {t for n, t in types.items() if n.startswith("blk.") and n.endswith("attn_q.weight")} == {"Q8_0"}
    assert "\n\n" in data.python_docs("evaluation")[:4000]
    sample = "Returns\n\nThe value 2026 of x\n"
    assert gguf_tokenizer(gguf)(sample)["input_ids"] == tokenizer(sample)["input_ids"]
    [run] = runs()
    m, tags = run.data.metrics, run.data.tags
    assert run.info.status == "FINISHED"
    # the experts are nearly all the weights of this tiny model: 4.25 bits there, 8.5 elsewhere
    assert 4.25 < m["model/bits_per_weight"] < 8.5
    assert m["check/ppl_ratio"] == pytest.approx(1, abs=0.05)  # a random model: ~its vocabulary's size either way
    assert tags["quantbench.bench_server"] == "llamacpp"
    assert m["speed/c1/throughput_tok_s"] > 0 and m["base_speed/c1/throughput_tok_s"] > 0
    assert llama_servers() == []
