"""bitsandbytes INT8 (LLM.int8) and 4-bit NF4/FP4 through transformers' `BitsAndBytesConfig`:
the weights are quantized as the model loads, and the checkpoint is a transformers checkpoint
with bitsandbytes serialization (loads wherever transformers and bitsandbytes run).

Trap (bitsandbytes 0.50.2, measured here): a 4-bit model saved *after* any forward pass reloads
as garbage (perplexity ~5e7) while the in-memory model looks fine. So this backend loads the
quantized model and saves it before anything runs it; the quantize stage's reload check scores
the checkpoint from disk, never the in-memory model. `test_bnb.py` reproduces the trap.
"""

from __future__ import annotations

from pathlib import Path

import bitsandbytes  # noqa: F401  (a missing package fails here, named by the registry)
import torch

from quantbench.recipe import BnbSpec


class BnbBackend:
    format = "bitsandbytes"
    needs_calibration = False
    loads_quantized = True  # the job loads the model through `load`, not an in-place `quantize`

    @staticmethod
    def loaders() -> str:
        return f"bitsandbytes {bitsandbytes.__version__} — transformers (+bitsandbytes, CPU or GPU), vLLM (GPU)"

    def __init__(self, spec: BnbSpec):
        self.spec = spec

    def config(self):
        from transformers import BitsAndBytesConfig

        spec = self.spec
        skip = [name for name in spec.ignore if not name.startswith("re:")]
        if spec.scheme == "INT8":
            return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=spec.int8_threshold, llm_int8_skip_modules=skip)
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

        return AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype, quantization_config=self.config(),
                                                    device_map="cuda" if torch.cuda.is_available() else "cpu")

    def save(self, model, tokenizer, dest: Path) -> None:
        model.save_pretrained(dest)
        tokenizer.save_pretrained(dest)
