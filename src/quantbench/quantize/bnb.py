"""bitsandbytes INT8 (LLM.int8) and 4-bit NF4/FP4 through transformers' `BitsAndBytesConfig`:
the weights are quantized as the model loads, and the checkpoint is a transformers checkpoint
with bitsandbytes serialization (loads wherever transformers and bitsandbytes run).

Trap (bitsandbytes 0.50.2, measured on an AMX machine; it did not reproduce on an AVX2-only one):
a 4-bit model saved *after* any forward pass reloads as garbage (perplexity ~5e7) while the
in-memory model looks fine. So this quantizer loads the quantized model and saves it before anything
runs it, which is safe on both; the quantize stage's reload check scores the checkpoint from disk,
never the in-memory model. `test_bnb.py` checks the order and reports which this CPU does.
"""

from __future__ import annotations

from pathlib import Path

import bitsandbytes  # noqa: F401  (a missing package fails here, named by the registry)
import torch

from quantbench.quantize import Inputs, Produced, Quantizer, recipe_layers
from quantbench.recipe.methods import BnbSpec

# bitsandbytes 0.50's 4-bit CPU kernels repack weights in blocks of 64 input features (the
# quantization block size) on the first forward; other widths crash there, so check first.
BNB_4BIT_BLOCK = 64


class BnbQuantizer(Quantizer):
    """The base model quantized while it loads, saved before anything runs it."""

    library = "bitsandbytes"
    format = "bitsandbytes"
    calibrates = False
    trains = False
    on_load = True
    takes_model = False  # a fresh copy is quantized while it loads

    @staticmethod
    def loaders() -> str:
        return f"bitsandbytes {bitsandbytes.__version__} — transformers (+bitsandbytes, CPU or GPU), vLLM (GPU)"

    def __init__(self, spec: BnbSpec):
        self.spec = spec

    def quantization_config(self) -> dict:
        return {"quant_method": "bitsandbytes"}

    def check(self, loaded, config) -> list[str]:
        """4-bit on a CPU: every quantized layer's input width a multiple of the kernel's block."""
        if self.spec.scheme == "INT8" or torch.cuda.is_available():
            return []
        bad: dict[int, list[str]] = {}
        for name, width, _ in recipe_layers(config, self.spec.ignore):
            if width % BNB_4BIT_BLOCK:
                bad.setdefault(width, []).append(name)
        if not bad:
            return []
        detail = "; ".join(f"width {w} ({len(n)} layers, e.g. {n[0]})" for w, n in sorted(bad.items()))
        return [
            f"{loaded.path}: {loaded.where('quantize', 'scheme')}: {self.spec.scheme} cannot quantize these layers of "
            f"{loaded.recipe.model.source} (bitsandbytes 4-bit on CPU packs weights in blocks of {BNB_4BIT_BLOCK} "
            f"input features): {detail}. Use scheme INT8, or add them to quantize.ignore."
        ]

    def prepare(self, loaded, base, tokenizer) -> dict[str, str]:
        return {}

    def produce(self, inputs: Inputs) -> Produced:
        inputs.drop_model()  # a fresh copy is quantized while it loads
        model = self.load(inputs.base.path, getattr(torch, inputs.loaded.recipe.model.dtype))
        self.save(model, inputs.tokenizer, inputs.staging)  # before any forward pass: see the trap above
        return Produced(card="- Calibration: none (quantized while loading)")

    def config(self):
        from transformers import BitsAndBytesConfig

        spec = self.spec
        skip = [name for name in spec.ignore if not name.startswith("re:")]
        if spec.scheme == "INT8":
            return BitsAndBytesConfig(
                load_in_8bit=True, llm_int8_threshold=spec.int8_threshold, llm_int8_skip_modules=skip
            )
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=spec.scheme.lower(),
            bnb_4bit_use_double_quant=spec.double_quant,
            bnb_4bit_compute_dtype=getattr(torch, spec.compute_dtype),
            llm_int8_skip_modules=skip,
        )

    def load(self, base_path: Path, dtype: torch.dtype):
        """The base model, quantized while it loads (on this process's device: CPU here)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            base_path,
            dtype=dtype,
            quantization_config=self.config(),
            device_map="cuda" if torch.cuda.is_available() else "cpu",
        )

    def save(self, model, tokenizer, dest: Path) -> None:
        model.save_pretrained(dest)
        tokenizer.save_pretrained(dest)
