"""GPTQ, AWQ, FP8 and SmoothQuant through llm-compressor; writes compressed-tensors checkpoints
(the format vLLM serves, and transformers loads)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import llmcompressor  # noqa: F401  (configures its loguru sinks now, before a run's log file is added)
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from quantbench.quantize import Inputs, Produced, calibration_card, group_size_problem
from quantbench.recipe import AWQSpec, FP8Spec, GPTQSpec, SmoothQuantSpec


# recipe `kv_cache:` -> llm-compressor's kv_cache_scheme (static per-tensor scales, calibrated)
KV_CACHE_SCHEMES = {"fp8": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}}


class LLMCompressorBackend:
    """llm-compressor's oneshot on the loaded base model, in place; saved compressed."""

    engine = "llm-compressor"
    format = "compressed-tensors"
    trains = False
    on_load = False

    @staticmethod
    def loaders() -> str:
        import compressed_tensors

        return f"compressed-tensors {compressed_tensors.__version__} — vLLM, SGLang, transformers (+compressed-tensors)"

    def __init__(self, spec: GPTQSpec | AWQSpec | FP8Spec | SmoothQuantSpec):
        self.spec = spec
        self.calibrates = not isinstance(spec, FP8Spec) or spec.kv_cache is not None

    def check(self, loaded, config) -> list[str]:
        group_size = getattr(self.spec, "group_size", None)
        return group_size_problem(loaded, config, group_size) if group_size else []

    def prepare(self, loaded, base, tokenizer) -> dict[str, str]:
        return {}

    def produce(self, inputs: Inputs) -> Produced:
        model = inputs.take_model()
        self.quantize(model, inputs.calibration)
        self.save(model, inputs.tokenizer, inputs.staging)
        return Produced(card=calibration_card(inputs))

    def modifiers(self) -> list:
        """The llm-compressor recipe for this spec, as modifier objects."""
        from llmcompressor.modifiers.gptq import GPTQModifier
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

        spec = self.spec
        kv = {"kv_cache_scheme": KV_CACHE_SCHEMES[spec.kv_cache]} if spec.kv_cache else {}
        if isinstance(spec, GPTQSpec):
            bits = {"W4A16": 4, "W8A16": 8}[spec.scheme]
            return [
                GPTQModifier(
                    config_groups={"group_0": weight_only_scheme(bits, spec.group_size, spec.symmetric)},
                    ignore=spec.ignore,
                    block_size=spec.block_size,
                    dampening_frac=spec.dampening_frac,
                    **kv,
                )
            ]
        if isinstance(spec, AWQSpec):
            # AWQ only rescales channels; the quantization modifier after it rounds the weights
            # on the grid AWQ searched against.
            return [
                AWQModifier(n_grid=spec.n_grid, duo_scaling=spec.duo_scaling),
                QuantizationModifier(
                    config_groups={"group_0": weight_only_scheme(4, spec.group_size, spec.symmetric)},
                    ignore=spec.ignore,
                    **kv,
                ),
            ]
        if isinstance(spec, FP8Spec):
            return [QuantizationModifier(targets=["Linear"], scheme=spec.scheme, ignore=spec.ignore, **kv)]
        return [
            SmoothQuantModifier(smoothing_strength=spec.smoothing_strength),
            GPTQModifier(targets=["Linear"], scheme=spec.scheme, ignore=spec.ignore, dampening_frac=spec.dampening_frac, **kv),
        ]

    def quantize(self, model, calibration: list[list[int]] | None) -> None:
        from llmcompressor import oneshot

        kwargs = {}
        if self.calibrates:
            from datasets import Dataset

            kwargs = {
                "dataset": Dataset.from_dict(
                    {"input_ids": calibration, "attention_mask": [[1] * len(row) for row in calibration]}
                ),
                "num_calibration_samples": len(calibration),
                "max_seq_length": max(len(row) for row in calibration),
                # The windows are already chosen and ordered by calibration.seed. llm-compressor's
                # default draws them in an unseeded random order (a RandomSampler on torch's global
                # generator), and AWQ's and GPTQ's sums over batches then round differently run
                # to run: the same recipe and seed gave different checkpoints.
                "shuffle_calibration_samples": False,
            }
        with cpu_safe_pinning():
            oneshot(model=model, recipe=self.modifiers(), **kwargs)

    def save(self, model, tokenizer, dest: Path) -> None:
        model.save_pretrained(dest, save_compressed=True)
        tokenizer.save_pretrained(dest)


def weight_only_scheme(bits: int, group_size: int | None, symmetric: bool) -> QuantizationScheme:
    weights = QuantizationArgs(
        num_bits=bits,
        type="int",
        symmetric=symmetric,
        strategy="group" if group_size else "channel",
        group_size=group_size,
    )
    return QuantizationScheme(targets=["Linear"], weights=weights)


@contextmanager
def cpu_safe_pinning():
    """Let llm-compressor 0.14's AWQ run on a machine without an accelerator.

    Before each layer's scale search AWQ pins its cached activations
    (`IntermediatesCache.pin_memory`) so later host-to-GPU copies can be non-blocking. Pinning
    needs an accelerator and raises "Cannot access accelerator device when none is available"
    without one. On such a machine nothing is ever copied to a device, so pinning has no
    purpose: for the duration, and only then, it becomes a no-op. Nothing else changes.
    tests/quantize/test_llmcompressor.py fails if the library stops needing this or moves it.
    """
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield
        return
    original = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = _no_pinning
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original


def _no_pinning(self, batch_index: int, input_names: list[str] | None = None) -> None:
    return None
