"""The narrow CPU patch for AWQ, guarded against the library changing under it."""

import inspect

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
