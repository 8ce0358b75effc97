"""The quantizer registry: every entry a `Backend` subclass that owns its method's facts."""

import importlib.util

import pytest

from quantbench.quantize import BACKENDS, PACKAGES, Backend, get_backend


@pytest.mark.parametrize("key", BACKENDS)
def test_every_registered_quantizer_is_a_backend_with_its_facts(key):
    module = BACKENDS[key].partition(":")[0]
    if importlib.util.find_spec(PACKAGES[module]) is None:
        pytest.skip(f"{PACKAGES[module]} is not installed")
    method, _, fmt = key.partition("/")
    cls = get_backend(method, fmt or None)
    assert issubclass(cls, Backend) and cls is not Backend
    for fact in ("engine", "format", "loaders", "quantization_config", "check", "prepare", "produce"):
        assert getattr(cls, fact, None) is not None or fact == "format", (key, fact)
    # what a method must say itself: nothing on the base class answers these
    assert cls.loaders is not Backend.loaders and cls.quantization_config is not Backend.quantization_config
    assert cls.produce is not Backend.produce and isinstance(cls.engine, str)
