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
    from quantbench.checkpoint import read_info
    from quantbench.cli import main
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
