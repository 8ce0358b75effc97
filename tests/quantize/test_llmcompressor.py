"""The narrow CPU patch for AWQ, guarded against the library changing under it."""

import inspect
from pathlib import Path

import pytest
import torch

from quantbench.quantize.llmcompressor import cpu_safe_pinning

no_accelerator = pytest.mark.skipif(torch.accelerator.is_available(), reason="the patch only acts without an accelerator")


def _cache_with_one_tensor():
    from llmcompressor.pipelines.cache import IntermediatesCache

    cache = IntermediatesCache.empty(1, torch.device("cpu"))
    cache.update(0, {"hidden": torch.ones(4)})
    return cache


def test_awq_still_pins_its_cache_in_the_place_we_patch():
    from llmcompressor.modifiers.transform import AWQModifier

    assert "cache.pin_memory(" in inspect.getsource(AWQModifier._apply_smoothing)


@no_accelerator
def test_pinning_still_fails_without_an_accelerator():
    """If this starts passing, llm-compressor fixed it: remove cpu_safe_pinning."""
    with pytest.raises(RuntimeError, match="accelerator"):
        _cache_with_one_tensor().pin_memory(0)


@no_accelerator
def test_patch_makes_pinning_a_noop_only_inside_the_block():
    from llmcompressor.pipelines.cache import IntermediatesCache

    original = IntermediatesCache.pin_memory
    cache = _cache_with_one_tensor()
    with cpu_safe_pinning():
        cache.pin_memory(0)
        assert torch.equal(cache.fetch(0)["hidden"], torch.ones(4))
    assert IntermediatesCache.pin_memory is original


def test_the_same_recipe_at_the_same_seed_writes_the_same_weights(workdir, tiny_model_dir, capsys):
    """llm-compressor drew calibration windows in an unseeded random order by default, and AWQ's
    sums then rounded differently run to run (different checkpoints from one recipe and seed).
    Two AWQ jobs now hash the same, tensor for tensor; another seed (other windows) does not."""
    from quantbench.cli import main
    from quantbench.sources.checkpoint import read_info
    from tests.helpers import last_json, runs, tiny_recipe, write_recipe

    write_recipe(workdir, "awq", tiny_recipe(tiny_model_dir, "method: awq\ngroup_size: 32\nn_grid: 4\n"))
    made = []
    for seed in (0, 0, 1):
        assert main(["quantize", "awq", "--set", f"calibration.seed={seed}", "--json"]) == 0
        made.append(last_json(capsys.readouterr().out))
    tags = {r.info.run_id: r.data.tags for r in runs()}
    shas = [tags[m["run_id"]]["quantbench.weights_sha"] for m in made]
    assert len(shas[0]) == 64 and shas[0] == shas[1] != shas[2]
    assert made[0]["metrics"]["check/reload_ppl"] == made[1]["metrics"]["check/reload_ppl"]
    assert read_info(Path(made[0]["checkpoint"]))["weights_sha"] == shas[0]


def test_computed_in_float32_or_bfloat16_the_checkpoint_is_the_same(workdir, tiny_model_dir, capsys):
    """model.compute_dtype changes what the job computes in, not what it saves: the same RTN recipe
    (saved in bfloat16) computed in float32 and in bfloat16 writes the same tensors in the same
    dtypes, its integer weights equal but for values that sit on a rounding boundary, and its scales
    within bfloat16's rounding. The run records the dtype it computed in; the estimate is logged."""
    from safetensors.torch import load_file

    from quantbench.cli import main
    from tests.helpers import last_json, runs, tiny_recipe, write_recipe

    body = tiny_recipe(tiny_model_dir, "method: rtn\ngroup_size: 32\nsymmetric: true\n").replace(
        "  dtype: float32\n", "  dtype: bfloat16\n")
    write_recipe(workdir, "rtn", body)
    made = {}
    for dtype in ("float32", "bfloat16"):
        assert main(["quantize", "rtn", "--set", f"model.compute_dtype={dtype}", "--json"]) == 0
        made[dtype] = last_json(capsys.readouterr().out)
    tags = {r.info.run_id: r.data.tags for r in runs()}
    assert [tags[made[d]["run_id"]]["quantbench.compute_dtype"] for d in made] == ["float32", "bfloat16"]
    f32, bf16 = (load_file(str(Path(made[d]["checkpoint"]) / "model.safetensors")) for d in made)
    assert sorted(f32) == sorted(bf16)
    packed = 0
    for name, tensor in f32.items():
        other = bf16[name]
        assert tensor.dtype == other.dtype and tensor.shape == other.shape, name
        if tensor.is_floating_point():
            assert tensor.dtype == torch.bfloat16, name  # saved in the recipe's dtype either way
            assert torch.allclose(tensor.float(), other.float(), rtol=2 ** -7, atol=1e-6), name
        elif name.endswith(("weight_packed", "weight_zero_point")):
            packed += name.endswith("weight_packed")
            nibbles = lambda t: torch.stack([(t.to(torch.int64) >> (4 * i)) & 15 for i in range(8)])  # noqa: E731
            step = (nibbles(tensor) - nibbles(other)).abs()
            assert step.max() <= 1, f"{name}: 4-bit values {step.max()} steps apart"
            assert step.float().mean() < 0.05, f"{name}: {step.float().mean():.2%} of 4-bit values one step apart"
        else:
            assert torch.equal(tensor, other), name
    assert packed == 14  # 7 Linear layers in each of 2 blocks


def test_a_calibrated_model_is_let_go_after_quantizing(workdir, tiny_model_dir):
    """llm-compressor's sequential pipeline registers the namespaces it traces a model in with
    torch.fx for good, and the model with them (without the guard, below, it stays alive); inside
    `traced_namespaces_forgotten` the registry is left as it was found and the model can go."""
    import gc
    import weakref

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantbench.quantize import make_quantizer
    from quantbench.quantize.llmcompressor import traced_namespaces_forgotten
    from quantbench.recipe import load_recipe
    from tests.helpers import tiny_recipe, write_recipe

    write_recipe(workdir, "gptq", tiny_recipe(tiny_model_dir, "method: gptq\ngroup_size: 32\n"))
    quantizer = make_quantizer(load_recipe(workdir / "recipes" / "gptq.yaml").recipe.quantize)
    ids = AutoTokenizer.from_pretrained(tiny_model_dir)("def f(x):\n    return x * 2\n" * 20)["input_ids"][:64]

    def quantized(guard: bool):
        from llmcompressor.core import reset_session
        from torch.fx import _symbolic_trace

        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        registered = set(_symbolic_trace._wrapped_fns_to_patch)
        if guard:
            with traced_namespaces_forgotten():
                quantizer.quantize(model, [ids] * 4)
            assert set(_symbolic_trace._wrapped_fns_to_patch) == registered
        else:
            quantizer.quantize(model, [ids] * 4)
        reset_session()
        ref = weakref.ref(model)
        del model
        gc.collect()
        return ref

    assert quantized(guard=True)() is None
    with traced_namespaces_forgotten():  # (what the unguarded call leaves is dropped after it)
        assert quantized(guard=False)() is not None  # the library's behaviour this guards against


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


def test_a_model_detached_from_its_files_maps_them_no_more_and_keeps_its_weights(tmp_path):
    """A weight rescaled in place inside a loaded model's file mapping becomes an anonymous copy that
    stays with the mapping (AWQ on the 3B ladder rung: 11.8 GiB where 7.7 were planned): the
    calibrating methods copy the weights out first. Tied weights stay tied."""
    import gc

    from transformers import AutoConfig, AutoModelForCausalLM

    from quantbench.quantize.llmcompressor import detach_from_files

    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                  tie_word_embeddings=True)  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    gc.collect()
    assert _mapped(weights)  # loaded, the weights are views of the file
    detach_from_files(model)
    gc.collect()
    assert not _mapped(weights)
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
