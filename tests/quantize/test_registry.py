"""The quantizer registry: every entry a `Quantizer` subclass that owns its method's facts."""

import importlib.util

import pytest

from quantbench.quantize import PACKAGES, QUANTIZERS, Quantizer, quantizer_class


@pytest.mark.parametrize("key", QUANTIZERS)
def test_every_registered_quantizer_is_a_quantizer_with_its_facts(key):
    module = QUANTIZERS[key].partition(":")[0]
    if importlib.util.find_spec(PACKAGES[module]) is None:
        pytest.skip(f"{PACKAGES[module]} is not installed")
    method, _, fmt = key.partition("/")
    cls = quantizer_class(method, fmt or None)
    assert issubclass(cls, Quantizer) and cls is not Quantizer
    for fact in ("library", "format", "loaders", "quantization_config", "check", "prepare", "produce"):
        assert getattr(cls, fact, None) is not None or fact == "format", (key, fact)
    # what a method must say itself: nothing on the base class answers these
    assert cls.loaders is not Quantizer.loaders and cls.quantization_config is not Quantizer.quantization_config
    assert cls.produce is not Quantizer.produce and isinstance(cls.library, str)
